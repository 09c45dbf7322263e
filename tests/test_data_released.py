"""The released, already packed dataset as an input: a local directory and a Hub repo mimicking
tomg-group-umd/huginn-dataset (train/ and val/ parquet files, column `input_ids`, rows of seq_len + 1 ids) go
straight to the shuffle and are re-sharded into N + N shards for any N."""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_hub_server import FakeHub, HubRepo
from huginn_ray.data.shards import read_manifest
from huginn_ray.data.tokenizer import train_tokenizer
from local_ray import module_ray

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN, VOCAB = 32, 4096
spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "jobs" / "prepare_data.py")
prepare_data = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prepare_data)


@pytest.fixture(scope="module")
def ray_instance():
    with module_ray("hrdr_"):
        yield


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text() for p in sorted((stdlib / "json").glob("*.py"))]
    return train_tokenizer(texts, VOCAB, tmp_path_factory.mktemp("tok") / "tokenizer")


def _file_bytes(first_row: int, rows: int, row_len: int = SEQ_LEN + 1, bad_id: int | None = None,
                value_type: pa.DataType = pa.int64()) -> bytes:
    ids = (np.arange(rows * row_len).reshape(rows, row_len) * 7 + first_row) % VOCAB
    ids[:, 0] = first_row + np.arange(rows)  # identity of the row
    if bad_id is not None:
        ids[2, 5] = bad_id
    buf = io.BytesIO()
    pq.write_table(pa.table({"input_ids": pa.array(list(ids), pa.list_(value_type))}), buf)
    return buf.getvalue()


def _released_files() -> dict[str, bytes]:
    files = {f"train/{i:03d}_00000.parquet": _file_bytes(100 * i, 30) for i in range(6)}
    files.update({f"val/{i:03d}_00000.parquet": _file_bytes(1000 + 100 * i, 11) for i in range(3)})
    files["README.md"] = b"# card\n"
    return files


def _write_local(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / "released" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "released" / rel).write_bytes(data)
    return root / "released"


def _config(root: Path, tokenizer: Path, source: str) -> Path:
    (root / "sources.yaml").write_text(source)
    (root / "data.yaml").write_text(f"""
output_dir: {root / 'out'}
sources: sources.yaml
seq_len: {SEQ_LEN}
num_shards: 4
tokenizer: {{path: {tokenizer}}}
shuffle: {{row_group_size: 4}}
""")
    return root / "data.yaml"


LOCAL = """
- name: released
  kind: packed
  local_dir: released
  train_files: ["train/*.parquet"]
  val_files: ["val/*.parquet"]
"""


def _shard_rows(shards: Path, split: str) -> collections.Counter:
    rows = collections.Counter()
    for f in sorted((shards / split).glob("*.parquet")):
        rows.update(tuple(r) for r in pq.read_table(f).column("input_ids").to_pylist())
    return rows


@pytest.mark.parametrize("num_shards", [4, 7])
def test_local_released_data_is_resharded_for_any_n(ray_instance, tokenizer, tmp_path, num_shards):
    files = _released_files()
    _write_local(tmp_path, files)
    config = _config(tmp_path, tokenizer, LOCAL)
    assert prepare_data.main(["--config", str(config), f"num_shards={num_shards}"]) == 0
    shards = tmp_path / "out" / "shards"
    manifest = read_manifest(shards)
    assert manifest["num_shards"] == num_shards and manifest["token_dtype"] == "uint16"
    inputs = {"train": collections.Counter(), "val": collections.Counter()}
    for rel, data in files.items():
        if rel.endswith(".parquet"):
            inputs[rel.split("/")[0]].update(tuple(r) for r in pq.read_table(io.BytesIO(data)).column(0).to_pylist())
    for split, total in (("train", 180), ("val", 33)):
        assert manifest["rows_per_shard"][split] == total // num_shards
        assert manifest["dropped_surplus_rows"][split] == total % num_shards
        got = _shard_rows(shards, split)
        assert not got - inputs[split] and sum(got.values()) == total - total % num_shards
        for f in (shards / split).glob("*.parquet"):
            assert pq.ParquetFile(f).schema_arrow.field("input_ids").type == pa.list_(pa.uint16())
    assert not set(_shard_rows(shards, "train")) & set(_shard_rows(shards, "val"))
    recorded = {f["path"]: f["hash"] for f in manifest["sources"]["released"]["files"]}
    assert recorded == {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()
                        if rel.endswith(".parquet")}
    assert not (tmp_path / "out" / "staging").exists() and not (tmp_path / "out" / "packed").exists()


