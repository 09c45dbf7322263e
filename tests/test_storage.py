"""huginn_ray.storage: locations, reads and writes, and the conditional writes, on local paths and on a real S3
server (moto, tests/s3_server.py; one per module)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from huginn_ray import storage
from s3_server import s3_fixture


s3 = s3_fixture("huginn")


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> str:
    """A directory to work in: a local one, or a prefix of the moto server's bucket."""
    if request.param == "local":
        return str(tmp_path)
    request.getfixturevalue("s3")
    return f"s3://huginn/{request.node.name.replace('[', '-').rstrip(']')}"


def test_locations_keep_uris_and_resolve_local_paths(tmp_path):
    assert storage.resolve_location("s3://bucket/runs", tmp_path) == "s3://bucket/runs"
    assert storage.resolve_location("gs://bucket/x", tmp_path) == "gs://bucket/x"
    assert storage.resolve_location(f"file://{tmp_path}/a%20b", "/elsewhere") == str(tmp_path / "a b")
    assert storage.resolve_location("runs", tmp_path) == str(tmp_path.resolve() / "runs")
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    assert storage.resolve_location("link", tmp_path) == str((tmp_path / "target").resolve())
    assert storage.resolve_location("link", tmp_path, follow_links=False) == str(tmp_path / "link")
    assert storage.join("s3://bucket/runs/", "run1", "STOP") == "s3://bucket/runs/run1/STOP"
    assert storage.join("/a/b", "c") == "/a/b/c"
    assert storage.is_uri("s3://b") and not storage.is_uri("/tmp/s3:/b") and not storage.is_uri("runs")
    with pytest.raises(storage.StorageError, match=r"ftp://host/x: unknown scheme ftp://"):
        storage.resolve_location("ftp://host/x", tmp_path)


def test_read_write_list_delete(root):
    a, b = storage.join(root, "dir", "a.bin"), storage.join(root, "dir", "sub", "b.txt")
    assert not storage.exists(a) and storage.list_prefix(storage.join(root, "dir")) == []
    storage.write_bytes(a, b"\x00\x01")
    storage.write_text(b, "hello")
    assert storage.read_bytes(a) == b"\x00\x01" and storage.read_text(b) == "hello"
    assert storage.size(b) == 5 and storage.exists(a)
    assert storage.list_prefix(storage.join(root, "dir")) == [a, b]
    storage.write_bytes(a, b"new")  # a whole replacement
    assert storage.read_bytes(a) == b"new"
    storage.delete(a)
    storage.delete(a)  # missing is fine
    assert not storage.exists(a)
    with pytest.raises(FileNotFoundError, match="a.bin"):
        storage.read_bytes(a)
    with pytest.raises(FileNotFoundError, match="a.bin"):
        storage.delete(a, missing_ok=False)
    if not storage.is_uri(root):  # a local write leaves no temporary file
        assert sorted(p.name for p in Path(root, "dir").iterdir()) == ["sub"]


def test_uploads_downloads_and_ranged_reads(root, tmp_path):
    local = tmp_path / "src"
    (local / "sub").mkdir(parents=True)
    (local / "a.bin").write_bytes(bytes(range(256)) * 4)
    (local / "sub" / "MARKER").write_text("done")
    target = storage.join(root, "copy")
    assert storage.upload_dir(local, target, last="sub/MARKER") == ["a.bin", "sub/MARKER"]
    assert storage.list_prefix(target) == [storage.join(target, "a.bin"), storage.join(target, "sub", "MARKER")]
    with storage.open_input_file(storage.join(target, "a.bin")) as f:
        assert f.size() == 1024 and f.read_at(3, 254) == bytes([254, 255, 0])
    storage.download_file(storage.join(target, "sub", "MARKER"), tmp_path / "back" / "MARKER")
    assert (tmp_path / "back" / "MARKER").read_text() == "done"
    with pytest.raises(FileNotFoundError, match="nothing.bin"):
        storage.open_input_file(storage.join(root, "nothing.bin"))
    with pytest.raises(FileNotFoundError, match="nothing.bin"):
        storage.download_file(storage.join(root, "nothing.bin"), tmp_path / "x")
    assert not (tmp_path / "x").exists() and sorted(p.name for p in tmp_path.iterdir()) == sorted(["back", "src"] + (
        [] if storage.is_uri(root) else ["copy"]))


def test_conditional_writes(root):
    lock = storage.join(root, "LOCK")
    assert storage.create_if_absent(lock, b"first")
    assert not storage.create_if_absent(lock, b"second")
    data, version = storage.read_versioned(lock)
    assert data == b"first"
    assert storage.replace_if_version(lock, b"replaced", version)
    assert not storage.replace_if_version(lock, b"late", version)  # the version it was read at is gone
    assert storage.read_versioned(lock)[0] == b"replaced"
    storage.delete(lock)
    assert not storage.replace_if_version(lock, b"gone", version)
    with pytest.raises(FileNotFoundError, match="LOCK"):
        storage.read_versioned(lock)


