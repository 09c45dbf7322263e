"""Downloading Hub dataset files: a Ray Data stage over the files' listing, huggingface_hub's transfers, the
project's hash check and provenance.

    driver: list_repo_files per source       its revision resolved to a commit, its files with size and hash
    read_datasource(hub_listing(entries))     one row per file: source, repo, commit, folder, path, size, hashes
      -> map_batches(download_files)          tasks of 0.25 CPU, at most `download.max_in_flight` in flight:
                                              `hf_hub_download` at the commit, then size and hash checked
    driver: iter_rows                         a source's provenance committed when its last file arrives

The read and the download fuse into one task per file (the bytes go from the Hub to the file, never through the
object store); what comes back per file is one small row (path, size, whether it was there already). Ray Data
keeps at most `download.max_in_flight` files in flight across all sources and shows the progress in files.

What huggingface_hub (2.4.0) does, and so what this module does not (tests/test_data_hub_download.py
`test_what_huggingface_hub_retries` pins each line against the local Hub server):
- the listing: `HfApi.dataset_info` sends one request without retries (hf_api.py: `get_session().get`), so the
  listing goes through the library's `http_backoff` instead (429 honouring Retry-After, 408 / 5xx, dropped
  connections; waits of 1, 2, 4, 8 s; at most `download.max_attempts` requests) and its `DatasetInfo`;
- a file's metadata request (HEAD, `get_hf_file_metadata`): 429 (Retry-After + 1 s, not capped) and 408 / 5xx are
  retried 5 times; a dropped connection is not (`_get_metadata_or_catch_error` catches only connect errors and
  timeouts);
- a file's bytes (GET, `http_get`): 408 / 429 are retried 5 times; a dropped connection or a truncated body is
  resumed with a Range request, up to 5 times in a row without progress; a 5xx answer is not retried
  (`retry_on_status_codes=(408, 429)`); the size is checked ("Consistency check failed"), the hash is not; the
  bytes go to a temporary file of a name unique to the process, deleted on failure and moved into place when
  complete (a file in place is whole; a download is not resumed across calls): the temporary file,
  `<local_dir>/.cache/huggingface/download/<hash>.<etag>.<8 hex>.incomplete`, has a name no later call uses, so
  a worker killed in the middle of a file leaves it behind for good; `download_sources` removes a source's
  (`remove_incomplete`) when all of its files are verified. The library's other files there, `<path>.lock` and
  `<path>.metadata`, are one per file, reused by every call (a lock file is not removed on release, nor needed:
  the kernel drops a killed process's lock), and stay;
so `fetch_file` calls `hf_hub_download` again, up to `download.max_attempts` times, for exactly what the library
gives up on: a dropped connection before the metadata answer, a 5xx answer to the GET, and a file whose bytes do
not hash to the Hub's hash (sha256 for LFS files, the git blob sha1 otherwise: the check the library does not
make). An answer a retry cannot change (401, 404, ...) fails at once; the error names the repo, commit and file.

A file's verification is recorded (`.huginn_verified/<path>.json`: size, mtime, hash), so a resumed download
trusts a file whose size and mtime are those recorded for the hash the Hub reports, without reading it again; a
file there without a record is hashed (and recorded) instead of fetched; one that does not match is fetched again.

Killed workers: `execution.rerun_killed` (the files not yet downloaded run again with twice the memory; tasks are
never retried by Ray with the same). The Hub endpoint comes from HF_ENDPOINT (read by huggingface_hub at import)
and is passed to the tasks explicitly; the token comes from HF_TOKEN / the login cache and reaches the tasks as an
argument of the map, never a column of the data or a log line.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import quote

from huginn_ray.data import layout
from huginn_ray.redact import redact_uri
from huginn_ray.data.config import DownloadConfig
from huginn_ray.data.execution import original_error, quiet_remote_args, rerun_killed, unit_reads
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


RETRIED_STATUS = (408, 429, 500, 502, 503, 504)
"""Answers a retry can change: huggingface_hub's own list (utils/_http.py `_DEFAULT_RETRY_ON_STATUS_CODES`)."""


def _failure(what: str, attempts: int, err: BaseException) -> DownloadError:
    return DownloadError(f"{what}: failed after {attempts} attempt(s): {type(err).__name__}: {err}")


def _status(err: BaseException) -> int | None:
    return getattr(getattr(err, "response", None), "status_code", None)


