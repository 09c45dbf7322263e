"""The data preparation jobs end to end on a real local Ray: tokenizer, staging, packing, global shuffle.

Sources are small generated local files (jsonl with two features, parquet chat data, text files, an empty
source), so everything runs in seconds; the Hub path has its own tests (test_data_hub_download.py).
"""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from huginn_ray.data.shards import read_manifest
from local_ray import module_ray

ROOT = Path(__file__).resolve().parents[1]
N_SHARDS, SEQ_LEN = 4, 32
WORDS = ("the raven flies over a recurrent depth of latent thought while ray shards data across many ranks "
         "λ-calculus 北欧 mythology 🦭 seal x = y + 1 def return").split()


def _load_job(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "jobs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare_data = _load_job("prepare_data")
train_tokenizer_job = _load_job("train_tokenizer")


@pytest.fixture(scope="module")
def ray_instance():
    with module_ray("hrdp_"):
        yield


PLANTED = ("<|end_text|>", " <|begin_header|>user")
"""Special tokens' strings planted in documents and chat messages: text, never control ids (test_no_row_lost...)."""


def _text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _write_sources(root: Path, extra: str = "") -> Path:
    rng = random.Random(0)
    (root / "prose").mkdir(parents=True)
    with open(root / "prose" / "part0.jsonl", "w") as f:
        for i in range(300):
            title = f"Title {i}" + (PLANTED[i % 2] + " and more" if i % 10 == 0 else "")
            f.write(json.dumps({"title": title, "body": _text(rng, 5, 120), "id": i}) + "\n")
    (root / "chat").mkdir()
    chats = [[{"role": "user", "content": (PLANTED[1] if i % 10 == 0 else "") + _text(rng, 3, 20)},
              {"role": "assistant", "content": (PLANTED[0] + "x" if i % 10 == 5 else "") + _text(rng, 3, 40)}]
             for i in range(120)]
    pq.write_table(pa.table({"messages": chats}), root / "chat" / "chats.parquet")
    (root / "notes").mkdir()
    for i in range(40):
        (root / "notes" / f"note{i:02d}.txt").write_text(PLANTED[0] * (i % 4 == 0) + _text(rng, 10, 200)
                                                         + "\r\n\tend\n")
    (root / "empty").mkdir()
    (root / "empty" / "nothing.jsonl").write_text("")
    sources = root / "sources.yaml"
    sources.write_text(f"""
- name: prose
  local_dir: prose
  features: [title, body]
  weight: 1.5
- name: chat
  local_dir: chat
  features: [messages]
  needs_chat_templating: true
- name: notes
  local_dir: notes
  features: [text]
  weight: 2.0
  every_token_is_sacred: true
- name: empty
  local_dir: empty
  features: [text]
{extra}""")
    return sources


def _config(root: Path, sources: Path) -> Path:
    config = root / "data.yaml"
    config.write_text(f"""
output_dir: {root / 'out'}
sources: {sources}
seq_len: {SEQ_LEN}
num_shards: {N_SHARDS}
val_fraction: 0.2
docs_per_pack_batch: 64
tokenizer: {{vocab_size: 4096, rows_per_source: 1000}}
shuffle: {{row_group_size: 8}}
""")
    return config


@pytest.fixture(scope="module")
def prepared(ray_instance, tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    config = _config(root, _write_sources(root))
    assert train_tokenizer_job.main(["--config", str(config)]) == 0
    assert prepare_data.main(["--config", str(config)]) == 0
    return root, config


def _rows(path: Path) -> list[tuple]:
    return [tuple(r) for r in pq.read_table(path).column("input_ids").to_pylist()]


def test_shards_have_exact_counts_lengths_and_types(prepared):
    root, _ = prepared
    shards = root / "out" / "shards"
    manifest = read_manifest(shards)
    assert manifest["num_shards"] == N_SHARDS and manifest["seq_len"] == SEQ_LEN
    assert manifest["token_dtype"] == "uint16"
    for split in ("train", "val"):
        files = sorted((shards / split).glob("*.parquet"))
        assert [f.name for f in files] == [f"{r:05d}.parquet" for r in range(N_SHARDS)]
        per_shard = manifest["rows_per_shard"][split]
        assert per_shard > 0 and manifest["tokens_per_shard"][split] == per_shard * (SEQ_LEN + 1)
        for f in files:
            pf = pq.ParquetFile(f)
            assert pf.schema_arrow == pa.schema([("input_ids", pa.list_(pa.uint16()))])  # vocab 4096: 16 bits
            assert pf.metadata.num_rows == per_shard
            assert pf.metadata.row_group(0).num_rows == min(8, per_shard)
            assert all(len(r) == SEQ_LEN + 1 for r in _rows(f))
    tok = json.loads((root / "out" / "tokenizer" / "tokenizer.json").read_bytes())
    assert manifest["tokenizer_sha256"] == hashlib.sha256(
        (root / "out" / "tokenizer" / "tokenizer.json").read_bytes()).hexdigest()
    assert manifest["vocab_size"] == 4096 and tok["post_processor"]["type"] == "TemplateProcessing"
    assert (manifest["bos_id"], manifest["eos_id"], manifest["pad_id"]) == (4064, 4065, 4069)


def test_packed_files_hold_the_rows_the_packing_rule_gives_each_batch(prepared):
    """Every packed file of the run holds exactly the rows that its batch gives when computed here, in this process
    and without Ray, from the staged documents: encoded (special-token strings as text; the templated chat source
    rendered), held out and up-weighted by the seeded hashes, packed copy by copy in permutation.py's order, train
    then validation. Ray Data's read, encoder actors and writer move, merge or drop no record."""
    from huginn_ray.data import layout
    from huginn_ray.data.chat import render_document
    from huginn_ray.data.packing import copy_fractions, copy_order, pack, unit_hash
    from huginn_ray.data.sources import load_sources
    from huginn_ray.data.tokenizer import load_text_tokenizer

    root, _ = prepared
    out, seed, val_fraction, per_batch, row_len = root / "out", 233, 0.2, 64, SEQ_LEN + 1
    assert json.loads((out / "packed" / "_COMPLETE.json").read_text())["seed"] == seed
    tokenizer = load_text_tokenizer(out / "tokenizer" / "tokenizer.json")
    checked = 0
    for index, source in enumerate(load_sources(root / "sources.yaml")):
        for f in layout.read_marker(out / "staging" / source.name)["files"]:
            staged = pq.read_table(out / "staging" / source.name / f["output"])
            for start in range(0, f["rows"], per_batch):
                first_doc = (int(Path(f["output"]).stem) << 32) + start
                texts = staged.column("text").to_pylist()[start:start + per_batch]
                docs = [render_document(json.loads(t), tokenizer) if source.needs_chat_templating else
                        tokenizer.encode(t).ids for t in texts]
                held_out = [unit_hash(seed, "val", t) < val_fraction for t in texts]
                rows, splits = [], []
                for copy, fraction in enumerate(copy_fractions(source.weight)):
                    member = [fraction >= 1.0 or unit_hash(seed, f"copy{copy}", t) < fraction for t in texts]
                    order = copy_order(seed, copy, first_doc, len(texts))
                    for split in (0, 1):
                        chosen = [docs[i] for i in order if member[i] and held_out[i] == bool(split)]
                        packed = pack(chosen, [source.every_token_is_sacred] * len(chosen), row_len).tolist()
                        rows += packed
                        splits += [split] * len(packed)
                table = pq.read_table(out / "packed" / f"{index:04d}-{first_doc:016x}.parquet")
                assert table.column("input_ids").to_pylist() == rows, (source.name, start)
                assert table.column("split").to_pylist() == splits, (source.name, start)
                checked += len(rows)
    marker = json.loads((out / "packed" / "_COMPLETE.json").read_text())
    assert checked == marker["train_rows"] + marker["val_rows"] > 0


def test_no_row_lost_or_duplicated_and_validation_held_out(prepared):
    root, _ = prepared
    out = root / "out"
    manifest = read_manifest(out / "shards")
    packed = {"train": collections.Counter(), "val": collections.Counter()}
    for f in (out / "packed").glob("*.parquet"):
        table = pq.read_table(f)
        for ids, split in zip(table.column("input_ids").to_pylist(), table.column("split").to_pylist()):
            packed["val" if split else "train"][tuple(ids)] += 1
    shard_rows = {split: collections.Counter() for split in packed}
    for split in packed:
        for f in (out / "shards" / split).glob("*.parquet"):
            shard_rows[split].update(_rows(f))
        # every shard row comes from the packed rows, at most as often, and only the surplus is missing
        assert not shard_rows[split] - packed[split]
        missing = sum((packed[split] - shard_rows[split]).values())
        assert missing == manifest["dropped_surplus_rows"][split] < N_SHARDS
    assert not set(shard_rows["train"]) & set(shard_rows["val"])
    assert not set(packed["train"]) & set(packed["val"])
    # rows start at a document boundary (BOS) except sacred remainders
    starts = [r[0] for r in shard_rows["train"].elements()]
    assert starts.count(4064) > len(starts) // 3
    # text is text: the special-token strings planted early in documents and chat messages are not control ids.
    # In every packed row an EOS is the row's last id or followed by the next document's BOS (and a BOS is the
    # first or follows an EOS), and the control ids follow the grammar of documents (BOS EOS) and chat documents
    # (BOS, then begin_header end_header end_turn per message, EOS): a planted `<|end_text|>` would be an EOS
    # followed by text, a planted `<|begin_header|>` a header inside a message.
    letters = {4064: "B", 4065: "E", 4066: "h", 4067: "e", 4068: "t"}
    allowed = {"BE", "Bh", "he", "et", "th", "tE", "EB"}
    pairs = collections.Counter()
    for split in packed:
        for row in packed[split]:
            assert not set(row) & {4069, *range(4070, 4096)}, row
            ends = [k for k, i in enumerate(row) if i == 4065 and k + 1 < len(row)]
            starts = [k for k, i in enumerate(row) if i == 4064 and k > 0]
            assert [row[k + 1] for k in ends] == [4064] * len(ends) and [k - 1 for k in starts] == ends, row
            controls = "".join(letters.get(i, "") for i in row)
            pairs.update(controls[k:k + 2] for k in range(len(controls) - 1))
    assert set(pairs) == allowed, pairs  # every transition occurs (chat documents and plain ones), no other


def test_staging_records_the_largest_document_and_pack_refuses_one_over_the_bound_by_name(prepared):
    """Each staged file's largest document (characters) is in the staging marker; a document longer than
    max_document_chars is refused before packing, naming source, staged and input file, row and doc_id."""
    from huginn_ray.data import layout
    from huginn_ray.data.formatting import DataError
    from huginn_ray.data.sources import load_sources
    from huginn_ray.data.tokenize_pack import check_document_sizes

    root, _ = prepared
    staging = root / "out" / "staging"
    markers = {name: layout.read_marker(staging / name) for name in ("prose", "chat", "notes", "empty")}
    lengths = {}
    for name, marker in markers.items():
        for f in marker["files"]:
            texts = pq.read_table(staging / name / f["output"]).column("text").to_pylist()
            lengths[(name, f["output"])] = [len(t) for t in texts]
            assert f["max_chars"] == max(lengths[(name, f["output"])], default=0)
    notes = [(n, max(v)) for (name, n), v in lengths.items() if name == "notes"]
    file, longest = max(notes, key=lambda item: item[1])
    row = lengths[("notes", file)].index(longest)
    sources = load_sources(str(root / "sources.yaml"))
    assert max(max(v, default=0) for (name, _), v in lengths.items() if name != "notes") < longest
    check_document_sizes(sources, markers, staging, longest)  # at the bound: taken
    with pytest.raises(DataError) as refused:
        check_document_sizes(sources, markers, staging, longest - 1)
    assert str(refused.value).startswith(
        f"source 'notes': document {row + 1} of {staging / 'notes' / file} (from "
        f"{markers['notes']['files'][int(file[:5])]['input']}, doc_id={(int(file[:5]) << 32) + row}) has "
        f"{longest:,} characters, more than max_document_chars={longest - 1:,}: its pack task would need about ")


def test_weights_sacred_and_empty_source_in_manifest(prepared):
    root, _ = prepared
    manifest = read_manifest(root / "out" / "shards")
    assert manifest["empty_sources"] == ["empty"]
    assert manifest["staged_documents"] == {"prose": 300, "chat": 120, "notes": 40, "empty": 0}
    sources = manifest["sources"]
    assert sources["notes"]["copied_docs"] == 2 * 40
    assert sources["chat"]["copied_docs"] == 120
    assert 300 + 100 <= sources["prose"]["copied_docs"] <= 300 + 200  # 1 copy + ~half
    # sacred notes keep every token: rows * row_len covers all tokens of both copies but < one row per copy
    notes = sources["notes"]
    rows = notes["train_rows"] + notes["val_rows"]
    assert 2 * notes["doc_tokens"] - rows * (SEQ_LEN + 1) < 2 * 2 * 64 * (SEQ_LEN + 1)


def test_another_seed_gives_another_order(prepared, tmp_path):
    """(The same seed gives the same bytes: a fresh 1-CPU Ray's run and the bucket run below.)"""
    root, config = prepared
    tokenizer = root / "out" / "tokenizer"

    def shard_bytes(out: Path) -> dict:
        return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.glob("shards/*/*.parquet"))}

    first = shard_bytes(root / "out")
    assert prepare_data.main(["--config", str(config), f"output_dir={tmp_path / 'seed2'}",
                              f"tokenizer.path={tokenizer}", "seed=234"]) == 0
    other = shard_bytes(tmp_path / "seed2")
    assert other.keys() == first.keys() and other["shards/train/00000.parquet"] != first["shards/train/00000.parquet"]


