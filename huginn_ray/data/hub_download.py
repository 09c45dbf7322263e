"""Downloading Hub dataset files: parallel tasks on Ray Data, retries, verification, provenance.

The driver resolves the requested revision to a commit and lists the repo's files with their sizes and hashes
(`dataset_info(files_metadata=True)`), then maps the files with the Ray Data operator `download`
(huginn_ray/data/execution.py: one task per file, at most `download.max_in_flight` at a time). A task calls
`hf_hub_download` for that commit and verifies the result against the Hub's size and hash (sha256 for LFS files,
the git blob sha1 otherwise). Transient failures (429 honouring Retry-After, 5xx, 408,
dropped connections, truncated bodies, hash mismatches) are retried with exponential backoff and full jitter;
a file still failing after `download.max_attempts` fails the run with its name. Files already present and
verified are skipped; a partial file is resumed or refetched (a mismatching one is deleted first). A file's
verification is recorded (`.huginn_verified/<path>.json`: size, mtime, hash), so a resumed download trusts a file
whose size and mtime are those recorded for the hash the Hub reports, without reading it again.

The Hub endpoint comes from HF_ENDPOINT (read by huggingface_hub at import) and is passed to the tasks
explicitly; the token comes from HF_TOKEN / the login cache and is passed as a task argument, never logged.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

from huginn_ray.data import layout
from huginn_ray.redact import redact_uri
from huginn_ray.data.config import DownloadConfig
from huginn_ray.data.execution import original_error, run_tasks
from huginn_ray.data.sources import Source

PROVENANCE = "_provenance.json"


class DownloadError(RuntimeError):
    """A Hub file or listing that could not be fetched; the message names the repo and file."""


@dataclass
class HubFile:
    path: str
    size: int
    sha256: str | None
    git_sha1: str | None


def retry_delay(err: BaseException, attempt: int, cfg: DownloadConfig) -> float | None:
    """Seconds to wait before retrying after `err`, or None if retrying cannot help (404, 401, ...)."""
    response = getattr(err, "response", None)
    status = getattr(response, "status_code", None)
    backoff = random.uniform(0, min(cfg.backoff_max_s, cfg.backoff_base_s * 2**attempt))
    if status is not None:
        if status == 429:
            retry_after = (response.headers or {}).get("Retry-After", "")
            if retry_after.strip().isdigit():  # capped: a server asking for hours must not park the run
                return min(float(retry_after), cfg.retry_after_max_s) + random.uniform(0, cfg.backoff_base_s)
            return backoff
        if status >= 500 or status == 408:
            return backoff
        return None
    return backoff  # dropped connections, timeouts, truncated bodies, hash mismatches


def with_retries(what: str, cfg: DownloadConfig, fn):
    """Call fn() until it succeeds, retrying transient errors; the final error names `what`."""
    last: BaseException | None = None
    for attempt in range(cfg.max_attempts):
        try:
            return fn()
        except Exception as err:  # classified below; anything else is retried as transient
            last = err
            delay = retry_delay(err, attempt, cfg)
            if delay is None:
                break
            if attempt + 1 < cfg.max_attempts:
                time.sleep(delay)
    raise DownloadError(f"{what}: failed after {attempt + 1} attempt(s): {type(last).__name__}: {last}")


def list_repo_files(repo: str, revision: str, patterns: list[str], endpoint: str, token: str | None,
                    cfg: DownloadConfig) -> tuple[str, list[HubFile]]:
    """Resolve a dataset repo's revision to a commit sha and list the files the patterns select (a source's files,
    an evaluation set's split)."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint)
    info = with_retries(
        f"{repo}@{revision} (listing)", cfg,
        lambda: api.dataset_info(repo, revision=revision, files_metadata=True, token=token),
    )
    files = []
    for sibling in info.siblings or []:
        if not any(fnmatch.fnmatch(sibling.rfilename, p) for p in patterns):
            continue
        if sibling.size is None:
            raise DownloadError(f"{repo}: the Hub reported no size for {sibling.rfilename}")
        files.append(HubFile(sibling.rfilename, int(sibling.size),
                             sibling.lfs.sha256 if sibling.lfs else None, sibling.blob_id))
    return info.sha, sorted(files, key=lambda f: f.path)


def verify(path: Path, expected: HubFile) -> bool:
    """Size first (cheap), then the hash the Hub reports."""
    if not path.is_file() or path.stat().st_size != expected.size:
        return False
    if expected.sha256:
        digest = hashlib.sha256()
    elif expected.git_sha1:
        digest = hashlib.sha1(f"blob {expected.size}\0".encode())
    else:
        return True
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest() == (expected.sha256 or expected.git_sha1)


VERIFIED = ".huginn_verified"
"""Under a source's download folder: one record per verified file, `<path>.json` = the size, mtime and hash it had
when its hash was checked."""


def _record_path(local_dir: Path, path: str) -> Path:
    return local_dir / VERIFIED / f"{path}.json"


def _verification(target: Path, expected: HubFile) -> dict:
    stat = target.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "hash": expected.sha256 or expected.git_sha1}


def verified_before(local_dir: Path, expected: HubFile) -> bool:
    """Whether `expected`'s file was verified by an earlier task and has not changed since: its record holds the
    hash the Hub reports now and the file's present size and mtime. Such a file is trusted without reading it (a
    resumed download of thousands of large files does not hash them all again); a change of size or mtime, or
    another hash on the Hub, sends it back to `verify`."""
    target = local_dir / expected.path
    try:
        record = json.loads(_record_path(local_dir, expected.path).read_text())
    except (OSError, ValueError):
        return False
    return target.is_file() and target.stat().st_size == expected.size and record == _verification(target, expected)


