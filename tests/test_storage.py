"""huginn_ray.storage: locations, reads and writes, and the conditional writes, on local paths and on a real S3
server (moto, tests/s3_server.py; one per module)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from huginn_ray import storage
from s3_server import S3Server


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        server.create_bucket("huginn")
        yield server


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