def test_a_bucket_output_dir_publishes_the_local_run_s_shard_bytes(prepared, tmp_path, capsys):
    """output_dir in a bucket (a real S3 server): the stages run in scratch_dir (seeded with the local run's
    staged and packed files, so the shuffle runs there), the shards and the tokenizer are uploaded, the pointer
    object names the version; every shard's sha256 is the local run's."""
    from huginn_ray import storage
    from s3_server import S3Server

    root, config = prepared
    shutil.copytree(root / "out", tmp_path / "scratch", ignore=shutil.ignore_patterns("shards*", "LOCK"))
    with S3Server() as s3:
        s3.create_bucket("data")
        assert prepare_data.main(["--config", str(config), "output_dir=s3://data/demo",
                                  f"scratch_dir={tmp_path / 'scratch'}"]) == 0
        assert storage.read_text("s3://data/demo/shards") == "shards.v0001\n"
        local = {p.relative_to(root / "out" / "shards").as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                 for p in sorted((root / "out" / "shards").glob("*/*.parquet"))}
        published = {name[len("s3://data/demo/shards.v0001/"):]: hashlib.sha256(storage.read_bytes(name)).hexdigest()
                     for name in storage.list_prefix("s3://data/demo/shards.v0001") if name.endswith(".parquet")}
        assert published == local and len(local) == 2 * N_SHARDS
        assert (storage.read_bytes("s3://data/demo/tokenizer/tokenizer.json")
                == (root / "out" / "tokenizer" / "tokenizer.json").read_bytes())
        out = capsys.readouterr().out
        assert "[pack] complete" in out and "[publish] uploaded 9 files" in out
        assert "shards in s3://data/demo/shards (" in out


def test_same_bytes_from_a_separate_ray_with_one_cpu(prepared, chat_prepared, tmp_path):
    """Determinism does not hang on scheduling: a fresh 1-CPU Ray in another process writes the same shards, for
    the document sources and for the packed chat sources (loss masks included)."""
    root, config = prepared
    chat_root, _, chat_args, _ = chat_prepared
    runs = [["--config", str(config), f"output_dir={tmp_path / 'one_cpu'}", f"tokenizer.path={root / 'out' / 'tokenizer'}"],
            [*chat_args, f"output_dir={tmp_path / 'chat_one_cpu'}", "chat.pack=true"]]
    temp_dir = tempfile.mkdtemp(prefix="hrd1_", dir="/tmp")
    # one 1-CPU Ray for both runs (the job connects to a Ray already started in its process)
    script = (f"import importlib.util, json, sys, ray; ray.init(address='local', num_cpus=1, _temp_dir={temp_dir!r}, "
              "include_dashboard=False, log_to_driver=False); "
              f"spec = importlib.util.spec_from_file_location('prepare_data', {str(ROOT / 'jobs' / 'prepare_data.py')!r}); "
              "job = importlib.util.module_from_spec(spec); spec.loader.exec_module(job); "
              "sys.exit(max(job.main(args) for args in json.loads(sys.argv[1])))")
    try:
        result = subprocess.run(
            [sys.executable, "-c", script, json.dumps(runs)],
            env={**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-3000:]
    for path in sorted((root / "out" / "shards").glob("*/*.parquet")):
        assert (tmp_path / "one_cpu" / "shards" / path.parent.name / path.name).read_bytes() == path.read_bytes()
    chat_files = sorted((chat_root / "pack").glob("packed/*.parquet")) + sorted((chat_root / "pack").glob("shards/*/*.parquet"))
    assert len(chat_files) == 3 + 4  # 2 + 1 batches of convs and qa; 2 + 2 shards
    for path in chat_files:
        assert (tmp_path / "chat_one_cpu" / path.relative_to(chat_root / "pack")).read_bytes() == path.read_bytes()


def _task_killed_once(fn, flag: Path, committed_first: str):
    """A unit's task function (its first argument names the unit), except that the first attempt of the first
    call SIGKILLs its own worker process in the middle of the task: after its first output is fully written under
    its temp name, before that output is committed, and once another task has committed a file matching the glob
    `committed_first` (so that the stopped dataset has a finished task whose result it never returned). Every
    attempt appends (unit, memory= Ray gave it, killed or ran) to `<flag>.memory`."""

    def first_attempt_dies(*args, **kwargs):
        import glob

        import ray

        call = args[0]
        memory = ray.get_runtime_context().get_assigned_resources().get("memory")
        try:
            os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
        except FileExistsError:  # a later call, or the retry of the killed attempt: the real task
            with open(flag.with_suffix(".memory"), "a") as f:
                f.write(json.dumps([call, memory, "ran"]) + "\n")
            return fn(*args, **kwargs)
        from huginn_ray.data import layout

        with open(flag.with_suffix(".memory"), "a") as f:
            f.write(json.dumps([call, memory, "killed"]) + "\n")

        def die(tmp, final):  # this worker only
            deadline = time.monotonic() + 60
            while not glob.glob(committed_first) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)

        layout.commit_file = die
        return fn(*args, **kwargs)

    return first_attempt_dies


def _map_task_killed_once(map_unit, flag: Path, work: Path, last: int):
    """The shuffle map pass's task (shuffle.map_unit), except that the first attempt of map group `last` SIGKILLs
    its own worker process in the middle of the task, once the other groups' map files are committed under `work`
    (so that the stopped dataset had completed tasks) and its own map file is fully written under its temp name,
    before it is committed. Every attempt appends (its map group, memory= Ray gave it, killed or ran) to
    `<flag>.memory`."""

    def first_attempt_dies(unit, **kwargs):
        import ray

        call = unit[0]
        memory = ray.get_runtime_context().get_assigned_resources().get("memory")
        try:
            if call != last:
                raise FileExistsError
            os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
        except FileExistsError:  # another group, or the rerun of the killed one: the real work
            with open(flag.with_suffix(".memory"), "a") as f:
                f.write(json.dumps([call, memory, "ran"]) + "\n")
            return map_unit(unit, **kwargs)
        import time

        from huginn_ray.data import layout

        others = [work / "map" / split / f"{unit:06d}.idx.npy" for split in ("train", "val") for unit in range(last)]
        for _ in range(600):  # the other groups run on the other CPU; at most 60 s
            if all(p.exists() for p in others):
                break
            time.sleep(0.1)

        with open(flag.with_suffix(".memory"), "a") as f:
            f.write(json.dumps([call, memory, "killed"]) + "\n")
        layout.commit_file = lambda tmp, final: os.kill(os.getpid(), signal.SIGKILL)  # this worker only
        return map_unit(unit, **kwargs)

    return first_attempt_dies