def list_repo_files(repo: str, revision: str, patterns: list[str], endpoint: str, token: str | None,
                    cfg: DownloadConfig) -> tuple[str, list[HubFile]]:
    """Resolve a dataset repo's revision to a commit sha and list the files the patterns select (a source's files,
    an evaluation set's split): the request of `HfApi.dataset_info(files_metadata=True)`, sent through
    huggingface_hub's `http_backoff` (dataset_info itself does not retry)."""
    from huggingface_hub.hf_api import DatasetInfo
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_backoff

    what = f"{repo}@{revision} (listing)"
    url = f"{endpoint}/api/datasets/{repo}/revision/{quote(revision, safe='')}"
    try:
        response = http_backoff("GET", url, headers=build_hf_headers(token=token), params={"blobs": True},
                                max_retries=cfg.max_attempts - 1)
        hf_raise_for_status(response)
    except Exception as err:  # http_backoff gave up after max_attempts requests, or at once on an answer it keeps
        retried = _status(err) in RETRIED_STATUS or _status(err) is None
        raise _failure(what, cfg.max_attempts if retried else 1, err) from None
    info = DatasetInfo(**response.json())
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


GAP_WAIT_MAX_S = 8.0
"""fetch_file's waits between its calls of hf_hub_download: 1, 2, 4, then 8 s (huggingface_hub's own schedule)."""


def fetch_file(repo: str, commit: str, hub_file: HubFile, local_dir: str, endpoint: str, token: str | None,
               cfg: DownloadConfig) -> dict:
    """Make `local_dir/<path>` a verified copy of the Hub file; returns what it did (`skipped`: it was already
    there, `trusted`: by its verification record, without reading it). Called by the stage's tasks and, for an
    evaluation set's few files, on the driver (huginn_ray/data/decontaminate.py)."""
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
    what = f"{repo}@{commit[:12]}: {hub_file.path}"
    for attempt in range(1, cfg.max_attempts + 1):
        # a file in place is whole (the library moves it there complete) but may hold other bytes: removed, so that
        # hf_hub_download fetches it instead of trusting its own record of an earlier download
        target.unlink(missing_ok=True)
        try:
            hf_hub_download(repo, hub_file.path, repo_type="dataset", revision=commit, local_dir=local_dir,
                            endpoint=endpoint, token=token)
            if verify(target, hub_file):
                record_verified(folder, hub_file)
                return {"path": hub_file.path, "size": hub_file.size, "skipped": False, "trusted": False}
            err: BaseException = OSError(f"{hub_file.path}: size or hash differs from what the Hub reports")
        except Exception as failed:  # what huggingface_hub gave up on (module docstring) is retried below
            if _status(failed) not in (None, *RETRIED_STATUS):
                raise _failure(what, attempt, failed) from None
            err = failed
        if attempt < cfg.max_attempts:
            time.sleep(min(GAP_WAIT_MAX_S, 2.0 ** (attempt - 1)))
    target.unlink(missing_ok=True)
    raise _failure(what, cfg.max_attempts, err)


LIBRARY_DOWNLOAD_DIR = Path(".cache", "huggingface", "download")
"""Where huggingface_hub keeps its per-file metadata, locks and temporary `.incomplete` files under a local_dir."""


def remove_incomplete(local_dir: Path) -> int:
    """Delete the temporary files of huggingface_hub's downloads into `local_dir` that killed workers left
    (`*.incomplete`; the library deletes its own on any error it sees); returns how many. Called once every file
    of the folder is verified: no call downloads into it then, and no call would ever read them."""
    stale = list((local_dir / LIBRARY_DOWNLOAD_DIR).rglob("*.incomplete"))
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def check_inside(local_dir: Path, name: str, repo: str) -> None:
    """Refuse a Hub file name that would be written outside `local_dir` (absolute, '..', backslashes)."""
    pure = PurePosixPath(name)
    root = local_dir.resolve()
    bad = (not name or pure.is_absolute() or ".." in pure.parts or "\\" in name or ":" in pure.parts[0]
           or not (root / name).resolve().is_relative_to(root))
    if bad:
        raise DownloadError(f"{repo}: the Hub lists a file named {name!r}, which would resolve outside {local_dir}: "
                            "refused (nothing of this source was downloaded)")


def _listing_block(entry: dict) -> list:
    import pyarrow as pa

    return [pa.Table.from_pylist([entry])]


def hub_listing(entries: list[dict]):
    """The stage's read: a Ray Data datasource of the listed files, one read task and one block per file (so that
    each file is downloaded by its own task, as many at once as the map allows)."""
    return unit_reads("hub_listing", entries, _listing_block, rows=lambda entry: 1)


def download_files(table, *, endpoint: str, token: str | None, cfg: DownloadConfig):
    """The stage's map: each row's file fetched and verified (fetch_file); one result row per file."""
    import pyarrow as pa

    results = []
    for row in table.to_pylist():
        hub_file = HubFile(row["path"], row["size"], row["sha256"], row["git_sha1"])
        done = fetch_file(row["repo"], row["commit"], hub_file, row["folder"], endpoint, token, cfg)
        results.append({"source": row["source"], **done})
    return pa.Table.from_pylist(results)


