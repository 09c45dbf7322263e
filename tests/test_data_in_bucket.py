"""Training data in a bucket (a real S3 server, tests/s3_server.py): the preflight resolves the pointer object,
checks the tokenizer and every shard's footer by ranged reads, and the reader reads the very rows of the local
files; prepared data is published to a bucket as an immutable version behind a conditionally swapped pointer;
data preparation's inputs in a bucket (sources, the source list, the tokenizer) are copied and kept up to date."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

from huginn_ray import storage
from huginn_ray.data import bucket_publish, layout
from huginn_ray.data.formatting import DataError
from huginn_ray.data.shards import MANIFEST, pointer_bytes, read_manifest, shard_path, shard_version
from huginn_ray.data.tokenizer import check_tokenizer_fits, file_sha256, special_token_ids
from huginn_ray.train.config import load_train_config
from huginn_ray.train.data_order import DataOrder
from huginn_ray.train import checkpoint as ckpt
from huginn_ray.train.launch import PreflightError, data_version, preflight
from huginn_ray.train.shard_check import ShardCheckError, check_shards
from huginn_ray.train.shard_reader import ShardReader, validation_rows
from s3_server import s3_fixture
from test_train_data import make_dataset

TINY = Path(__file__).resolve().parents[1] / "configs/train/tiny_cpu.yaml"
BUCKET = "s3://data/out"


s3 = s3_fixture("data")


@pytest.fixture(scope="module")
def dataset(s3, tmp_path_factory):
    """(local shards, local tokenizer): a data directory laid out in the bucket as the lead's end-to-end test lays
    it out: the shards uploaded as `shards.v0001` (manifest last), the pointer object `shards` naming it, the
    tokenizer under `tokenizer/`."""
    shards, tokenizer = make_dataset(tmp_path_factory.mktemp("data"), num_shards=2, rows_per_shard=40, seq_len=32)
    storage.upload_dir(shards, storage.join(BUCKET, "shards.v0001"), last=MANIFEST)
    storage.write_bytes(storage.join(BUCKET, "shards"), pointer_bytes("shards.v0001"))
    storage.upload_dir(tokenizer, storage.join(BUCKET, "tokenizer"))
    return shards, tokenizer


def config(tmp_path, data_dir, tokenizer):
    return load_train_config(TINY, [f"out_dir={tmp_path}", f"data.data_dir={data_dir}",
                                    f"data.tokenizer_path={tokenizer}", "block_size=32",
                                    "model.overrides.vocab_size=64", "max_steps=20"])


def test_the_preflight_reads_pointer_tokenizer_and_footers_from_the_bucket_and_plans_as_locally(dataset, tmp_path):
    shards, tokenizer = dataset
    local = preflight(config(tmp_path, shards, tokenizer))
    plan = preflight(config(tmp_path, f"{BUCKET}/shards", f"{BUCKET}/tokenizer"))
    assert plan.data_dir == f"{BUCKET}/shards.v0001"  # the pointer object resolved, as a symlink is
    assert dataclasses.replace(plan, data_dir=local.data_dir) == local
    with pytest.raises(PreflightError, match=r"^data.data_dir: directory not found: s3://data/nowhere$"):
        preflight(config(tmp_path, "s3://data/nowhere", f"{BUCKET}/tokenizer"))
    with pytest.raises(PreflightError, match=r"^data.tokenizer_path: s3://absent/tok: bucket absent does not exist"):
        preflight(config(tmp_path, f"{BUCKET}/shards", "s3://absent/tok"))


def test_the_tokenizer_helpers_read_a_bucket_as_a_local_directory(dataset):
    _, tokenizer = dataset
    location = f"{BUCKET}/tokenizer"
    assert special_token_ids(location) == special_token_ids(tokenizer)
    assert check_tokenizer_fits(location, 64) == check_tokenizer_fits(f"{location}/tokenizer.json", 64) == 64
    assert file_sha256(f"{location}/tokenizer.json") == file_sha256(tokenizer / "tokenizer.json")
    with pytest.raises(ValueError, match=r"^tokenizer file not found: s3://data/out/nothing/tokenizer.json$"):
        check_tokenizer_fits(f"{BUCKET}/nothing", 64)


def test_the_pointer_object_is_resolved_and_must_name_a_version_beside_it(dataset):
    assert shard_version(f"{BUCKET}/shards") == f"{BUCKET}/shards.v0001"
    assert shard_version(f"{BUCKET}/shards.v0001") == f"{BUCKET}/shards.v0001"  # no pointer: the prefix itself
    assert read_manifest(f"{BUCKET}/shards") == read_manifest(f"{BUCKET}/shards.v0001")  # through the pointer
    # a resumed run keeps the version its checkpoint records while it exists, and is refused by name once it is gone
    storage.write_bytes(f"{BUCKET}/shards.v0002/{MANIFEST}", storage.read_bytes(f"{BUCKET}/shards.v0001/{MANIFEST}"))
    resumed = ckpt.TrainerState(step=6, num_streams=2, global_batch_rows=4, rows_per_stream=12,
                                data_dir=f"{BUCKET}/shards.v0002")
    assert data_version(f"{BUCKET}/shards", resumed) == f"{BUCKET}/shards.v0002"
    storage.delete(f"{BUCKET}/shards.v0002/{MANIFEST}")
    with pytest.raises(PreflightError, match=r"^data.data_dir: the run's newest checkpoint \(step 6\) was trained on "
                                             r"s3://data/out/shards.v0002, which no longer exists"):
        data_version(f"{BUCKET}/shards", resumed)
    storage.write_text(f"{BUCKET}/bad", "../elsewhere\n")
    with pytest.raises(ValueError, match=r"s3://data/out/bad: a shard pointer must name a version beside it "
                                         r"\(bad.vNNNN\), it holds '../elsewhere'"):
        shard_version(f"{BUCKET}/bad")


def test_the_footer_check_refuses_a_truncated_or_missing_object_by_name_and_passes_good_ones(dataset):
    shards, _ = dataset
    manifest = read_manifest(f"{BUCKET}/shards.v0001")
    assert check_shards(f"{BUCKET}/shards.v0001", manifest, 64).files == 4
    broken = f"{BUCKET}/broken"
    storage.upload_dir(shards, broken)
    data = (shards / "train" / "00001.parquet").read_bytes()
    storage.write_bytes(f"{broken}/train/00001.parquet", data[:len(data) // 2])
    with pytest.raises(ShardCheckError) as err:
        check_shards(broken, manifest, 64)
    assert str(err.value).startswith(f"{broken}/train/00001.parquet: not a readable parquet file (truncated or "
                                     "corrupt?): ")
    storage.delete(f"{broken}/train/00001.parquet")
    with pytest.raises(ShardCheckError, match=f"^missing shard of rank 1: {broken}/train/00001.parquet$"):
        check_shards(broken, manifest, 64)


def test_the_reader_reads_the_local_rows_bit_for_bit_from_the_bucket(dataset):
    shards, _ = dataset
    version = f"{BUCKET}/shards.v0001"
    assert shard_path(version, "train", 1) == f"{version}/train/00001.parquet"
    local, remote = (ShardReader(shard_path(d, "train", 1), 1, 5, 33) for d in (shards, version))
    for count in (7, 20, 13):  # across row groups of 16
        a, b = local.next_rows(count), remote.next_rows(count)
        assert np.array_equal(a.ids, b.ids) and np.array_equal(a.keys, b.keys) and b.loss_mask is None
    local.seek(9), remote.seek(9)
    assert np.array_equal(local.next_rows(30).ids, remote.next_rows(30).ids)
    order = DataOrder(2, 4, 2, 2).check()
    a, b = validation_rows(shards, order, 1, 3, 33), validation_rows(version, order, 1, 3, 33)
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.keys, b.keys)


def published_locally(root: Path, source: Path) -> Path:
    """`root/shards` pointing to a new local version holding a copy of `source` (layout.publish_version)."""
    work = root / "work"
    shutil.copytree(source, work)
    layout.publish_version(work, root / "shards")
    return root


def test_a_publish_uploads_the_scratch_version_then_swaps_the_pointer_and_a_raced_publisher_loses(
        dataset, tmp_path, monkeypatch, capsys):
    shards, tokenizer = dataset
    out = "s3://data/published"
    root = published_locally(tmp_path / "scratch", shards)
    shutil.copytree(tokenizer, root / "tokenizer")
    assert bucket_publish.publish_to_bucket(root, out, root / "tokenizer") == f"{out}/shards.v0001"
    assert storage.read_text(f"{out}/shards") == "shards.v0001\n"
    for path in sorted(shards.rglob("*")):  # the version's objects are the local files' bytes
        if path.is_file():
            assert storage.read_bytes(f"{out}/shards.v0001/{path.relative_to(shards)}") == path.read_bytes()
    assert storage.read_bytes(f"{out}/tokenizer/tokenizer.json") == (tokenizer / "tokenizer.json").read_bytes()
    bucket_publish.publish_to_bucket(root, out, root / "tokenizer")  # the same manifest: nothing to upload
    assert "already names shards.v0001" in capsys.readouterr().out and bucket_publish.versions(out) == ["shards.v0001"]

    newer = tmp_path / "newer"
    shutil.copytree(shards, newer)
    (newer / MANIFEST).write_text((newer / MANIFEST).read_text().replace('"seed": 0', '"seed": 1'))
    published_locally(root, newer)
    assert bucket_publish.publish_to_bucket(root, out, None) == f"{out}/shards.v0002"
    assert shard_version(f"{out}/shards") == f"{out}/shards.v0002"

    upload = storage.upload_dir

    def upload_while_another_publishes(local, location, last=None):
        names = upload(local, location, last=last)
        storage.write_bytes(f"{out}/shards", pointer_bytes("shards.v0001"))  # another publisher moved it
        return names

    (newer / MANIFEST).write_text((newer / MANIFEST).read_text().replace('"seed": 1', '"seed": 2'))
    published_locally(root, newer)
    monkeypatch.setattr(storage, "upload_dir", upload_while_another_publishes)
    with pytest.raises(DataError, match=r"^s3://data/published/shards: another publisher moved the pointer while "
                                        r"s3://data/published/shards.v0003 was uploaded"):
        bucket_publish.publish_to_bucket(root, out, None)
    assert shard_version(f"{out}/shards") == f"{out}/shards.v0001"  # the winner's
    assert bucket_publish.remove_old_versions(out) == [f"{out}/shards.v0002", f"{out}/shards.v0003"]
    assert bucket_publish.versions(out) == ["shards.v0001"]


def mirrored(cfg, items):
    from huginn_ray.data.bucket_sources import mirror_bucket_inputs
    from huginn_ray.data.sources import parse_sources

    return mirror_bucket_inputs(cfg, parse_sources(items, "sources.yaml"))


def test_a_bucket_source_is_copied_and_a_rerun_downloads_only_new_objects_and_keeps_the_fingerprint(
        s3, tmp_path, monkeypatch):
    from huginn_ray.data.config import DataConfig
    from huginn_ray.data.staging import input_fingerprint, list_local_files

    prefix = "s3://data/texts"
    for name, text in (("a.txt", "alpha"), ("deep/b.txt", "beta"), ("skip.md", "not a pattern")):
        storage.write_text(f"{prefix}/{name}", text)
    storage.write_bytes(f"{prefix}/deep/", b"")  # a directory marker: no file
    cfg = DataConfig(output_dir=str(tmp_path / "out"), sources="sources.yaml")
    items = [{"name": "texts", "local_dir": prefix, "files": ["*.txt"], "features": ["text"]}]
    downloads = []
    download = storage.download_file
    monkeypatch.setattr(storage, "download_file", lambda location, local: (downloads.append(location),
                                                                           download(location, local)))

    def fingerprint():
        [source] = mirrored(cfg, items)
        assert (source.local_dir, source.mirrored_from) == (str(tmp_path / "out/mirror/texts"), prefix)
        files = list_local_files(source)
        return [p.relative_to(source.local_dir).as_posix() for p in files], input_fingerprint(source, files)[0]

    names, first = fingerprint()
    assert names == ["a.txt", "deep/b.txt"] and sorted(downloads) == [f"{prefix}/a.txt", f"{prefix}/deep/b.txt"]
    assert (tmp_path / "out/mirror/texts/deep/b.txt").read_text() == "beta"
    downloads.clear()
    assert fingerprint() == (names, first) and downloads == []  # an unchanged bucket: nothing fetched or restaged
    storage.write_text(f"{prefix}/a.txt", "alpha, rewritten")
    names, changed = fingerprint()
    assert downloads == [f"{prefix}/a.txt"] and changed != first
    assert (tmp_path / "out/mirror/texts/a.txt").read_text() == "alpha, rewritten"
    storage.delete(f"{prefix}/deep/b.txt")
    downloads.clear()
    names, _ = fingerprint()
    assert names == ["a.txt"] and downloads == [] and not (tmp_path / "out/mirror/texts/deep").exists()
    copy = tmp_path / "out/mirror/texts"  # a local directory's versions: the modification times
    assert storage.list_versions(str(copy)) == [("a.txt", 16, str((copy / "a.txt").stat().st_mtime_ns))]
    with pytest.raises(DataError, match=r"^source 'texts': no object under s3://data/texts matches \['\*.json'\]$"):
        mirrored(cfg, [{**items[0], "files": ["*.json"]}])


def test_a_packed_bucket_source_is_recorded_in_the_manifest_by_its_uri_with_each_file_sha256(s3, tmp_path):
    import hashlib

    from huginn_ray.data.config import DataConfig
    from huginn_ray.data.pipeline import packed_source_provenance

    prefix = "s3://data/released"
    for name in ("train/0.parquet", "val/0.parquet"):
        storage.write_text(f"{prefix}/{name}", f"rows of {name}")
    cfg = DataConfig(output_dir=str(tmp_path / "out"), sources="sources.yaml")
    [source] = mirrored(cfg, [{"name": "released", "kind": "packed", "local_dir": prefix,
                               "train_files": ["train/*"], "val_files": ["val/*"]}])
    split_files = {split: [{"rel": f"{split}/0.parquet", "size": 19, "hash": None, "train_rows": 2 * (split == "train"),
                            "val_rows": 2 * (split == "val")}] for split in ("train", "val")}
    record = packed_source_provenance(cfg, source, split_files)
    assert record["local_dir"] == prefix and (record["train_rows"], record["val_rows"]) == (2, 2)
    assert record["files"] == [{"path": f"{split}/0.parquet", "size": 19,
                                "hash": hashlib.sha256(f"rows of {split}/0.parquet".encode()).hexdigest()}
                               for split in ("train", "val")]


def test_the_sources_file_and_tokenizer_path_load_from_the_bucket(dataset, tmp_path):
    from huginn_ray.config import ConfigError
    from huginn_ray.data.config import load_data_config
    from huginn_ray.data.pipeline import tokenizer_facts
    from huginn_ray.data.sources import load_sources

    _, tokenizer = dataset
    storage.write_text("s3://data/lists/sources.yaml", "- {name: texts, local_dir: 's3://data/texts', features: "
                                                       "[text]}\n- {name: lib, local_dir: /abs/lib, features: "
                                                       "[text]}\n")
    (tmp_path / "data.yaml").write_text(f"output_dir: {tmp_path}/out\nsources: s3://data/lists/sources.yaml\n"
                                        f"tokenizer: {{path: '{BUCKET}/tokenizer'}}\n")
    cfg = load_data_config(tmp_path / "data.yaml")
    assert [(s.name, s.local_dir) for s in load_sources(cfg.sources)] == [("texts", "s3://data/texts"),
                                                                          ("lib", "/abs/lib")]
    from huginn_ray.data.bucket_sources import mirror_bucket_inputs
    assert mirror_bucket_inputs(cfg, []) == []  # the tokenizer is copied as the run copies it, before the plan
    assert cfg.tokenizer_dir == Path(cfg.output_dir) / "mirror" / ".tokenizer"
    assert tokenizer_facts(cfg)["tokenizer_sha256"] == file_sha256(tokenizer / "tokenizer.json")
    storage.write_text("s3://data/lists/relative.yaml", "- {name: texts, local_dir: texts, features: [text]}\n")
    with pytest.raises(ConfigError, match=r"^s3://data/lists/relative.yaml: source 'texts': local_dir: 'texts' is "
                                          r"relative, and the source list is in a bucket"):
        load_sources("s3://data/lists/relative.yaml")
    with pytest.raises(ConfigError, match=r"^source list not found: s3://data/lists/none.yaml$"):
        load_sources("s3://data/lists/none.yaml")