def _encoder_killed_once(encoder: type, flag: Path) -> type:
    """The pack stage's encoder, except that the first call of the first actor SIGKILLs its own process in the
    middle of a unit of pack batches (encoded, nothing written yet). Every call appends (its batches, memory= Ray
    gave the actor, killed or ran) to `<flag>.memory`."""

    class KilledOnce(encoder):
        def __call__(self, table):
            import ray

            from huginn_ray.data.tokenize_pack import whole_batches

            call = [batch["name"] for batch, _ in whole_batches(table)]
            memory = ray.get_runtime_context().get_assigned_resources().get("memory")
            encoded = super().__call__(table)
            try:
                os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
            except FileExistsError:  # a later call, or the rerun of the killed one
                with open(flag.with_suffix(".memory"), "a") as f:
                    f.write(json.dumps([call, memory, "ran"]) + "\n")
                return encoded
            with open(flag.with_suffix(".memory"), "a") as f:
                f.write(json.dumps([call, memory, "killed"]) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)

    return KilledOnce


def test_a_worker_killed_in_pack_and_in_the_shuffle_map_pass_changes_no_byte(prepared, tmp_path, monkeypatch):
    """One worker process dies (SIGKILL): a staging task as it commits its staged file, a pack encoder actor in
    the middle of a call, and a shuffle map task in the middle of its task; the file, the call's batches and the
    task run again, each with twice the memory it had (never the same: execution.rerun_killed; a staging task
    declares none and is taken to have had UNDECLARED_MEMORY), and the run writes the same staged files, packed
    files and shards, byte for byte, as the undisturbed run, with no temp file left behind. The shuffle runs in
    4 map groups, the last killed after the other three committed theirs: its figures (shard_build.last_run_stats)
    count every map file and shard, those of the stopped dataset's tasks too."""
    from huginn_ray.data import shard_build as build_mod
    from huginn_ray.data import shuffle as shuffle_mod
    from huginn_ray.data import staging as staging_mod
    from huginn_ray.data import tokenize_pack as pack_mod
    from huginn_ray.data.execution import UNDECLARED_MEMORY

    root, config = prepared
    out = tmp_path / "killed"
    # the staging task killed dies once another one has committed its file: a finished task of the stopped dataset,
    # whose source the driver commits (moving its work directory) as soon as the rerun has staged the rest; the
    # driver polls often and the rerun waits before it returns, so that reading that file from its old place after
    # the rerun would fail every time
    monkeypatch.setattr(staging_mod, "stage_file", _task_killed_once(staging_mod.stage_file, tmp_path / "staging",
                                                                     str(out / "staging" / "*.partial" / "*.parquet")))
    monkeypatch.setattr(staging_mod, "POLL_S", 0.01)
    rerun_killed = staging_mod.rerun_killed

    def rerun_then_wait(*args, **kwargs):
        rerun_killed(*args, **kwargs)
        time.sleep(0.5)

    monkeypatch.setattr(staging_mod, "rerun_killed", rerun_then_wait)
    monkeypatch.setattr(pack_mod, "TokenizeDocuments", _encoder_killed_once(pack_mod.TokenizeDocuments,
                                                                            tmp_path / "pack"))
    monkeypatch.setattr(build_mod, "group_files", lambda files, row_bytes, group_bytes: [
        files[i * len(files) // 4:(i + 1) * len(files) // 4] for i in range(4)])
    monkeypatch.setattr(shuffle_mod, "map_unit", _map_task_killed_once(shuffle_mod.map_unit, tmp_path / "map",
                                                                       out / "shards.partial", last=3))
    map_files: dict[str, list[tuple[int, int]]] = {}  # per split, each map file's (bytes, rows) when published
    publish = build_mod.publish

    def publish_counting_map_files(work, shard_root, manifest):
        for path in sorted(work.glob("map/*/*.arrow")):
            rows = pa.ipc.open_file(pa.memory_map(str(path))).read_all().num_rows
            map_files.setdefault(path.parent.name, []).append((path.stat().st_size, rows))
        publish(work, shard_root, manifest)

    monkeypatch.setattr(build_mod, "publish", publish_counting_map_files)
    assert prepare_data.main(["--quiet", "--config", str(config), f"output_dir={out}",
                              f"tokenizer.path={root / 'out' / 'tokenizer'}"]) == 0
    assert all((tmp_path / stage).exists() for stage in ("staging", "pack", "map"))  # every kill happened
    for stage in ("staging", "pack", "map"):
        attempts = [json.loads(line) for line in (tmp_path / f"{stage}.memory").read_text().splitlines()]
        [(killed_call, killed_memory)] = [(call, memory) for call, memory, what in attempts if what == "killed"]
        reruns = [memory for call, memory, what in attempts if call == killed_call and what == "ran"]
        if stage == "staging":
            assert killed_memory is None and reruns == [2 * UNDECLARED_MEMORY], (stage, attempts)
        else:
            assert killed_memory > 0 and reruns == [2 * killed_memory], (stage, attempts)

    def outputs(base: Path) -> dict:
        return {p.relative_to(base).as_posix(): p.read_bytes()
                for p in sorted(base.glob("staging/*/*.parquet")) + sorted(base.glob("packed/*.parquet"))
                + sorted(base.glob("shards/*/*.parquet"))}

    expected = outputs(root / "out")
    assert len(expected) > 2 * N_SHARDS and outputs(out) == expected
    assert not [p for p in out.rglob("*.tmp")]
    manifest = read_manifest(out / "shards")
    stats = {k: v for k, v in build_mod.last_run_stats.items() if not k.endswith(("_s", "_mib"))}
    assert stats == {  # one reducer per split (4 shards of 74-byte rows: 33 uint16 ids + 8), reading every kept row
        "map_tasks": 4, "reducers": 2,
        "intermediate_bytes_written": sum(size for files in map_files.values() for size, _ in files),
        "intermediate_bytes_read": sum(manifest["total_rows"].values()) * (2 * (SEQ_LEN + 1) + 8),
        "shard_bytes_written": sum(p.stat().st_size for p in (out / "shards").glob("*/*.parquet")),
        "map_files_opened": sum(1 for files in map_files.values() for _, rows in files if rows)}
    assert sorted(map_files) == ["train", "val"] and [len(files) for files in map_files.values()] == [4, 4]


def test_progress_shows_on_the_console_unless_quiet(prepared, tmp_path):
    """Ray Data reports the progress of each stage's operator (on a console that is not a terminal, as here and
    under `ray job submit`, as log lines on stderr); --quiet reports none."""
    import logging

    _, config = prepared
    records: list[str] = []
    collect = logging.Handler()
    collect.emit = lambda record: records.append(record.getMessage())
    progress = logging.getLogger("ray.data._internal.progress")
    progress.addHandler(collect)
    try:
        assert prepare_data.main(["--stage", "staging", "--config", str(config), f"output_dir={tmp_path / 'a'}"]) == 0
        shown, records[:] = list(records), []
        assert prepare_data.main(["--quiet", "--stage", "staging", "--config", str(config),
                                  f"output_dir={tmp_path / 'b'}"]) == 0
    finally:
        progress.removeHandler(collect)
    # staging runs one task per input file
    assert any("Running Dataset" in line for line in shown) and any("Readstaging" in line for line in shown)
    assert records == []


def test_rerun_skips_complete_stages(prepared, capsys):
    root, config = prepared
    before = {p: p.stat().st_mtime_ns for p in (root / "out" / "shards").rglob("*.parquet")}
    capsys.readouterr()
    assert prepare_data.main(["--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "[staging] prose: complete" in out and "[pack] complete" in out and "[shuffle] complete" in out
    assert {p: p.stat().st_mtime_ns for p in (root / "out" / "shards").rglob("*.parquet")} == before


def test_one_stage_alone_needs_its_inputs(ray_instance, tmp_path, capsys):
    config = _config(tmp_path, _write_sources(tmp_path))
    assert prepare_data.main(["--config", str(config), "--stage", "shuffle"]) == 1
    assert "no packed data" in capsys.readouterr().err


def test_too_few_rows_for_the_shard_count_is_refused(prepared, tmp_path, capsys):
    root, config = prepared
    assert prepare_data.main(["--config", str(config), f"output_dir={tmp_path / 'many'}",
                              f"tokenizer.path={root / 'out' / 'tokenizer'}", "num_shards=100000"]) == 1
    assert "fewer than num_shards=100000" in capsys.readouterr().err


def test_an_unreadable_input_file_is_named(ray_instance, tmp_path, capsys):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "good.txt").write_text("fine text")
    (tmp_path / "bad" / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    sources = tmp_path / "sources.yaml"
    sources.write_text("- {name: bad, local_dir: bad, features: [text], files: ['*.txt', '*.parquet']}")
    config = _config(tmp_path, sources)
    assert prepare_data.main(["--config", str(config), "--stage", "staging"]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "bad" / "broken.parquet") in err.strip().splitlines()[-1]  # the error, last
    assert not (tmp_path / "out" / "staging" / "bad").exists()  # nothing half-written in place


def test_bad_records_fail_the_run_by_name_or_are_quarantined_and_counted_under_max_bad_records(
        ray_instance, tmp_path, capsys):
    """A source with a text file of invalid UTF-8, a JSONL line of the wrong type and a parquet row of invalid
    UTF-8: with max_bad_records 0 the run stops naming the first bad record's file, line and reason (its last
    console line); with 10 both jobs complete, the records are in quarantine/ with their reasons, and the
    console and the manifest count them (read, kept, quarantined per reason, dropped per filter)."""
    rng = random.Random(1)
    bad = tmp_path / "bad"
    bad.mkdir()
    for i in range(30):
        (bad / f"good{i:02d}.txt").write_text(_text(rng, 50, 100))
    (bad / "empty.txt").write_text("")
    (bad / "latin1.txt").write_bytes("fine\ncaf\xe9".encode("latin-1"))
    (bad / "lines.jsonl").write_text('\n{"text": "fine"}\n{"text": 5}\n{"text": "also fine"}\n')  # a blank line first
    texts = pa.array([b"row one", b"\xff row two", b"row three"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": texts}), bad / "rows.parquet")
    sources = tmp_path / "sources.yaml"
    config = _config(tmp_path, sources)

    sources.write_text("- {name: bad, local_dir: bad, features: [text], files: ['*.txt', '*.jsonl', '*.parquet']}")
    assert train_tokenizer_job.main(["--config", str(config)]) == 1
    last = [line for line in capsys.readouterr().err.splitlines() if "error:" in line][-1]
    assert last.startswith("train_tokenizer: error: source 'bad': ") and "max_bad_records: 0" in last
    first = {"latin1.txt": "line 2: invalid_utf8: not UTF-8 at byte offset 8: b'\\xe9'",
             "lines.jsonl": "line 3: wrong_type: field 'text' holds int, not text",
             "rows.parquet": "row 2: invalid_utf8: not UTF-8 at byte offset 0: b'\\xff ro'"}
    assert sum(f"{bad / name}, {what} (a bad record" in last for name, what in first.items()) == 1, last

    sources.write_text("- {name: bad, local_dir: bad, features: [text], files: ['*.txt', '*.jsonl', '*.parquet'], "
                       "max_bad_records: 10}")
    assert train_tokenizer_job.main(["--config", str(config)]) == 0
    assert prepare_data.main(["--config", str(config), "num_shards=2"]) == 0
    out = capsys.readouterr().out
    assert (f"[staging] bad: 34 files -> 34 documents; records: 38 read, 34 kept, 3 quarantined (invalid_utf8 2, "
            f"wrong_type 1) in {tmp_path / 'out' / 'quarantine' / 'bad'}, dropped: empty 1") in out
    records = read_manifest(tmp_path / "out" / "shards")["records"]
    assert records == {"bad": {"read": 38, "kept": 34, "quarantined": {"invalid_utf8": 2, "wrong_type": 1},
                               "dropped": {"empty": 1}}}
    quarantined = [json.loads(line) for f in sorted((tmp_path / "out" / "quarantine" / "bad").glob("*.jsonl"))
                   for line in f.read_text().splitlines()]
    assert quarantined == [
        {"file": str(bad / "latin1.txt"), "line": 2, "reason": "invalid_utf8",
         "detail": "not UTF-8 at byte offset 8: b'\\xe9'", "record": "fine\ncaf\\xe9"},
        {"file": str(bad / "lines.jsonl"), "line": 3, "reason": "wrong_type",
         "detail": "field 'text' holds int, not text", "record": '{"text": 5}'},
        {"file": str(bad / "rows.parquet"), "row": 2, "reason": "invalid_utf8",
         "detail": "not UTF-8 at byte offset 0: b'\\xff ro'", "record": '{"text": "\\\\xff row two"}'}]

    # a limit below what staging found refuses the staged source too, by name
    sources.write_text("- {name: bad, local_dir: bad, features: [text], files: ['*.txt', '*.jsonl', '*.parquet'], "
                       "max_bad_records: 0.05}")
    assert prepare_data.main(["--config", str(config), "--stage", "staging"]) == 1
    assert [line for line in capsys.readouterr().err.splitlines() if "error:" in line][-1] == (
        f"prepare_data: error: source 'bad': 3 bad records of 38 read, more than max_bad_records: 0.05 allows; "
        f"the first: {bad / 'latin1.txt'}, line 2: invalid_utf8: not UTF-8 at byte offset 8: b'\\xe9'")


def test_unknown_source_field_fails_the_job(ray_instance, tmp_path, capsys):
    sources = _write_sources(tmp_path, extra="  colour: blue\n")
    assert prepare_data.main(["--config", str(_config(tmp_path, sources))]) == 1
    err = capsys.readouterr().err
    assert "source 'empty'" in err and "colour" in err


def test_bad_override_is_a_config_error(tmp_path, capsys):
    config = _config(tmp_path, tmp_path / "sources.yaml")
    assert prepare_data.main(["--config", str(config), "num_shards=many"]) == 2
    assert "num_shards" in capsys.readouterr().err


def _synthetic_packed(packed: Path, n_files: int = 10, seq_len: int = 1023) -> list[dict]:
    from huginn_ray.data.tokenize_pack import packed_schema
    from huginn_ray.data.tokens import rows_to_arrow

    packed.mkdir()
    files = []
    for i in range(n_files):
        rows = (np.arange(40 * (seq_len + 1)).reshape(40, seq_len + 1) + i * 1000) % 60000
        rows[:, 0] = i * 40 + np.arange(40)  # identity of the row
        split = (np.arange(40) % 5 == 0).astype(np.uint8)
        pq.write_table(pa.table({"input_ids": rows_to_arrow(rows, "uint16"), "split": pa.array(split)},
                                schema=packed_schema("uint16")), packed / f"{i:04d}.parquet")
        files.append({"path": str(packed / f"{i:04d}.parquet"), "train_rows": 32, "val_rows": 8})
    return files


def _shuffle(files, out, **kw):
    from huginn_ray.data.shard_build import run_shuffle

    args = dict(num_shards=3, seed=5, row_group_size=4, reducer_mib=64, map_mib=64, token_dtype="uint16",
                vocab_size=65536, fingerprint="test", manifest_extra={})
    args.update(kw)
    return run_shuffle(files, int(pq.ParquetFile(files[0]["path"]).read_row_group(0).column(0)[0].values.__len__()),
                       out, **args)


def test_shuffle_output_does_not_depend_on_map_and_reduce_grouping(ray_instance, tmp_path):
    """Many map groups and reducers (1 MiB each) give the same shards as one of each (64 MiB). Each pass is one
    read task per map group or reducer that writes its own files (the rows never cross the object store)."""
    import logging

    files = _synthetic_packed(tmp_path / "packed")
    outputs = {}
    plans: list[str] = []
    collect = logging.Handler()
    collect.emit = lambda record: plans.append(record.getMessage())
    executor = logging.getLogger("ray.data._internal.execution.streaming_executor")
    for mib in (1, 64):
        out = tmp_path / f"shards_{mib}"
        executor.addHandler(collect)
        try:
            manifest = _shuffle(files, out, reducer_mib=mib, map_mib=mib)
        finally:
            executor.removeHandler(collect)
        assert manifest["rows_per_shard"] == {"train": 106, "val": 26}
        assert manifest["dropped_surplus_rows"] == {"train": 2, "val": 2}
        assert manifest["token_dtype"] == "uint16"
        outputs[mib] = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.glob("*/*.parquet")}
        assert not (tmp_path / f"shards_{mib}.partial").exists()
    assert outputs[1] == outputs[64] and len(outputs[1]) == 6
    operators = [line.split(": ", 1)[1] for line in plans if line.startswith("Execution plan of Dataset")]
    assert operators == 2 * ["InputDataBuffer[Input] -> TaskPoolMapOperator[ReadShuffleMap]",
                             "InputDataBuffer[Input] -> TaskPoolMapOperator[ReadShuffleReduce]"]
    firsts = [r[0] for p in (tmp_path / "shards_1" / "train").glob("*.parquet") for r in _rows(p)]
    assert len(set(firsts)) == len(firsts) == 3 * 106  # no row twice
    assert pq.ParquetFile(tmp_path / "shards_1" / "train" / "00000.parquet").schema_arrow == \
        pa.schema([("input_ids", pa.list_(pa.uint16()))])


def test_shuffle_resumes_after_a_crash_and_redoes_only_missing_files(ray_instance, tmp_path, capsys):
    files = _synthetic_packed(tmp_path / "packed", seq_len=4095)  # 8 KiB rows: several map files and reducers
    reference = tmp_path / "reference"
    _shuffle(files, reference, reducer_mib=1, map_mib=1)
    expected = {p.relative_to(reference).as_posix(): p.read_bytes() for p in reference.glob("*/*.parquet")}
    # a crash after some map files and shards were committed: build the partial state, then delete some of it
    out = tmp_path / "shards"
    # a crash in the middle: the first validation reducer fails after all map files and the train shards exist
    from huginn_ray.data import shuffle as shuffle_mod

    original = shuffle_mod.reduce_unit

    def flaky(unit, **kwargs):
        if unit[1]["split"] == "val" and unit[1]["shards"][0] == 0:
            raise RuntimeError("simulated crash")
        return original(unit, **kwargs)

    shuffle_mod.reduce_unit = flaky
    try:
        with pytest.raises(Exception, match="simulated crash"):
            _shuffle(files, out, reducer_mib=1, map_mib=1)
    finally:
        shuffle_mod.reduce_unit = original
    partial = tmp_path / "shards.partial"
    done_before = {p: p.stat().st_mtime_ns for p in partial.glob("out/*/*.parquet")}
    maps_before = {p: p.stat().st_mtime_ns for p in partial.glob("map/*/*.arrow")}
    assert done_before and maps_before
    (partial / "out" / "train" / "junk.parquet.tmp").write_bytes(b"half")  # a half-written file is never used
    capsys.readouterr()
    _shuffle(files, out, reducer_mib=1, map_mib=1)
    printed = capsys.readouterr().out
    assert "resuming" in printed and f"{len(maps_before)}/" in printed
    got = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.glob("*/*.parquet")}
    assert got == expected
    for p, mtime in done_before.items():  # finished shards were not rewritten
        assert (out / p.relative_to(partial / "out")).stat().st_mtime_ns == mtime
    assert not partial.exists()


def test_out_of_range_id_is_refused_before_anything_is_written(ray_instance, tmp_path):
    files = _synthetic_packed(tmp_path / "packed")
    from huginn_ray.data.tokens import TokenRangeError

    # the map task's own error, raised on the driver as that very exception (not Ray's wrapper of it)
    with pytest.raises(TokenRangeError, match=r"^\S*/0000\.parquet: token id 4\d{4} does not fit the vocabulary of "
                                              r"40000 ids stored as uint16"):
        _shuffle(files, tmp_path / "shards", vocab_size=40000)
    assert not (tmp_path / "shards").exists()
    assert not list((tmp_path / "shards.partial").glob("out/*/*.parquet"))


def test_no_validation_document_appears_in_a_train_row(prepared):
    """Leak check per document: no 16-token window of any held-out document occurs in any training row."""
    from tokenizers import Tokenizer

    from huginn_ray.data.packing import unit_hash

    root, _ = prepared
    out = root / "out"
    window = 16
    train_windows = set()
    for f in (out / "shards" / "train").glob("*.parquet"):
        for row in _rows(f):
            train_windows.update(row[i:i + window] for i in range(len(row) - window + 1))
    tokenizer = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    val_docs = checked = 0
    for f in sorted((out / "staging").glob("*/*.parquet")):
        for text in pq.read_table(f, columns=["text"]).column("text").to_pylist():
            if unit_hash(233, "val", text) >= 0.2:
                continue
            val_docs += 1
            ids = tuple(tokenizer.encode(text).ids)
            for i in range(len(ids) - window + 1):
                assert ids[i:i + window] not in train_windows, f"validation document {text[:60]!r} leaked"
                checked += 1
    assert val_docs > 50 and checked > 1000


def test_packing_does_not_depend_on_the_cluster_size_with_many_files(prepared, tmp_path):
    """>= 500 small staged files: packed files and shards are byte-identical with 2 Ray CPUs and with 1."""
    root, _ = prepared
    rng = random.Random(1)
    (tmp_path / "many").mkdir()
    for i in range(520):
        (tmp_path / "many" / f"doc{i:04d}.txt").write_text(_text(rng, 5, 60))
    sources = tmp_path / "sources.yaml"
    sources.write_text("- {name: many, local_dir: many, features: [text], weight: 1.5}\n")
    config = _config(tmp_path, sources)
    common = [f"tokenizer.path={root / 'out' / 'tokenizer'}", "docs_per_pack_batch=7", "num_shards=3"]
    assert prepare_data.main(["--config", str(config), f"output_dir={tmp_path / 'two'}", *common]) == 0
    temp_dir = tempfile.mkdtemp(prefix="hrd1_", dir="/tmp")
    try:
        result = subprocess.run(
            [sys.executable, str(ROOT / "jobs" / "prepare_data.py"), "--config", str(config),
             f"output_dir={tmp_path / 'one'}", *common, "local_ray.num_cpus=1", f"local_ray.temp_dir={temp_dir}"],
            env={**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}, capture_output=True,
            text=True, timeout=600)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-3000:]

    def outputs(out: Path) -> dict:
        return {p.relative_to(out).as_posix(): p.read_bytes()
                for p in sorted(out.glob("packed/*.parquet")) + sorted(out.glob("shards/*/*.parquet"))}

    two, one = outputs(tmp_path / "two"), outputs(tmp_path / "one")
    assert len([k for k in two if k.startswith("packed/")]) > 60 and two == one


def test_staging_and_pack_resume_keeping_committed_files_and_clean_stale_tmp_dirs(prepared, tmp_path, capsys):
    root, config = prepared
    out = tmp_path / "resume"
    args = ["--config", str(config), f"output_dir={out}", f"tokenizer.path={root / 'out' / 'tokenizer'}"]
    assert prepare_data.main(args) == 0
    reference = {p.name: p.read_bytes() for p in (out / "packed").glob("*.parquet")}
    # a crashed pack run: its work dir holds some committed files and a half-written one; a dead run's tmp dir
    marker = json.loads((out / "packed" / "_COMPLETE.json").read_text())
    (out / "shards").unlink()  # the pointer: the rerun points it at the newest version again (finish_publish)
    (out / "packed").rename(out / "packed.partial")
    (out / "packed.partial" / "_COMPLETE.json").unlink()
    (out / "packed.partial" / "_PLAN.json").write_text(json.dumps({"fingerprint": marker["fingerprint"]}))
    kept = sorted((out / "packed.partial").glob("*.parquet"))[::2]
    for p in sorted((out / "packed.partial").glob("*.parquet"))[1::2]:
        p.unlink()
    (out / "packed.partial" / "0000-half.parquet.tmp").write_bytes(b"half")
    mtimes = {p.name: p.stat().st_mtime_ns for p in kept}
    (out / "staging" / "prose.tmp-999999").mkdir()
    # staging of one source interrupted: every other staged file committed, the rest not yet
    staged = {p.name: p.read_bytes() for p in (out / "staging" / "notes").glob("*.parquet")}
    staged_marker = json.loads((out / "staging" / "notes" / "_COMPLETE.json").read_text())
    partial = out / "staging" / "notes.partial"
    (out / "staging" / "notes").rename(partial)
    (partial / "_COMPLETE.json").unlink()
    (partial / "_PLAN.json").write_text(json.dumps({"fingerprint": staged_marker["fingerprint"]}))
    for p in sorted(partial.glob("*.parquet"))[1::2]:
        p.unlink()
    staged_mtimes = {p.name: p.stat().st_mtime_ns for p in partial.glob("*.parquet")}
    # staging stopped after every file of another source was committed, before its marker (the driver killed
    # between): the rerun reads its files' footers and writes the marker, staging none of them again
    complete_marker = json.loads((out / "staging" / "prose" / "_COMPLETE.json").read_text())
    unmarked = out / "staging" / "prose.partial"
    (out / "staging" / "prose").rename(unmarked)
    (unmarked / "_COMPLETE.json").unlink()
    (unmarked / "_PLAN.json").write_text(json.dumps({"fingerprint": complete_marker["fingerprint"]}))
    unmarked_mtimes = {p.name: p.stat().st_mtime_ns for p in unmarked.glob("*.parquet")}
    capsys.readouterr()
    assert prepare_data.main(args) == 0
    printed = capsys.readouterr().out
    assert f"[staging] resuming {unmarked}: {len(unmarked_mtimes)}/{len(unmarked_mtimes)} staged files" in printed
    assert json.loads((out / "staging" / "prose" / "_COMPLETE.json").read_text()) == complete_marker
    assert {p.name: p.stat().st_mtime_ns for p in (out / "staging" / "prose").glob("*.parquet")} == unmarked_mtimes
    assert f"[staging] resuming {partial}: {len(staged_mtimes)}/{len(staged)} staged files" in printed
    assert {p.name: p.read_bytes() for p in (out / "staging" / "notes").glob("*.parquet")} == staged
    assert json.loads((out / "staging" / "notes" / "_COMPLETE.json").read_text()) == staged_marker
    assert all((out / "staging" / "notes" / n).stat().st_mtime_ns == m for n, m in staged_mtimes.items())
    assert not partial.exists()
    assert f"[pack] {len(kept)}/" in printed and "already packed by an earlier run" in printed
    assert "removing" in printed and "prose.tmp-999999" in printed
    assert not (out / "staging" / "prose.tmp-999999").exists()
    assert {p.name: p.read_bytes() for p in (out / "packed").glob("*.parquet")} == reference
    assert all((out / "packed" / name).stat().st_mtime_ns == m for name, m in mtimes.items())
    assert f"[recover] {out / 'shards.v0001'} was published, {out / 'shards'} does not exist yet" in printed
    assert (out / "shards").readlink() == Path("shards.v0001") and "[shuffle] complete" in printed


def test_second_driver_on_the_same_output_dir_is_refused_before_ray_starts(tmp_path, capsys):
    """<output_dir>/LOCK is the training run's lock (huginn_ray/train/runlock.py), taken by both data jobs; a live
    holder is named."""
    import socket

    from huginn_ray.train.runlock import _process_start

    config = _config(tmp_path, tmp_path / "sources.yaml")
    holder = subprocess.Popen(["sleep", "60"])  # stands in for another prepare_data driver
    try:
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "LOCK").write_text(json.dumps({
            "host": socket.gethostname(), "pid": holder.pid, "start": _process_start(holder.pid),
            "since": "2026-01-01T00:00:00Z"}))
        for job in (prepare_data, train_tokenizer_job):  # the tokenizer's job writes download/ and staging/ too
            assert job.main(["--config", str(config)]) == 1
            err = capsys.readouterr().err
            assert f"another job is writing run directory {tmp_path / 'out'}" in err and f"PID {holder.pid}" in err
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["LOCK"]


def test_reducers_open_only_the_map_files_holding_rows_for_them(ray_instance, tmp_path):
    """Map groups of train-only and val-only files: each reducer opens only the map files of its own split."""
    from huginn_ray.data import shard_build as build_mod
    from huginn_ray.data.tokenize_pack import packed_schema
    from huginn_ray.data.tokens import rows_to_arrow

    (tmp_path / "packed").mkdir()
    files = []
    for i in range(6):  # 130 rows of 8 KiB: one file per 1 MiB map group; files 0-2 train, 3-5 validation
        rows = (np.arange(130 * 4096).reshape(130, 4096) + i) % 60000
        split = np.full(130, i >= 3, np.uint8)
        path = tmp_path / "packed" / f"{i:04d}.parquet"
        pq.write_table(pa.table({"input_ids": rows_to_arrow(rows, "uint16"), "split": pa.array(split)},
                                schema=packed_schema("uint16")), path)
        files.append({"path": str(path), "train_rows": 0 if i >= 3 else 130, "val_rows": 130 if i >= 3 else 0})
    manifest = _shuffle(files, tmp_path / "shards", num_shards=3, reducer_mib=1, map_mib=1)
    assert manifest["rows_per_shard"] == {"train": 130, "val": 130}
    stats = build_mod.last_run_stats
    assert (stats["map_tasks"], stats["reducers"]) == (6, 6)
    # 3 train reducers x 3 train map files + 3 val reducers x 3 val map files (not 6 x 6)
    assert stats["map_files_opened"] == 18


def _map_group_task():
    """One task of the shuffle's map pass (shuffle.map_unit: read, place, write) for a map group of files, in a
    plain Ray task: run(files, plans, seed, row_len, work) -> its result. A nested function, so that a Ray worker
    gets it by value (workers cannot import this test module)."""

    def run(files: list[dict], plans: dict, seed: int, row_len: int, work: str) -> dict:
        from huginn_ray.data import shuffle as shuffle_mod
        from huginn_ray.data.shards import SPLITS

        unit = {"files": files, "offsets": {"train": 0, "val": 0},
                "counts": {name: sum(f[f"{name}_rows"] for f in files) for name in SPLITS}}
        return shuffle_mod.map_unit((0, unit), plans, seed, work, row_len, "uint16", 65536, False, False)

    return run


def _convert_task():
    """One task of the released data's conversion (per_file.per_file_unit: read, write) for one file, in a plain
    Ray task: run(entry, target, row_len, row_group_size) -> its result (nested: see above)."""

    def run(entry: dict, target: str, row_len: int, row_group_size: int) -> dict:
        from huginn_ray.data import per_file as per_file_mod

        unit = {"files": [entry], "target": target, "record": None}
        return per_file_mod.per_file_unit((0, unit), False, row_len, "uint16", 65536, False, row_group_size, None)

    return run


def test_map_files_use_64_bit_list_offsets_and_a_list_array_refuses_overflow(tmp_path):
    """Map files hold ~map_mib of rows (>= 4 GiB overflows list<> offsets): large_list; a list<> array refuses."""
    import pyarrow.ipc as ipc

    from huginn_ray.data.shards import SPLITS
    from huginn_ray.data.shuffle import plan_split
    from huginn_ray.data.tokens import rows_to_arrow

    too_many = np.broadcast_to(np.zeros(1, np.uint16), (2**21, 1025))  # 2.15e9 ids, no memory behind them
    with pytest.raises(ValueError, match=r"2097152 rows of 1025 ids do not fit one list array \(2147483647 ids"):
        rows_to_arrow(too_many, "uint16")
    files = _synthetic_packed(tmp_path / "packed", n_files=1)  # 32 train + 8 val rows of 1024 ids
    plans = {name: plan_split(rows, 2, 2056, 1 << 20, name) for name, rows in (("train", 32), ("val", 8))}
    for name in SPLITS:
        (tmp_path / "work" / "map" / name).mkdir(parents=True)
    _map_group_task()(files, plans, 5, 1024, str(tmp_path / "work"))
    with pa.memory_map(str(tmp_path / "work" / "map" / "train" / "000000.arrow")) as source:
        table = ipc.open_file(source).read_all()
    assert table.schema.field("input_ids").type == pa.large_list(pa.uint16()) and table.num_rows == 32
    assert sorted(p.name for p in (tmp_path / "work" / "map" / "train").iterdir()) == ["000000.arrow",
                                                                                        "000000.idx.npy"]


def test_manifest_records_versions_config_hash_and_source_commits(prepared):
    import dataclasses
    import importlib.metadata

    from huginn_ray.data import layout
    from huginn_ray.data.config import load_data_config

    root, config = prepared
    provenance = read_manifest(root / "out" / "shards")["provenance"]
    assert provenance["versions"] == {name: importlib.metadata.version(name)
                                      for name in ("huginn_ray", "ray", "pyarrow", "tokenizers", "numpy")}
    cfg = dataclasses.asdict(load_data_config(config))
    assert provenance["config"] == json.loads(json.dumps(cfg))
    assert provenance["config_sha256"] == layout.fingerprint(cfg)
    assert provenance["source_commits"] == {"prose": None, "chat": None, "notes": None, "empty": None}  # local
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert provenance["huginn_ray_git"].split("+")[0] == head.strip()


def test_plan_of_the_demo_config_is_within_20_percent_of_what_the_run_measures(prepared, tmp_path, capsys):
    from huginn_ray.data import shard_build as build_mod

    root, _ = prepared
    out = tmp_path / "demo"
    args = ["--config", str(ROOT / "configs" / "data" / "demo.yaml"), f"output_dir={out}",
            f"tokenizer.path={root / 'out' / 'tokenizer'}"]
    capsys.readouterr()
    assert prepare_data.main([*args, "--plan", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert not out.exists()  # the plan writes nothing
    assert prepare_data.main(args) == 0
    from huginn_ray.data.config import load_data_config
    from huginn_ray.data.sources import load_sources
    from huginn_ray.data.staging import list_local_files

    sources = load_sources(load_data_config(args[1]).sources)
    assert plan["input_bytes"] == sum(p.stat().st_size for s in sources for p in list_local_files(s))
    marker = json.loads((out / "packed" / "_COMPLETE.json").read_text())
    tokens = (marker["train_rows"] + marker["val_rows"]) * 257
    on_disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    peak = on_disk + build_mod.last_run_stats["intermediate_bytes_written"]  # map files live until the end
    assert 0.8 * tokens <= plan["estimated_tokens"] <= 1.2 * tokens
    assert 0.8 * peak <= plan["peak_disk_bytes"] <= 1.2 * peak
    assert plan["counts"]["input_files"] == plan["counts"]["staged_files"] == 110
    assert plan["counts"]["shard_files"] == 4 and plan["unsampled_sources"] == []


def test_plan_refuses_a_run_whose_peak_disk_exceeds_the_free_space(prepared, tmp_path, capsys, monkeypatch):
    import shutil as shutil_mod

    root, config = prepared
    monkeypatch.setattr(shutil_mod, "disk_usage", lambda path: shutil_mod._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    args = ["--config", str(config), f"output_dir={tmp_path / 'full'}", f"tokenizer.path={root / 'out' / 'tokenizer'}"]
    assert prepare_data.main([*args, "--plan"]) == 1
    assert f"output_dir {tmp_path / 'full'}: the run needs" in capsys.readouterr().err
    assert prepare_data.main(args) == 1  # a real run checks the same before its first stage
    err = capsys.readouterr().err
    assert "GiB are free on its file system" in err and not (tmp_path / "full" / "staging").exists()


def test_a_map_task_stays_under_the_memory_it_declares(ray_instance, tmp_path):
    """int64 input files (like the released data's: 4x the uint16 width): a fresh worker's peak RSS, worker
    footprint included, is below the task's memory= declaration, for a map task and for a released file's
    conversion to a uint16 shard."""
    import ray

    from huginn_ray.data import packed_rows as packed_rows_mod
    from huginn_ray.data import per_file as per_file_mod
    from huginn_ray.data import shuffle as shuffle_mod
    from huginn_ray.data.shards import SPLITS
    from huginn_ray.data.tokens import rows_to_arrow

    row_len, per_file = 4097, 2048  # 2 files of 2,048 rows: 64 MiB as int64 each, 16 MiB each as uint16
    (tmp_path / "in").mkdir()
    files = []
    for i in range(2):
        ids = np.random.default_rng(i).integers(0, 65000, size=(per_file, row_len)).astype(np.int64)
        offsets = pa.array(np.arange(0, (per_file + 1) * row_len, row_len, dtype=np.int32))
        pq.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids.reshape(-1)))}),
                       tmp_path / "in" / f"{i}.parquet")
        files.append({"path": str(tmp_path / "in" / f"{i}.parquet"), "train_rows": per_file, "val_rows": 0})
    plans = {"train": shuffle_mod.plan_split(2 * per_file, 4, 1, 1 << 30, "train"),
             "val": {"rows": 0, "kept": 0, "rows_per_shard": 1, "num_shards": 4}}
    for name in SPLITS:
        (tmp_path / "work" / "map" / name).mkdir(parents=True)
    declared = shuffle_mod.map_task_memory(files, row_len, "uint16", 8, False)
    # a worker of its own (another runtime env: no pooled worker that ran earlier tests' tasks), so that its
    # peak RSS is this task's
    task = ray.remote(max_calls=1, memory=declared, runtime_env={"env_vars": {"HUGINN_FRESH_WORKER": "1"}})(
        _map_group_task())
    result = ray.get(task.remote(files, plans, 1, row_len, str(tmp_path / "work")))
    assert result["bytes_written"] > 2 * per_file * row_len * 2  # it did the work: all rows in the map file
    assert result["peak_rss_mib"] * 2**20 < declared, (result["peak_rss_mib"], declared / 2**20)

    # converting one such file (row groups of 256 rows) to a uint16 shard reads it by row groups: it declares a
    # row group's read and write, nothing that grows with the file's 64 MiB of int64, and stays under that
    entry = {"path": str(tmp_path / "in" / "grouped.parquet"), "train_rows": per_file, "val_rows": 0}
    pq.write_table(pq.read_table(files[0]["path"]), entry["path"], row_group_size=256)
    declared = per_file_mod.convert_task_memory(entry, row_len, "uint16", 64, False)
    assert declared == (256 * row_len * 8 * per_file_mod.CONVERT_READ_FACTOR + per_file_mod.CONVERT_READER_BYTES
                        + 2 * (64 + 256) * row_len * 2 + packed_rows_mod.RAY_DATA_BLOCKS + (256 << 20))
    task = ray.remote(max_calls=1, memory=declared, runtime_env={"env_vars": {"HUGINN_FRESH_WORKER": "2"}})(
        _convert_task())
    result = ray.get(task.remote(entry, str(tmp_path / "shard.parquet"), row_len, 64))
    assert result["rows"] == per_file and pq.read_metadata(tmp_path / "shard.parquet").num_rows == per_file
    assert result["peak_rss_mib"] * 2**20 < declared, (result["peak_rss_mib"], declared / 2**20)


# ---- chat sources (kind: chat): conversations -> rows with a loss_mask column, through every stage ----

CHAT_SEQ_LEN, CHAT_BATCH, QA_SYSTEM = 64, 32, "QA-SYSTEM quiz"


def _write_chat_sources(root: Path) -> tuple[Path, dict[str, list]]:
    """A JSONL source of messages (system prompts, one or two turns, roles assistant and Huginn, one conversation
    longer than a row) with the loss on Huginn's turns, and a parquet question/answer source with a system prompt,
    the loss on every token and weight 2. Returns the sources file and each source's conversations as rendered."""
    rng = random.Random(2)
    (root / "convs").mkdir(parents=True)
    convs = []
    for i in range(60):
        messages = [{"role": "system", "content": _text(rng, 2, 6)}] if i % 3 == 0 else []
        for _ in range(rng.randint(1, 2)):
            messages += [{"role": "user", "content": _text(rng, 1, 6)},
                         {"role": "assistant" if i % 2 else "Huginn", "content": _text(rng, 1, 8)}]
        convs.append(messages)
    convs.insert(7, [{"role": "user", "content": "long"}, {"role": "assistant", "content": _text(rng, 150, 150)}])
    with open(root / "convs" / "part0.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": m, "id": i}) + "\n" for i, m in enumerate(convs))
    (root / "qa").mkdir()
    questions, answers = [_text(rng, 2, 6) for _ in range(30)], [_text(rng, 1, 6) for _ in range(30)]
    pq.write_table(pa.table({"q": questions, "a": answers}), root / "qa" / "qa.parquet")
    qa = [[{"role": "system", "content": QA_SYSTEM}, {"role": "user", "content": q}, {"role": "assistant", "content": a}]
          for q, a in zip(questions, answers)]
    sources = root / "chat_sources.yaml"
    sources.write_text(f"""
- {{name: convs, kind: chat, local_dir: convs, features: [messages]}}
- {{name: qa, kind: chat, local_dir: qa, features: [q, a], system_prompt: {QA_SYSTEM}, loss_on: all, weight: 2.0}}
""")
    return sources, {"convs": convs, "qa": qa}