@pytest.mark.parametrize("bad, expected", [
    (_file_bytes(0, 5, row_len=SEQ_LEN), "row 0 has 32 ids, expected 33"),
    (_file_bytes(0, 5, bad_id=VOCAB + 3), "token id 4099 does not fit the vocabulary of 4096 ids"),
    (_file_bytes(0, 5, bad_id=-1), "token id -1 does not fit the vocabulary of 4096 ids"),
    (_file_bytes(0, 5, value_type=pa.float64()), "column input_ids must hold lists of integer token ids, got "
                                                 "list<element: double>"),
])
def test_wrong_row_length_or_id_range_is_refused_naming_the_file(ray_instance, tokenizer, tmp_path, capsys, bad,
                                                                 expected):
    files = _released_files()
    files["train/003_00000.parquet"] = bad
    _write_local(tmp_path, files)
    assert prepare_data.main(["--config", str(_config(tmp_path, tokenizer, LOCAL))]) == 1
    err = capsys.readouterr().err
    assert "train/003_00000.parquet" in err and expected in err
    assert not (tmp_path / "out" / "shards").exists()


def test_pattern_matching_no_file_and_mixed_sources_are_refused(ray_instance, tokenizer, tmp_path, capsys):
    _write_local(tmp_path, _released_files())
    config = _config(tmp_path, tokenizer, LOCAL.replace('val/*.parquet', 'validation/*.parquet'))
    assert prepare_data.main(["--config", str(config)]) == 1
    assert "source 'released': no file matches val_files ['validation/*.parquet']" in capsys.readouterr().err
    config = _config(tmp_path, tokenizer, LOCAL + "- {name: docs, local_dir: released, features: [text]}\n")
    assert prepare_data.main(["--config", str(config)]) == 1
    assert "mixes packed sources (released) with document sources (docs)" in capsys.readouterr().err


def test_hub_released_data_records_commit_and_hashes(tokenizer, tmp_path):
    files = _released_files()
    repo = HubRepo("tomg-group-umd/huginn-dataset", files)
    config = _config(tmp_path, tokenizer, """
- name: huginn-dataset
  kind: packed
  address: tomg-group-umd/huginn-dataset
  train_files: ["train/*.parquet"]
  val_files: ["val/*.parquet"]
""")
    temp_dir = tempfile.mkdtemp(prefix="hrdr_", dir="/tmp")
    try:
        with FakeHub([repo]) as hub:
            env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf_home"),
                   "HF_HUB_DISABLE_TELEMETRY": "1", "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
            env.pop("HF_TOKEN", None)
            result = subprocess.run(
                [sys.executable, str(ROOT / "jobs" / "prepare_data.py"), "--config", str(config), "num_shards=5",
                 f"local_ray.temp_dir={temp_dir}", "local_ray.num_cpus=2"],
                env=env, capture_output=True, text=True, timeout=400)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = read_manifest(tmp_path / "out" / "shards")
    source = manifest["sources"]["huginn-dataset"]
    assert source["commit"] == repo.commit and source["address"] == "tomg-group-umd/huginn-dataset"
    assert {f["path"]: f["hash"] for f in source["files"]} == {
        rel: hashlib.sha256(data).hexdigest() for rel, data in files.items() if rel.endswith(".parquet")}
    assert manifest["rows_per_shard"] == {"train": 36, "val": 6}
    assert manifest["provenance"]["source_commits"] == {"huginn-dataset": repo.commit}
    assert not (tmp_path / "out" / "download" / "huginn-dataset" / "README.md").exists()


