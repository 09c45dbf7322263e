"""Models in a bucket (huginn_ray.model_cache): `--checkpoint s3://...` and `init_from: s3://...` read a training
checkpoint or an export from this node's cache, downloaded once, keyed by every object's version; `export --out
s3://...` uploads with config.json last. Against moto's S3 server; no Ray."""

from __future__ import annotations

import argparse
import importlib.util
import threading
from pathlib import Path

import pytest
import torch

from huginn_ray import storage
from huginn_ray.config import ConfigError, load_config
from huginn_ray.model import ModelConfig, RecurrentGPT, load_pretrained
from huginn_ray.model import export
from huginn_ray.model_cache import CACHE_ENV, cache_root, local_model_dir
from s3_server import s3_fixture

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512


s3 = s3_fixture("models")


@pytest.fixture(scope="module")
def made(s3, tmp_path_factory):
    """A tokenizer, a complete training checkpoint of a raven-tiny and its model, the checkpoint uploaded (marker
    last) to s3://models/run/checkpoint_000001."""
    from huginn_ray.data.tokenizer import train_tokenizer
    from huginn_ray.train import checkpoint as ckpt
    from huginn_ray.train.config import OptimConfig
    from huginn_ray.train.optim import build_optimizer

    root = tmp_path_factory.mktemp("models")
    tokenizer = train_tokenizer(["one two three four five six seven eight"] * 20, 300, root / "tokenizer",
                                use_manual_tokens=False)
    torch.manual_seed(3)
    model = RecurrentGPT(ModelConfig.from_name("raven-tiny", vocab_size=VOCAB))
    checkpoint = root / "run" / "checkpoint_000001"
    assert ckpt.write(checkpoint, 0, model, build_optimizer(model, OptimConfig()),
                      ckpt.TrainerState(step=1, world_size=1), torch.device("cpu"))
    uri = "s3://models/run/checkpoint_000001"
    storage.upload_dir(checkpoint, uri, last=ckpt.MARKER)
    return root, tokenizer, model, checkpoint, uri


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.fixture
def downloads(monkeypatch):
    """Every location storage.download_file is asked for, in order."""
    asked = []
    download = storage.download_file
    monkeypatch.setattr(storage, "download_file", lambda location, local: (asked.append(location),
                                                                          download(location, local)))
    return asked


def entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.is_dir())