@pytest.fixture(scope="module")
def chat_prepared(prepared, tmp_path_factory):
    """The chat sources prepared twice with the tokenizer of `prepared`: one conversation per row, and packed."""
    root = tmp_path_factory.mktemp("chat")
    sources, conversations = _write_chat_sources(root)
    config = _config(root, sources)
    common = ["--config", str(config), f"tokenizer.path={prepared[0] / 'out' / 'tokenizer'}",
              f"seq_len={CHAT_SEQ_LEN}", "num_shards=2", f"docs_per_pack_batch={CHAT_BATCH}"]
    assert prepare_data.main([*common, f"output_dir={root / 'pad'}"]) == 0
    assert prepare_data.main([*common, f"output_dir={root / 'pack'}", "chat.pack=true"]) == 0
    return root, config, common, conversations


def _chat_tokenizer(root: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(root / "out" / "tokenizer" / "tokenizer.json"))


def _assistant_mask(ids: list[int], special, huginn: list[int], newlines: list[int]) -> list[int]:
    """Written out from the template, token by token: 1 on the content and <|end_turn|> of every Huginn turn."""
    mask, i = [0] * len(ids), 0
    while i < len(ids):
        if ids[i] != special.begin_header:
            i += 1
            continue
        end_header = ids.index(special.end_header, i) if special.end_header in ids[i:] else len(ids)
        start = end_header + 1 + len(newlines)
        end = ids.index(special.end_turn, start) + 1 if special.end_turn in ids[start:] else len(ids)
        if ids[i + 1:end_header] == huginn:
            mask[start:end] = [1] * (end - start)
        i = end
    return mask