@pytest.mark.parametrize("drop", [True, False])
def test_validation_rows_that_also_occur_in_train_are_counted_and_dropped(ray_instance, tokenizer, tmp_path, capsys,
                                                                           drop):
    files = _released_files()
    # 3 new rows, then the first 5 rows of train/002_00000.parquet
    rows = [pq.read_table(io.BytesIO(_file_bytes(first, n))) for first, n in ((3000, 3), (200, 5))]
    buf = io.BytesIO()
    pq.write_table(pa.concat_tables(rows), buf)
    files["val/009_00000.parquet"] = buf.getvalue()
    _write_local(tmp_path, files)
    config = _config(tmp_path, tokenizer, LOCAL)
    assert prepare_data.main(["--config", str(config), f"drop_val_duplicates={str(drop).lower()}"]) == 0
    shards = tmp_path / "out" / "shards"
    manifest = read_manifest(shards)
    assert manifest["val_duplicates"] == {"found": 5, "dropped": 5 if drop else 0}
    assert manifest["sources"]["released"]["val_rows_also_in_train"] == 5
    assert manifest["sources"]["released"]["val_rows"] == (36 if drop else 41)
    assert manifest["rows_per_shard"]["val"] == (36 if drop else 41) // 4
    shared = set(_shard_rows(shards, "train")) | {tuple(r) for r in pq.read_table(
        io.BytesIO(files["train/002_00000.parquet"])).column(0).to_pylist()[:5]}
    in_val = set(_shard_rows(shards, "val")) & shared
    assert (len(in_val) == 0) if drop else (0 < len(in_val) <= 5)
    out = capsys.readouterr().out
    assert "[dedup] released: 5 validation rows also occur in train" in out