def test_export_from_a_bucket_checkpoint_is_bitwise_the_local_one(made, cache, tmp_path, capsys):
    root, tokenizer, _, checkpoint, uri = made
    assert export.main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "local"),
                        "--tokenizer", str(tokenizer)]) == 0
    assert export.main(["--checkpoint", uri, "--out", str(tmp_path / "bucket"), "--tokenizer", str(tokenizer)]) == 0
    key, = entries(cache)
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2].startswith(f"[huginn] --checkpoint: {uri} downloaded to {cache / key} (")
    assert printed[-1] == f"[huginn] exported {uri} to {tmp_path / 'bucket'}"
    names = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "bucket").iterdir())
    for name in names:
        assert (tmp_path / "bucket" / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name
    # the checkpoint's model/ named directly is read with its checkpoint (the weights are in state/), as locally
    assert local_model_dir(f"{uri}/model") == cache / key / "model"
    assert entries(cache) == [key]


def test_generation_from_the_bucket_gives_the_local_tokens(made, cache, capsys):
    root, tokenizer, _, checkpoint, uri = made
    spec = importlib.util.spec_from_file_location("generate_job", REPO / "jobs" / "generate.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    outputs = []
    for where in (str(checkpoint), uri):
        assert job.main(["--checkpoint", where, "--tokenizer", str(tokenizer), "--prompt", "one two",
                         "--num-steps", "2", "--max-new-tokens", "5", "--device", "cpu"]) == 0
        lines = capsys.readouterr().out.splitlines()
        outputs.append([lines[0], lines[2]])  # the text, and each token's iterations (the timing line differs)
    assert outputs[0] == outputs[1]
    assert outputs[0][1] == "[huginn] mean core iterations per token: 2.00 (per token: 2 2 2 2 2)"


def test_serve_hands_the_replicas_the_bucket_uri(made, cache, capsys):
    """jobs/serve.py's plan checks the driver's copy and gives every replica the URI, not a driver-local path."""
    root, tokenizer, _, checkpoint, uri = made
    spec = importlib.util.spec_from_file_location("serve_job", REPO / "jobs" / "serve.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    options = dict(host="127.0.0.1", port=8000, replicas=2, device="cpu", dtype=None, max_rows=4, max_cache_gib=1.0,
                   exit_wait_steps=0, admit_rows=1, cuda_graphs=False, compile=True, model_name=None, api_key=None)
    settings = job.plan(argparse.Namespace(checkpoint=f"{uri}/", tokenizer=str(tokenizer), **options))
    assert (settings.model_dir, settings.tokenizer_dir, settings.model_name) == (uri, str(tokenizer),
                                                                                 "checkpoint_000001")
    with pytest.raises(ValueError, match=rf"^no tokenizer stored with {uri}: pass --tokenizer$"):
        job.plan(argparse.Namespace(checkpoint=uri, tokenizer=None, **options))
    local = job.plan(argparse.Namespace(checkpoint=str(checkpoint), tokenizer=str(tokenizer), **options))
    assert (local.model_dir, local.model_name) == (str(checkpoint / "model"), "checkpoint_000001")


def test_the_cache_is_filled_once_per_version(made, cache, downloads, s3):
    """A second resolve downloads nothing; concurrent first resolves download once; one changed object (a new
    ETag, same size) makes a new entry."""
    root, _, model, checkpoint, _ = made
    uri = "s3://models/export_a"
    storage.upload_dir(export.export(model, root / "export_a"), uri, last="config.json")
    objects = storage.list_prefix(uri)
    threads = [threading.Thread(target=local_model_dir, args=(uri,)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(downloads) == objects  # each object once, though three resolved at once
    first, = entries(cache)
    stamps = {p: p.stat().st_mtime_ns for p in (cache / first).rglob("*")}
    assert local_model_dir(uri) == cache / first
    assert downloads == sorted(downloads) and len(downloads) == len(objects)  # nothing more
    assert {p: p.stat().st_mtime_ns for p in (cache / first).rglob("*")} == stamps
    assert sorted(p.name for p in cache.iterdir() if not p.is_dir()) == [f"{first}.lock"]  # no temporary left

    generation = (root / "export_a" / "generation_config.json").read_text()
    changed = generation.replace('"do_sample": false', '"do_sample": FALSE')
    assert len(changed) == len(generation) and changed != generation
    storage.write_text(f"{uri}/generation_config.json", changed)
    second = local_model_dir(uri)
    assert second.parent == cache and second.name != first and sorted(entries(cache)) == sorted([first, second.name])
    assert len(downloads) == 2 * len(objects)
    assert (second / "generation_config.json").read_text() == changed
    assert (cache / first / "generation_config.json").read_text() == generation


def test_nothing_there_or_an_object_missing_is_refused_naming_the_location(made, cache, s3):
    root, _, model, checkpoint, uri = made
    with pytest.raises(ConfigError, match=r"^--checkpoint: nothing at s3://models/nowhere \(no objects under it\)$"):
        local_model_dir("s3://models/nowhere")
    with pytest.raises(ConfigError, match=r"^init_from: .*s3://elsewhere/x: bucket elsewhere does not exist$"):
        local_model_dir("s3://elsewhere/x", "init_from")
    broken = "s3://models/broken/checkpoint_000001"
    storage.upload_dir(checkpoint, broken)
    missing = min(name for name in storage.list_prefix(f"{broken}/state") if name.endswith(".distcp"))
    size = storage.size(missing)
    storage.delete(missing)
    name = missing[len(broken) + 1:]
    with pytest.raises(ConfigError, match=rf"^--checkpoint: {broken} is not a complete checkpoint: {name} is "
                                          rf"missing \(checkpoint_complete.json lists it with {size} bytes\)$"):
        local_model_dir(broken)
    no_weights = "s3://models/no_weights"
    storage.upload_dir(export.export(model, root / "no_weights"), no_weights)
    storage.delete(f"{no_weights}/model.safetensors")
    with pytest.raises(ConfigError, match=rf"^--checkpoint: no model.safetensors or "
                                          rf"model.safetensors.index.json in {no_weights}$"):
        local_model_dir(no_weights)
    with pytest.raises(ConfigError, match=r"^--checkpoint: s3://models/run holds no model directory \(config.json or "
                                          r"model/config.json at its top\)"):
        local_model_dir("s3://models/run")


def test_export_to_a_bucket_writes_config_json_last_and_loads(made, cache, monkeypatch, tmp_path):
    root, tokenizer, model, checkpoint, _ = made
    uploaded = []
    upload = storage.upload_file
    monkeypatch.setattr(storage, "upload_file", lambda local, location: (uploaded.append(location),
                                                                        upload(local, location)))
    out = "s3://models/hf"
    assert export.main(["--checkpoint", str(checkpoint), "--out", out, "--tokenizer", str(tokenizer)]) == 0
    assert uploaded[-1] == f"{out}/config.json" and sorted(uploaded) == storage.list_prefix(out)
    assert export.main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "local"),
                        "--tokenizer", str(tokenizer)]) == 0
    for location in uploaded:
        assert storage.read_bytes(location) == (tmp_path / "local" / location[len(out) + 1:]).read_bytes()
    loaded = load_pretrained(local_model_dir(out))
    assert all(torch.equal(loaded.state_dict()[key], value) for key, value in model.state_dict().items())


def test_init_from_a_bucket_resolves_checks_and_loads_through_the_cache(made, cache):
    from huginn_ray.train import init_from
    from huginn_ray.train.config import TrainConfig

    root, tokenizer, model, checkpoint, uri = made
    fields = ["max_steps=1", "block_size=16", "data.data_dir=/nonexistent"]
    bucket = load_config(TrainConfig, None, [*fields, f"init_from={uri}"])
    local = load_config(TrainConfig, None, [*fields, f"init_from={checkpoint}"])
    assert bucket.init_from == uri
    shape = init_from.model_config(bucket)
    assert shape == init_from.model_config(local)
    source = init_from.describe_source(uri, shape)
    assert source.path == uri
    assert source.sha256 == init_from.describe_source(str(checkpoint), shape).sha256
    # the tokenizer check reads the model's config.json through the cache (an export names the special ids)
    from huginn_ray.data.tokenizer import special_token_ids

    ids = special_token_ids(tokenizer)
    exported = "s3://models/export_with_tokenizer"
    storage.upload_dir(export.export(model, root / "export_with_tokenizer", tokenizer), exported, last="config.json")
    init_from.check_tokenizer(exported, str(tokenizer), ids)
    with pytest.raises(ConfigError, match=rf"^data.tokenizer_path: its bos id is {ids['bos'] + 1}, the model in "
                                          rf"{exported} was trained with bos_token_id={ids['bos']} "):
        init_from.check_tokenizer(exported, str(tokenizer), {**ids, "bos": ids["bos"] + 1})
    torch.manual_seed(0)
    target = RecurrentGPT(shape)
    init_from.load_weights_into(target, uri)
    assert all(torch.equal(target.state_dict()[key], value) for key, value in model.state_dict().items())
    assert len(entries(cache)) == 2 and cache_root() == cache  # the checkpoint and the export, once each