def test_chat_shards_carry_the_loss_mask_row_aligned_through_the_shuffle(chat_prepared, prepared):
    """Every shard row's loss mask is the one its ids call for (decoded turn by turn), padding never supervised;
    the shards' supervised tokens are the manifest's, and the manifest's counts per source are exact."""
    from huginn_ray.data.chat import chat_token_ids, render
    from huginn_ray.train.shard_check import ShardCheckError, check_shards

    root, _, _, conversations = chat_prepared
    tokenizer = _chat_tokenizer(prepared[0])
    special = chat_token_ids(tokenizer)
    huginn, newlines = (tokenizer.encode(t, add_special_tokens=False).ids for t in ("Huginn", "\n\n"))
    row_len = CHAT_SEQ_LEN + 1
    rendered = {name: [render(m, tokenizer, "all" if name == "qa" else "assistant") for m in convs]
                for name, convs in conversations.items()}
    for layout_name in ("pad", "pack"):
        shards = root / layout_name / "shards"
        manifest = read_manifest(shards)
        supervised, qa_rows = {"train": 0, "val": 0}, 0
        for split in ("train", "val"):
            for path in sorted((shards / split).glob("*.parquet")):
                table = pq.read_table(path)
                assert table.schema == pa.schema([("input_ids", pa.list_(pa.uint16())),
                                                  ("loss_mask", pa.list_(pa.uint8()))])
                for ids, mask in zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()):
                    assert len(ids) == len(mask) == row_len and ids[0] == special.bos
                    if QA_SYSTEM in tokenizer.decode(ids, skip_special_tokens=False):  # loss_on: all
                        qa_rows += 1
                        assert mask == [int(t != special.pad) for t in ids]
                    else:
                        assert mask == _assistant_mask(ids, special, huginn, newlines) and sum(mask) > 0
                    supervised[split] += sum(mask[1:])
        assert manifest["loss_mask"] == {"dtype": "uint8", "supervised_tokens": supervised}
        stats = manifest["sources"]
        kept = {name: sum(min(len(ids), row_len) for ids, _ in r) * (2 if name == "qa" else 1)
                for name, r in rendered.items()}
        rows = {name: stats[name]["train_rows"] + stats[name]["val_rows"] for name in rendered}
        assert stats["convs"]["supervised_tokens"] == sum(sum(m[1:row_len]) for _, m in rendered["convs"])
        # loss_on all: every token kept but the first of each row
        assert stats["qa"]["supervised_tokens"] == kept["qa"] - rows["qa"]
        for name in rendered:
            assert stats[name]["kind"] == "chat" and stats[name]["pack"] == (layout_name == "pack")
            assert stats[name]["docs"] == len(rendered[name])
            assert stats[name]["pad_tokens"] == rows[name] * row_len - kept[name]
        assert stats["convs"]["truncated_conversations"] == sum(len(ids) > row_len for ids, _ in rendered["convs"])
        assert stats["convs"]["truncated_conversations"] >= 1 and stats["qa"]["truncated_conversations"] == 0
        assert 0 < qa_rows <= rows["qa"]
        check_shards(shards, manifest, 4096)
        with pytest.raises(ShardCheckError, match="a column 'loss_mask', the manifest records no loss mask"):
            check_shards(shards, {k: v for k, v in manifest.items() if k != "loss_mask"}, 4096)