def test_as_many_released_files_as_shards_become_the_shards_one_by_one(ray_instance, tokenizer, tmp_path, capsys):
    """4 + 4 files, one row count per split, for num_shards=4. As list<uint16> rows: each file is read through
    (row length, id range), hard-linked as its shard and recorded so in the manifest. As int64 (as the release
    stores them): each file is converted to list<uint16> on its own, the shard holding exactly the file's rows in
    its order, in row groups of shuffle.row_group_size. Both pass the training preflight."""
    from huginn_ray.train.shard_check import check_shards

    def released_files(value_type: pa.DataType) -> dict[str, bytes]:
        return {f"{split}/{i:03d}_00000.parquet": _file_bytes(first + 100 * i, rows, value_type=value_type)
                for split, first, rows in (("train", 0, 30), ("val", 1000, 11)) for i in range(4)}

    files = released_files(pa.uint16())
    released = _write_local(tmp_path, files)
    capsys.readouterr()
    assert prepare_data.main(["--quiet", "--config", str(_config(tmp_path, tokenizer, LOCAL))]) == 0
    shards = tmp_path / "out" / "shards"
    manifest = read_manifest(shards)
    assert manifest["reshard_method"] == {"train": "hard_link", "val": "hard_link"}
    assert manifest["source_files"] == {split: [f"{split}/{i:03d}_00000.parquet" for i in range(4)]
                                        for split in ("train", "val")}
    assert manifest["rows_per_shard"] == {"train": 30, "val": 11}
    assert manifest["dropped_surplus_rows"] == {"train": 0, "val": 0}
    for split, rels in manifest["source_files"].items():
        for rank, rel in enumerate(rels):
            assert os.path.samefile(shards / split / f"{rank:05d}.parquet", released / rel)
    assert {f["path"]: f["hash"] for f in manifest["sources"]["released"]["files"]} == {
        rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}
    assert check_shards(shards, manifest, VOCAB).files == 8  # the training preflight takes them
    assert "hard-linked as the shards" in capsys.readouterr().out

    wide = tmp_path / "wide"
    wide_files = released_files(pa.int64())
    _write_local(wide, wide_files)
    assert prepare_data.main(["--quiet", "--config", str(_config(wide, tokenizer, LOCAL))]) == 0
    shards = wide / "out" / "shards"
    manifest = read_manifest(shards)
    assert manifest["reshard_method"] == {"train": "convert_uint16", "val": "convert_uint16"}
    assert manifest["row_group_size"] == 4
    assert manifest["source_files"] == {split: [f"{split}/{i:03d}_00000.parquet" for i in range(4)]
                                        for split in ("train", "val")}
    assert manifest["rows_per_shard"] == {"train": 30, "val": 11}
    for split, rels in manifest["source_files"].items():
        for rank, rel in enumerate(rels):
            shard = pq.ParquetFile(shards / split / f"{rank:05d}.parquet")
            assert shard.schema_arrow == pa.schema([("input_ids", pa.list_(pa.uint16()))])
            assert [shard.metadata.row_group(g).num_rows for g in range(shard.num_row_groups)] == (
                [4] * 7 + [2] if split == "train" else [4, 4, 3])
            assert shard.read().column(0).to_pylist() == pq.read_table(io.BytesIO(wide_files[rel])).column(0).to_pylist()
    assert {f["path"]: f["hash"] for f in manifest["sources"]["released"]["files"]} == {
        rel: hashlib.sha256(data).hexdigest() for rel, data in wide_files.items()}
    assert check_shards(shards, manifest, VOCAB).files == 8
    assert "converted to uint16 shards one by one" in capsys.readouterr().out

    bad_wide = tmp_path / "bad_wide"  # convertible, but one row is a id short: refused naming file and row
    _write_local(bad_wide, {**wide_files, "train/002_00000.parquet": _file_bytes(200, 30, row_len=SEQ_LEN)})
    assert prepare_data.main(["--quiet", "--config", str(_config(bad_wide, tokenizer, LOCAL))]) == 1
    err = capsys.readouterr().err
    assert "train/002_00000.parquet" in err and "row 0 has 32 ids, expected 33" in err
    assert not (bad_wide / "out" / "shards").exists()

    bad = tmp_path / "bad"  # linkable by their footers, but one id is outside the vocabulary: refused, nothing linked
    _write_local(bad, {**files, "val/002_00000.parquet": _file_bytes(1200, 11, bad_id=VOCAB + 3,
                                                                      value_type=pa.uint16())})
    assert prepare_data.main(["--quiet", "--config", str(_config(bad, tokenizer, LOCAL))]) == 1
    err = capsys.readouterr().err
    assert "val/002_00000.parquet" in err and "token id 4099 does not fit" in err
    assert not (bad / "out" / "shards").exists()


def test_sorted_duplicate_search_gives_exact_membership():
    from huginn_ray.data.dedup import in_sorted

    top = np.iinfo(np.uint64).max
    values = np.array([5, 1, 9, 7, 0, top, 8, 8], np.uint64)
    assert in_sorted(values, np.array([1, 7, 8, top], np.uint64)).tolist() == [
        False, True, False, True, False, True, True, True]
    assert in_sorted(values, np.zeros(0, np.uint64)).tolist() == [False] * 8
    assert in_sorted(np.zeros(0, np.uint64), np.array([3], np.uint64)).tolist() == []


def _rows_bytes(rows: list) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int64()))}), buf)
    return buf.getvalue()


def _recording_tasks(original, calls: Path, crash_after: int | None):
    """per_file.per_file_unit (the task of a released file for its shard), recording each call as a file under
    `calls`; with `crash_after`, the task for train rank `crash_after` waits until the train shards of the ranks
    before it are committed, then fails (a crash of the run in the middle of the conversion: the driver stops, the
    work directory stays as it is)."""

    def task(unit, **kwargs):
        target = Path(unit[1]["target"])
        (calls / f"{target.parent.name}-{target.name}").touch()
        if crash_after is not None and target.name == f"{crash_after:05d}.parquet":
            import time

            deadline = time.time() + 60
            while time.time() < deadline and not all(
                    (target.parent / f"{r:05d}.parquet").exists() for r in range(crash_after)):
                time.sleep(0.05)
            raise RuntimeError("simulated crash in the middle of the conversion")
        return original(unit, **kwargs)

    return task