def record_verified(local_dir: Path, expected: HubFile) -> None:
    record = _record_path(local_dir, expected.path)
    record.parent.mkdir(parents=True, exist_ok=True)
    layout.write_json(record, _verification(local_dir / expected.path, expected))


def fetch_file(repo: str, commit: str, hub_file: HubFile, local_dir: str, endpoint: str, token: str | None,
               cfg: DownloadConfig) -> dict:
    """Ray task: make `local_dir/<path>` a verified copy of the Hub file; returns what it did (`skipped`: it was
    already there, `trusted`: by its verification record, without reading it)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    folder = Path(local_dir)
    target = folder / hub_file.path
    if verified_before(folder, hub_file):
        return {"path": hub_file.path, "size": hub_file.size, "skipped": True, "trusted": True}
    if verify(target, hub_file):
        record_verified(folder, hub_file)
        return {"path": hub_file.path, "size": hub_file.size, "skipped": True, "trusted": False}
    target.unlink(missing_ok=True)

    def attempt() -> None:
        hf_hub_download(repo, hub_file.path, repo_type="dataset", revision=commit, local_dir=local_dir,
                        endpoint=endpoint, token=token)
        if not verify(target, hub_file):
            target.unlink(missing_ok=True)
            _forget_partial(folder, hub_file.path)
            raise OSError(f"{hub_file.path}: size or hash differs from what the Hub reports")

    with_retries(f"{repo}@{commit[:12]}: {hub_file.path}", cfg, attempt)
    record_verified(folder, hub_file)
    return {"path": hub_file.path, "size": hub_file.size, "skipped": False, "trusted": False}


def _forget_partial(local_dir: Path, path: str) -> None:
    """Drop huggingface_hub's resume state for a file whose content turned out wrong."""
    cache = local_dir / ".cache" / "huggingface" / "download"
    for leftover in cache.glob(f"{path}*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def check_inside(local_dir: Path, name: str, repo: str) -> None:
    """Refuse a Hub file name that would be written outside `local_dir` (absolute, '..', backslashes)."""
    pure = PurePosixPath(name)
    root = local_dir.resolve()
    bad = (not name or pure.is_absolute() or ".." in pure.parts or "\\" in name or ":" in pure.parts[0]
           or not (root / name).resolve().is_relative_to(root))
    if bad:
        raise DownloadError(f"{repo}: the Hub lists a file named {name!r}, which would resolve outside {local_dir}: "
                            "refused (nothing of this source was downloaded)")


def download_sources(sources: list[Source], download_root: Path, cfg: DownloadConfig) -> dict[str, dict]:
    """Fetch Hub sources into `download_root/<name>`, all at once: one dataset of files across sources and at most
    `download.max_in_flight` downloads in flight in total. Sources whose provenance matches are skipped; a
    source's provenance is written when all of its files are verified. Returns {name: provenance}."""
    from huggingface_hub import constants, get_token

    endpoint, token = constants.ENDPOINT, get_token()
    provenance: dict[str, dict] = {}
    listed = []
    for source in sources:
        local_dir = download_root / source.name
        request = {"address": source.address, "revision": source.revision, "patterns": source.file_patterns}
        previous = layout.read_marker(local_dir, PROVENANCE)
        if previous is not None and previous.get("request") == request:
            print(f"[download] {source.name}: complete at {previous['commit'][:12]}, skipped", flush=True)
            provenance[source.name] = previous
            continue
        commit, files = list_repo_files(source.address, source.revision, source.file_patterns, endpoint, token,
                                        cfg)
        for f in files:  # every name checked before anything of this source is written
            check_inside(local_dir, f.path, source.address)
        if not files:
            raise DownloadError(f"source {source.name!r}: no file of {source.address}@{commit[:12]} matches "
                                f"{source.file_patterns}")
        listed.append((source, request, commit, files))

    remaining = [len(files) for _, _, _, files in listed]
    total_bytes = sum(f.size for _, _, _, files in listed for f in files)

    def finish(i: int) -> None:
        source, request, commit, files = listed[i]
        record = {"source": source.name, "request": request, "endpoint": redact_uri(endpoint), "commit": commit,
                  "files": [asdict(f) for f in files]}
        layout.write_json(download_root / source.name / PROVENANCE, record)
        provenance[source.name] = record
        print(f"[download] {source.name}: {len(files)} files verified at {commit[:12]}", flush=True)

    calls, owner = [], []
    for i, (source, _, commit, files) in enumerate(listed):
        (download_root / source.name).mkdir(parents=True, exist_ok=True)
        for hub_file in files:
            calls.append((source.address, commit, hub_file, str(download_root / source.name), endpoint, token, cfg))
            owner.append(i)

    def done(call: int, result: dict) -> None:
        i = owner[call]
        remaining[i] -= 1
        if remaining[i] == 0:  # a source's provenance is written as soon as all of its files are verified
            finish(i)

    try:
        results = run_tasks(fetch_file, calls, name="download", num_cpus=0.25, max_concurrent=cfg.max_in_flight,
                            on_result=done)
    except Exception as err:  # the task's DownloadError names the file; anything else becomes one
        cause = original_error(err, (DownloadError,))
        raise (cause if isinstance(cause, DownloadError) else DownloadError(str(err))) from None
    if results:
        print(f"[download] {len(results)} files of {len(listed)} source(s), {total_bytes / 2**20:.1f} MiB "
              f"({sum(r['skipped'] for r in results)} already complete, {sum(r['trusted'] for r in results)} of "
              "them by their verification record)", flush=True)
    return provenance


def downloaded_files(download_root: Path, provenance: dict) -> list[Path]:
    return [download_root / provenance["source"] / f["path"] for f in provenance["files"]]