def test_padded_rows_are_one_per_conversation_and_packed_rows_follow_the_greedy_rule(chat_prepared, prepared):
    """Row counts, exact: padded, one row per conversation copy; packed, whole conversations in the pack stage's
    order (per batch: held-out split by hash, then each copy's seeded order) as many per row as fit."""
    from huginn_ray.data.chat import render
    from huginn_ray.data.packing import copy_order, unit_hash

    root, _, _, conversations = chat_prepared
    tokenizer = _chat_tokenizer(prepared[0])
    row_len = CHAT_SEQ_LEN + 1
    pad = read_manifest(root / "pad" / "shards")["sources"]
    pack = read_manifest(root / "pack" / "shards")["sources"]
    for name, copies in (("convs", 1), ("qa", 2)):
        texts = pq.read_table(root / "pad" / "staging" / name / "00000.parquet").column("text").to_pylist()
        assert [json.loads(t)[-1]["content"] for t in texts] == [c[-1]["content"] for c in conversations[name]]
        lengths = [len(render(json.loads(t), tokenizer)[0]) for t in texts]
        held_out = [unit_hash(233, "val", t) < 0.2 for t in texts]
        expected = {"train": 0, "val": 0}
        for start in range(0, len(texts), CHAT_BATCH):
            count = min(CHAT_BATCH, len(texts) - start)
            for copy in range(copies):
                order = copy_order(233, copy, start, count)
                for split, val in (("train", False), ("val", True)):
                    used, rows = 0, 0
                    for i in order:
                        if held_out[start + i] != val:
                            continue
                        if rows == 0 or used + lengths[start + i] > row_len:
                            rows, used = rows + 1, 0
                        used += lengths[start + i]
                    expected[split] += rows
        assert (pad[name]["train_rows"], pad[name]["val_rows"]) == (
            copies * (len(texts) - sum(held_out)), copies * sum(held_out))
        assert (pack[name]["train_rows"], pack[name]["val_rows"]) == (expected["train"], expected["val"])
    assert pack["convs"]["train_rows"] < pad["convs"]["train_rows"]  # qa's conversations do not fit two to a row