def download_dataset(entries: list[dict], memory: int | None, *, endpoint: str, token: str | None,
                     cfg: DownloadConfig):
    """The stage's dataset for `entries` (files), whose tasks declare `memory`: read -> download, fused into one
    task per file (the same task pool size and remote args on both: Ray Data fuses only then)."""
    import ray.data

    per_task = {"num_cpus": 0.25, "memory": memory}
    with quiet_remote_args():
        return ray.data.read_datasource(hub_listing(entries), override_num_blocks=len(entries),
                                        concurrency=cfg.max_in_flight, ray_remote_args={"max_retries": 0},
                                        **per_task).map_batches(
            download_files, fn_kwargs={"endpoint": endpoint, "token": token, "cfg": cfg}, batch_size=None,
            batch_format="pyarrow", compute=ray.data.TaskPoolStrategy(size=cfg.max_in_flight), max_retries=0,
            **per_task)


def download_sources(sources: list[Source], download_root: Path, cfg: DownloadConfig) -> dict[str, dict]:
    """Fetch Hub sources into `download_root/<name>`, all at once: one dataset of files across sources and at most
    `download.max_in_flight` downloads in flight in total. Sources whose provenance matches are skipped; a
    source's provenance is written when all of its files are verified. Returns {name: provenance}."""
    from huggingface_hub import constants, get_token

    endpoint, token = constants.ENDPOINT, get_token()
    provenance: dict[str, dict] = {}
    listed: dict[str, tuple[Source, dict, str, list[HubFile]]] = {}
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
        listed[source.name] = (source, request, commit, files)

    entries = [{"source": source.name, "repo": source.address, "commit": commit,
                "folder": str(download_root / source.name), **asdict(f)}
               for source, _, commit, files in listed.values() for f in files]
    for name in listed:
        (download_root / name).mkdir(parents=True, exist_ok=True)
    remaining = {name: len(files) for name, (_, _, _, files) in listed.items()}
    results: dict[tuple[str, str], dict] = {}

    def run(todo: list[int], declared: list[int | None]) -> None:
        classes: dict[int | None, list[dict]] = {}
        for i in todo:
            classes.setdefault(declared[i], []).append(entries[i])
        for memory, members in classes.items():
            for row in download_dataset(members, memory, endpoint=endpoint, token=token, cfg=cfg).iter_rows():
                results[(row["source"], row["path"])] = row
                remaining[row["source"]] -= 1
                if remaining[row["source"]] == 0:  # a source's provenance as soon as all of its files are verified
                    removed = remove_incomplete(download_root / row["source"])
                    if removed:
                        print(f"[download] {row['source']}: removed {removed} temporary file(s) of downloads "
                              "interrupted by a killed worker", flush=True)
                    provenance[row["source"]] = commit_provenance(download_root, endpoint, *listed[row["source"]])

    try:  # tasks declare no memory until a worker is killed (rerun_killed then doubles execution.UNDECLARED_MEMORY)
        rerun_killed(run, [None] * len(entries), name="download",
                     unfinished=lambda todo: [i for i in todo
                                              if (entries[i]["source"], entries[i]["path"]) not in results])
    except Exception as err:  # the task's DownloadError names the file; anything else becomes one
        cause = original_error(err, (DownloadError,))
        raise (cause if isinstance(cause, DownloadError) else DownloadError(str(err))) from None
    if results:
        done = list(results.values())
        print(f"[download] {len(done)} files of {len(listed)} source(s), "
              f"{sum(e['size'] for e in entries) / 2**20:.1f} MiB ({sum(r['skipped'] for r in done)} already "
              f"complete, {sum(r['trusted'] for r in done)} of them by their verification record)", flush=True)
    return provenance


def commit_provenance(download_root: Path, endpoint: str, source: Source, request: dict, commit: str,
                      files: list[HubFile]) -> dict:
    """Write a source's provenance (what was asked, the commit it resolved to, every file's size and hash) once all
    of its files are verified; its presence marks the source complete."""
    record = {"source": source.name, "request": request, "endpoint": redact_uri(endpoint), "commit": commit,
              "files": [asdict(f) for f in files]}
    layout.write_json(download_root / source.name / PROVENANCE, record)
    print(f"[download] {source.name}: {len(files)} files verified at {commit[:12]}", flush=True)
    return record


def downloaded_files(download_root: Path, provenance: dict) -> list[Path]:
    return [download_root / provenance["source"] / f["path"] for f in provenance["files"]]