def test_one_validation_duplicate_keeps_the_training_split_per_file_and_resumes(ray_instance, tokenizer, tmp_path,
                                                                                capsys, monkeypatch):
    """The released layout (4 + 4 int64 files for num_shards=4) with validation row 3 of val/001 a copy of training
    row 7 of train/002. The duplicate is dropped from validation; the validation split alone goes through the
    shuffle, the training files are converted one by one, and read once: the conversion tasks look their rows up
    in the validation rows' hashes (no separate search task reads them). "Today's path except the dropped duplicate", exactly:
    the training shards are byte for byte those of the per-file path that keeps the duplicate (both splits per
    file), and the validation shards those of the two-pass shuffle of both splits with the row skipped (the path
    before issue 29). A crash after 3 of the 4 training files are converted: the rerun converts only the 4th, and
    reads the validation rows' saved hashes instead of hashing them again."""
    from huginn_ray.data import dedup as dedup_mod
    from huginn_ray.data import per_file as per_file_mod
    from huginn_ray.data import shard_build as build_mod

    hash_files = dedup_mod._hash_files

    def no_separate_pass(name, *args, **kwargs):
        assert name != "dedup_match_train", "the training files were read by a separate duplicate search"
        return hash_files(name, *args, **kwargs)

    monkeypatch.setattr(dedup_mod, "_hash_files", no_separate_pass)  # one pass: the conversion looks them up
    files = {f"{split}/{i:03d}_00000.parquet": _file_bytes(first + 100 * i, rows)
             for split, first, rows in (("train", 0, 30), ("val", 1000, 11)) for i in range(4)}
    table = {rel: pq.read_table(io.BytesIO(data)).column(0).to_pylist() for rel, data in files.items()}
    duplicate = table["train/002_00000.parquet"][7]
    table["val/001_00000.parquet"][3] = duplicate
    files["val/001_00000.parquet"] = _rows_bytes(table["val/001_00000.parquet"])
    released = _write_local(tmp_path, files)
    config = _config(tmp_path, tokenizer, LOCAL)
    out = tmp_path / "out"

    kept = tmp_path / "kept"  # the duplicate kept: both splits per file (what today's code gives with no duplicate)
    assert prepare_data.main(["--quiet", "--config", str(config), f"output_dir={kept}",
                              "drop_val_duplicates=false"]) == 0
    assert read_manifest(kept / "shards")["reshard_method"] == {"train": "convert_uint16", "val": "convert_uint16"}

    first_calls, second_calls = tmp_path / "calls1", tmp_path / "calls2"
    first_calls.mkdir(), second_calls.mkdir()
    original = per_file_mod.per_file_unit
    monkeypatch.setattr(per_file_mod, "per_file_unit", _recording_tasks(original, first_calls, crash_after=3))
    assert prepare_data.main(["--quiet", "--config", str(config)]) == 1
    assert "simulated crash in the middle of the conversion" in capsys.readouterr().err
    partial = out / "shards.partial" / "out"
    finished = {p.name: p.stat().st_mtime_ns for p in (partial / "train").glob("*.parquet")}
    assert sorted(finished) == ["00000.parquet", "00001.parquet", "00002.parquet"]
    assert not list((partial / "val").glob("*.parquet"))  # the validation split waits for the training files
    assert len(list((out / "dedup").glob("*.npz"))) == 1  # the validation rows' hashes, saved

    monkeypatch.setattr(per_file_mod, "per_file_unit", _recording_tasks(original, second_calls, crash_after=None))
    assert prepare_data.main(["--quiet", "--config", str(config)]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in second_calls.iterdir()) == ["train-00003.parquet"]  # only the missing file
    assert "train: 3/4 per-file shards already written are kept" in printed
    assert "[dedup] validation row hashes read from" in printed
    assert "[dedup] released: 1 validation rows also occur in train, dropped from validation" in printed
    shards = out / "shards"
    for name, mtime in finished.items():
        assert (shards / "train" / name).stat().st_mtime_ns == mtime

    manifest = read_manifest(shards)
    assert manifest["reshard_method"] == {"train": "convert_uint16", "val": "shuffle"}
    assert manifest["val_duplicates"] == {"found": 1, "dropped": 1}
    assert manifest["source_files"] == {"train": [f"train/{i:03d}_00000.parquet" for i in range(4)]}
    assert manifest["rows_per_shard"] == {"train": 30, "val": 10} and manifest["dropped_surplus_rows"] == {
        "train": 0, "val": 3}
    assert {f["path"]: f["hash"] for f in manifest["sources"]["released"]["files"]} == {
        rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}
    for rank in range(4):  # training: byte for byte the per-file shards, each its file's rows in order
        shard = shards / "train" / f"{rank:05d}.parquet"
        assert shard.read_bytes() == (kept / "shards" / "train" / f"{rank:05d}.parquet").read_bytes()
        assert pq.read_table(shard).column(0).to_pylist() == table[f"train/{rank:03d}_00000.parquet"]

    # validation: byte for byte the two-pass shuffle of both splits with the duplicate skipped
    entries = [{"path": str(released / rel), "train_rows": 30 if rel.startswith("train") else 0,
                "val_rows": 0 if rel.startswith("train") else 11, "skip_rows": []} for rel in sorted(files)]
    entries[5].update(val_rows=10, skip_rows=[3])
    assert entries[5]["path"].endswith("val/001_00000.parquet")
    both = tmp_path / "both_shuffled" / "shards"
    build_mod.run_shuffle(entries, SEQ_LEN + 1, both, num_shards=4, seed=manifest["seed"], row_group_size=4,
                          reducer_mib=1024, map_mib=1024, token_dtype="uint16", vocab_size=VOCAB, fingerprint="x",
                          manifest_extra={})
    for rank in range(4):
        assert (shards / "val" / f"{rank:05d}.parquet").read_bytes() == (
            both / "val" / f"{rank:05d}.parquet").read_bytes()
    assert tuple(duplicate) not in _shard_rows(shards, "val")

    # --plan: read from the plan the run cached (no parquet footer read), made again when a file changes; the
    # training split planned per file, the validation split (duplicates dropped) through the shuffle
    footers = []
    real_read_metadata = pq.read_metadata
    monkeypatch.setattr(pq, "read_metadata", lambda *a, **k: footers.append(a[0]) or real_read_metadata(*a, **k))
    capsys.readouterr()
    assert prepare_data.main(["--plan", "--json", "--config", str(config)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [plan["cached"]] == [str(p) for p in (out / "plan").glob("*.json")] and footers == []
    train_bytes = sum(len(data) for rel, data in files.items() if rel.startswith("train"))
    val_bytes = sum(len(data) for rel, data in files.items() if rel.startswith("val"))
    val_map_bytes = 44 * ((SEQ_LEN + 1) * 2 + 8)  # 44 rows in uint16, 8 bytes of position each
    assert plan["reshard_method"] == {"train": "convert_uint16", "val": "shuffle"}
    assert plan["io_bytes"]["dedup"] == {"read": val_bytes, "written": 0}  # train: looked up while converted
    assert plan["io_bytes"]["shards_train"]["read"] == train_bytes
    assert plan["io_bytes"]["shards_val"]["read"] == val_bytes + val_map_bytes
    os.utime(released / "train" / "000_00000.parquet", ns=(1, 10**18))
    assert prepare_data.main(["--plan", "--json", "--config", str(config)]) == 0
    assert json.loads(capsys.readouterr().out)["cached"] is None and len(footers) == 8