def test_chat_config_errors_are_named(chat_prepared, tmp_path, capsys):
    root, config, common, _ = chat_prepared
    assert prepare_data.main([*common, "chat.pack=yes please"]) == 2
    assert "chat.pack" in capsys.readouterr().err
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text((root / "chat_sources.yaml").read_text() + f"- {{name: prose, local_dir: {root / 'qa'}, "
                                                               "features: [q]}\n")
    assert prepare_data.main([*common, f"sources={mixed}", f"output_dir={tmp_path / 'mixed'}"]) == 1
    assert "mixes chat sources (convs, qa) with other sources (prose)" in capsys.readouterr().err
    assert not (tmp_path / "mixed" / "staging").exists()  # refused before anything ran


def test_plan_of_a_chat_config_counts_its_padded_or_packed_rows(chat_prepared):
    """--plan renders a chat source's conversations and lays them out as the run does: padded rows exactly (one
    per conversation copy), packed rows within 15 % (the plan packs a batch in file order; the run packs each split
    of each copy on its own, in a seeded order, and each of those ends in a part-filled row: 4 per batch of qa,
    noticeable on these few rows)."""
    from huginn_ray.data.config import load_data_config
    from huginn_ray.data.plan import build_plan
    from huginn_ray.data.sources import load_sources

    root, config, common, _ = chat_prepared
    for layout_name, extra in (("pad", []), ("pack", ["chat.pack=true"])):
        cfg = load_data_config(config, [*common[2:], f"output_dir={root / layout_name}", *extra])
        plan = build_plan(cfg, load_sources(cfg.sources))
        sources = read_manifest(root / layout_name / "shards")["sources"]
        for name, estimate in ((s["name"], s["estimated_tokens"]) for s in plan["sources"]):
            made = (sources[name]["train_rows"] + sources[name]["val_rows"]) * (CHAT_SEQ_LEN + 1)
            if layout_name == "pad":
                assert estimate == made
            else:
                assert made >= estimate > 0.85 * made