def test_racing_creates_and_replaces_have_one_winner(root):
    """Eight threads create the same object, then eight replace it from the same version: one wins each time."""
    lock = storage.join(root, "race")
    barrier, won = threading.Barrier(8), []

    def create(i):
        barrier.wait()
        won.append(storage.create_if_absent(lock, f"{i}".encode()))

    def replace(i, version):
        barrier.wait()
        won.append(storage.replace_if_version(lock, f"r{i}".encode(), version))

    for target, extra in ((create, ()), (replace, None)):
        if extra is None:
            extra = (storage.read_versioned(lock)[1],)
        won.clear()
        threads = [threading.Thread(target=target, args=(i, *extra)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(won) == [False] * 7 + [True]


def test_a_missing_bucket_and_missing_credentials_are_named(s3, monkeypatch):
    storage.check_location("s3://huginn/runs", "out_dir")
    with pytest.raises(storage.StorageError, match=r"out_dir: s3://no-such-bucket/runs: bucket no-such-bucket does "
                                                   r"not exist"):
        storage.check_location("s3://no-such-bucket/runs", "out_dir")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    storage._s3_client.cache_clear()
    try:
        with pytest.raises(storage.StorageError, match=r"out_dir: s3://huginn/runs: no credentials"):
            storage.check_location("s3://huginn/runs", "out_dir")
    finally:
        storage._s3_client.cache_clear()
    with pytest.raises(storage.StorageError, match="not supported on gs://"):
        storage.create_if_absent("gs://bucket/LOCK", b"")


# --- the run lock and run control on a bucket ------------------------------------------------------------------

def _lock_script(location: str) -> str:
    return f"""
import sys, time
from huginn_ray.train.runlock import RunLock, RunLockError
lock = RunLock({location!r})
print("ready", flush=True)
sys.stdin.readline()  # both go at the same moment, past their imports
try:
    lock.acquire()
    print("won", flush=True)
    time.sleep(1)
    lock.release()
except RunLockError as err:
    print("refused", err, flush=True)
"""


def test_two_jobs_starting_on_the_same_bucket_run_directory_one_wins(s3):
    import subprocess
    import sys

    run = "s3://huginn/runs/race"
    jobs = [subprocess.Popen([sys.executable, "-c", _lock_script(run)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True) for _ in range(2)]
    assert [job.stdout.readline() for job in jobs] == ["ready\n"] * 2
    for job in jobs:
        job.stdin.write("go\n")
        job.stdin.flush()
    outs = sorted(job.communicate(timeout=60)[0] for job in jobs)
    assert outs[1] == "won\n", outs
    assert outs[0].startswith(f"refused another job is writing run directory {run} "), outs
    assert not storage.exists(f"{run}/LOCK")  # the winner released it


def test_a_stale_bucket_lock_is_taken_over(s3):
    import json
    import socket
    import subprocess

    from huginn_ray.train.runlock import RunLock, RunLockError

    dead = subprocess.Popen(["true"])
    dead.wait()
    run = "s3://huginn/runs/stale"
    storage.write_text(f"{run}/LOCK", json.dumps({"host": socket.gethostname(), "pid": dead.pid, "start": "1",
                                                  "since": "2026-01-01T00:00:00Z"}))
    lock = RunLock(run)
    assert f"took over the stale lock {run}/LOCK" in lock.acquire()  # a dead PID on this host: at once
    assert json.loads(storage.read_text(f"{run}/LOCK"))["pid"] == os.getpid()
    lock.release()
    assert not storage.exists(f"{run}/LOCK")

    storage.write_text(f"{run}/LOCK", json.dumps({"host": "other-node-17", "pid": 1, "since": "2026-01-01T00:00:00Z"}))
    with pytest.raises(RunLockError, match=rf"other-node-17.*delete {run}/LOCK"):
        RunLock(run, stale_s=2).acquire()
    import time

    time.sleep(2.2)  # Last-Modified has whole seconds, rounded down: the heartbeat looks 2.2 s old or older
    lock = RunLock(run, stale_s=2)
    assert "took over the stale lock" in lock.acquire()
    lock.release()


def test_the_holder_of_a_bucket_lock_keeps_its_heartbeat(s3):
    import time

    from huginn_ray.train.runlock import RunLock

    lock = RunLock("s3://huginn/runs/beat", heartbeat_s=0.2)
    lock.acquire()
    first = storage.read_versioned(lock.location)
    time.sleep(1.0)
    later = storage.read_versioned(lock.location)
    assert later[1] != first[1] and b'"beat": 1' in first[0] and b'"beat": 1' not in later[0]
    lock.release()


def test_a_stop_request_in_a_bucket_run_directory_is_seen(s3, monkeypatch):
    from huginn_ray.train import stopping
    from huginn_ray.train.config import TrainConfig

    monkeypatch.delenv(stopping.STOP_FILE_ENV, raising=False)
    cfg = TrainConfig(out_dir="s3://huginn/runs", run_name="stopped")
    assert not stopping.stop_requested(cfg)
    assert stopping.request_stop(cfg) == "s3://huginn/runs/stopped/STOP"
    assert stopping.stop_requested(cfg)
    stopping.clear_stop_requests(cfg)
    assert not stopping.stop_requested(cfg) and stopping.stop_reason(cfg) is None
    stopping.write_stop_reason(cfg, stopping.Stop("rank 1 cannot read its data", reporter=True))
    assert stopping.stop_reason(cfg) == "rank 1 cannot read its data"
    assert cfg.run_dir == "s3://huginn/runs/stopped"


# --- config loaders ----------------------------------------------------------------------------------------------

def test_the_train_config_keeps_uris_and_refuses_the_fields_that_need_local_files(tmp_path, monkeypatch):
    from huginn_ray.config import ConfigError
    from huginn_ray.train.config import load_train_config

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = str(Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny_cpu.yaml")
    cfg = load_train_config(config, ["out_dir=runs", "data.data_dir=data", "data.tokenizer_path=tok"])
    assert (cfg.out_dir, cfg.data.data_dir) == (str(tmp_path.resolve() / "runs"), str(tmp_path / "data"))
    assert cfg.run_dir == str(tmp_path.resolve() / "runs" / cfg.run_name)
    with pytest.raises(ConfigError, match=r"mlflow.tracking_uri: must be given with out_dir in object storage "
                                          r"\(s3://b/runs\)"):
        load_train_config(config, ["out_dir=s3://b/runs"])
    cfg = load_train_config(config, ["out_dir=s3://b/runs", "mlflow.tracking_uri=http://127.0.0.1:1"])
    assert cfg.run_dir == f"s3://b/runs/{cfg.run_name}"
    with pytest.raises(ConfigError, match="hdfs://b/x: unknown scheme hdfs://"):
        load_train_config(config, ["out_dir=hdfs://b/x"])
    assert load_train_config(config, [f"out_dir=file://{tmp_path}/f"]).out_dir == str(tmp_path.resolve() / "f")


def test_the_train_job_refuses_a_bucket_out_dir_without_mlflow_before_anything_starts(monkeypatch, capsys):
    import sys

    import ray

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))
    import train as train_job

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = str(Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny_cpu.yaml")
    assert train_job.main(["--config", config, "out_dir=s3://huginn/runs"]) == 2
    assert "error: mlflow.tracking_uri: must be given with out_dir in object storage" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_the_data_config_keeps_uris_and_refuses_them_by_name(tmp_path):
    from huginn_ray.config import ConfigError
    from huginn_ray.data.config import load_data_config
    from huginn_ray.data.sources import parse_sources

    (tmp_path / "sources.yaml").write_text("- {name: a, local_dir: a}\n")
    (tmp_path / "data.yaml").write_text("output_dir: out\nsources: sources.yaml\n")
    cfg = load_data_config(tmp_path / "data.yaml", ["output_dir=s3://b/out", f"scratch_dir={tmp_path}/scratch"])
    assert (cfg.output_dir, cfg.root, cfg.in_bucket) == ("s3://b/out", tmp_path / "scratch", True)
    cfg = load_data_config(tmp_path / "data.yaml", [f"output_dir={tmp_path}/out", "tokenizer.path=s3://b/tok",
                                                    "sources=s3://b/sources.yaml"])
    assert (cfg.tokenizer.path, cfg.sources, cfg.tokenizer_dir) == ("s3://b/tok", "s3://b/sources.yaml",
                                                                    tmp_path / "out" / "mirror" / ".tokenizer")
    assert parse_sources([{"name": "a", "local_dir": "s3://b/a", "features": ["text"]}], "sources.yaml",
                         tmp_path)[0].local_dir == "s3://b/a"
    with pytest.raises(ConfigError, match="^sources.yaml: source 'a': local_dir: ftp://b/a: unknown scheme ftp://"):
        parse_sources([{"name": "a", "local_dir": "ftp://b/a", "features": ["text"]}], "sources.yaml", tmp_path)
    with pytest.raises(ConfigError, match="scratch_dir: s3://b/s — must be a local directory"):
        load_data_config(tmp_path / "data.yaml", ["output_dir=s3://b/out", "scratch_dir=s3://b/s"])


def test_train_tokenizer_refuses_a_tokenizer_path_in_a_bucket_before_anything_starts(tmp_path, capsys):
    import importlib.util

    (tmp_path / "data.yaml").write_text(f"output_dir: {tmp_path}/out\nsources: sources.yaml\n")
    spec = importlib.util.spec_from_file_location("train_tokenizer_job", Path(__file__).resolve().parents[1] /
                                                  "jobs" / "train_tokenizer.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    assert job.main(["--config", str(tmp_path / "data.yaml"), "tokenizer.path=s3://b/tok"]) == 2
    assert "config error: tokenizer.path: s3://b/tok is in object storage, where a tokenizer is read, not trained" \
        in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