GSM8K_SAMPLE = ROOT / "configs" / "eval" / "gsm8k_test_sample.jsonl"


def _write_contaminated_sources(root: Path) -> tuple[Path, dict]:
    """A web source with three GSM8k test questions planted verbatim in documents 5, 17 (upper case, punctuation
    moved) and 30 (and the first 12
    words of the fourth, one short of an n-gram, in document 23), a mirror source holding three of web's documents
    byte for byte, one with other case, and one document twice, and a pretraining chat source with the fourth
    question in a user message."""
    rng = random.Random(2)
    questions = [json.loads(line)["question"] for line in GSM8K_SAMPLE.read_text().splitlines()]
    web = [_text(rng, 20, 60) for _ in range(40)]
    for doc, question in zip((5, 17, 30), questions):
        web[doc] = f"{_text(rng, 5, 10)} {question} {_text(rng, 5, 10)}"
    web[17] = web[17].upper().replace(".", " .").replace("?", "")  # matched after normalisation only
    web[23] = " ".join(questions[3].split()[:12]) + " " + _text(rng, 5, 10)
    mirror = [web[1], _text(rng, 20, 60), web[2], web[3].upper(), _text(rng, 20, 60), web[9]]
    twice = _text(rng, 20, 60)
    mirror += [twice, _text(rng, 20, 60), twice]
    talk = [[{"role": "user", "content": _text(rng, 3, 20)}, {"role": "assistant", "content": _text(rng, 3, 30)}]
            for _ in range(8)]
    talk[6][0]["content"] = questions[3]
    for name, docs in (("web", web), ("mirror", mirror)):
        (root / name).mkdir()
        (root / name / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    (root / "talk").mkdir()
    pq.write_table(pa.table({"messages": talk}), root / "talk" / "talk.parquet")
    sources = root / "sources.yaml"
    sources.write_text("- {name: web, local_dir: web, features: [text]}\n"
                       "- {name: mirror, local_dir: mirror, features: [text]}\n"
                       "- {name: talk, local_dir: talk, features: [messages], needs_chat_templating: true}\n")
    return sources, {"web": web, "mirror": mirror}


def test_decontamination_drops_or_reports_planted_test_questions_and_exact_duplicates_are_dropped_once(
        prepared, tmp_path, capsys):
    """decontaminate (13-grams against the GSM8k sample) drops the documents holding a test question, a chat
    message's included, counts them per source in the manifest and lists them; with mode report they are listed
    and kept. dedup exact drops the mirror's copies of web documents and its second copy of its own document, not
    the one that differs in case, which dedup near drops too (the same words). Dropped documents never reach
    packing; the filter stage resumes keeping its committed files."""
    sources, texts = _write_contaminated_sources(tmp_path)
    config = _config(tmp_path, sources)
    with open(config, "a") as f:
        f.write(f"decontaminate: {{mode: drop, ngram: 13, against: [{GSM8K_SAMPLE}]}}\ndedup: exact\n")
    out = tmp_path / "out"
    args = ["--quiet", "--config", str(config), f"tokenizer.path={prepared[0] / 'out' / 'tokenizer'}", "num_shards=2"]
    capsys.readouterr()
    assert prepare_data.main(args) == 0
    printed = capsys.readouterr().out
    assert "[filter] web: 40 documents -> 37 kept; decontaminated: 3 dropped; exact duplicates dropped: 0" in printed
    assert "[filter] mirror: 9 documents -> 5 kept; decontaminated: 0 dropped; exact duplicates dropped: 4" in printed
    assert "[filter] talk: 8 documents -> 7 kept; decontaminated: 1 dropped; exact duplicates dropped: 0" in printed
    manifest = read_manifest(out / "shards")
    assert manifest["document_filters"] == {
        "web": {"decontaminated": {"dropped": 3}, "exact_duplicates_dropped": 0},
        "mirror": {"decontaminated": {"dropped": 0}, "exact_duplicates_dropped": 4},
        "talk": {"decontaminated": {"dropped": 1}, "exact_duplicates_dropped": 0}}
    assert {name: s["docs"] for name, s in manifest["sources"].items()} == {"web": 37, "mirror": 5, "talk": 7}
    assert manifest["provenance"]["eval_sets"] == [{"path": str(GSM8K_SAMPLE)}]  # as filtered/ngrams.json has it
    assert manifest["decontamination"] == {  # per evaluation item: the documents it dropped
        "documents_per_item": {f"{GSM8K_SAMPLE}, line {i}, question": 1 for i in (1, 2, 3, 4)}, "guarded": [],
        "short_items": 0}
    filtered = {name: pq.read_table(out / "filtered" / name / "00000.parquet").column("text").to_pylist()
                for name in texts}
    assert filtered == {"web": [t for i, t in enumerate(texts["web"]) if i not in (5, 17, 30)],
                        "mirror": [texts["mirror"][i] for i in (1, 3, 4, 6, 7)]}
    report = [json.loads(line) for line in (out / "filtered" / "decontamination.jsonl").read_text().splitlines()]
    assert [(r["source"], r["doc_id"], r["item"], r["dropped"]) for r in report] == [
        ("web", 5, f"{GSM8K_SAMPLE}, line 1, question", True), ("web", 17, f"{GSM8K_SAMPLE}, line 2, question", True),
        ("web", 30, f"{GSM8K_SAMPLE}, line 3, question", True), ("talk", 6, f"{GSM8K_SAMPLE}, line 4, question", True)]
    assert report[0]["gram"] == "janet s ducks lay 16 eggs per day she eats three for breakfast"
    assert report[0]["file"] == str(tmp_path / "web" / "docs.jsonl")
    # files without a dropped document are hard links to the staged file, not copies
    talk_staged = out / "staging" / "talk" / "00000.parquet"
    assert os.stat(out / "filtered" / "talk" / "00000.parquet").st_ino != talk_staged.stat().st_ino  # one dropped

    # resume: an interrupted filter stage keeps its committed files
    marker = json.loads((out / "filtered" / "_COMPLETE.json").read_text())
    (out / "filtered").rename(out / "filtered.partial")
    (out / "filtered.partial" / "_COMPLETE.json").unlink()
    (out / "filtered.partial" / "_PLAN.json").write_text(json.dumps({"fingerprint": marker["fingerprint"]}))
    (out / "filtered.partial" / "mirror" / "00000.parquet").unlink()
    kept = out / "filtered.partial" / "web" / "00000.parquet"
    kept_mtime = kept.stat().st_mtime_ns
    assert prepare_data.main([*args, "--stage", "filter"]) == 0
    assert f"[filter] resuming {out / 'filtered.partial'}: 2/3 filtered files already written are kept" in (
        capsys.readouterr().out)
    assert (out / "filtered" / "web" / "00000.parquet").stat().st_mtime_ns == kept_mtime
    assert json.loads((out / "filtered" / "_COMPLETE.json").read_text()) == marker

    # mode report: listed and kept (the pack stage and the shards follow the new settings)
    assert prepare_data.main([*args, "decontaminate.mode=report"]) == 0
    printed = capsys.readouterr().out
    assert "[filter] web: 40 documents -> 40 kept; decontaminated: 3 reported; exact duplicates dropped: 0" in printed
    manifest = read_manifest(out / "shards")
    assert manifest["document_filters"]["talk"] == {"decontaminated": {"reported": 1}, "exact_duplicates_dropped": 0}
    assert {name: s["docs"] for name, s in manifest["sources"].items()} == {"web": 40, "mirror": 5, "talk": 8}
    report = [json.loads(line) for line in (out / "filtered" / "decontamination.jsonl").read_text().splitlines()]
    assert [(r["source"], r["doc_id"], r["dropped"]) for r in report] == [
        ("web", 5, False), ("web", 17, False), ("web", 30, False), ("talk", 6, False)]
    web_filtered = out / "filtered" / "web" / "00000.parquet"
    assert web_filtered.stat().st_ino == (out / "staging" / "web" / "00000.parquet").stat().st_ino

    # dedup alone: no n-gram set, no report
    assert prepare_data.main([*args, "decontaminate.mode=none", "--stage", "filter"]) == 0
    printed = capsys.readouterr().out
    assert "[filter] mirror: 9 documents -> 5 kept; decontaminated: off; exact duplicates dropped: 4" in printed
    assert "[filter] web: 40 documents -> 40 kept; decontaminated: off; exact duplicates dropped: 0" in printed
    assert sorted(p.name for p in (out / "filtered").iterdir()) == ["_COMPLETE.json", "mirror", "talk", "web"]

    # dedup near: exact, then near; the mirror's upper-cased copy of web's document 3 (same words once lower-cased)
    # is a near duplicate, named with the document kept in its place
    assert prepare_data.main([*args, "decontaminate.mode=none", "dedup=near", "--stage", "filter"]) == 0
    printed = capsys.readouterr().out
    assert ("[filter] mirror: 9 documents -> 4 kept; decontaminated: off; exact duplicates dropped: 4; near "
            "duplicates dropped: 1") in printed
    assert "[filter] web: 40 documents -> 40 kept; decontaminated: off; exact duplicates dropped: 0; near" in printed
    near = [json.loads(line) for line in (out / "filtered" / "near_duplicates.jsonl").read_text().splitlines()]
    assert near == [{"source": "mirror", "file": str(tmp_path / "mirror" / "docs.jsonl"), "doc_id": 3,
                     "kept": {"source": "web", "file": str(tmp_path / "web" / "docs.jsonl"), "doc_id": 3}}]
    assert pq.read_table(out / "filtered" / "mirror" / "00000.parquet").column("text").to_pylist() == [
        texts["mirror"][i] for i in (1, 4, 6, 7)]
    assert sorted(p.name for p in (out / "filtered").iterdir()) == [
        "_COMPLETE.json", "mirror", "near_duplicates.jsonl", "talk", "web"]
