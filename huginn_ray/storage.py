"""Where runs, data and models live: a location is a `str`, a local path or a URI (`s3://`, `gs://`, `file://`).

    location = resolve_location("s3://bucket/runs", base_dir=os.getcwd())   # kept as it is
    write_bytes(join(location, "run1", "STOP"), b"")
    exists(join(location, "run1", "STOP"))                                   # True

Reads, writes, listings and deletes go through `pyarrow.fs` (`FileSystem.from_uri`; S3's endpoint, region and
credentials come from the environment as AWS's own tools read them: `AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3`,
passed to Arrow as `endpoint_override`), `AWS_DEFAULT_REGION`, `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` or the
instance's role). A local write goes to a temporary file that
`os.replace` puts in place; an object-store write is one PUT. Either way a reader sees the old bytes or the new
ones, never a mix.

Conditional writes, which pyarrow lacks, are what a lock or a pointer needs instead of renames:
- `create_if_absent(location, data)`: S3 `PutObject` with `If-None-Match: *`; local: the bytes written to a
  temporary file that `os.link` names (fails if the name exists, so a reader never sees a half-written file).
- `read_versioned(location) -> (bytes, version)` and `replace_if_version(location, data, version)`: S3 `If-Match`
  on the ETag; local: a compare-and-swap under `fcntl.flock` on the file's directory (atomic against other
  processes on the same file system; on Lustre that needs the `flock` mount option), the version being the file's
  inode, modification time in ns and size (a replace writes a new inode). An S3 ETag is the MD5 of the bytes
  (single-part PUT), so a replace with the very same bytes keeps the version: writers that need every write to
  be a new version (the run lock's heartbeat) change the bytes each time.
The conditional writes use boto3 on `s3://`; on `gs://` they raise `StorageError` (not supported yet).

Transfers: `upload_file`, `download_file` (put in place by `os.replace`) and `upload_dir` (a named marker last,
so a reader that waits for it sees a whole directory) stream through `pyarrow.fs.copy_files`; `open_input_file`
reads ranges (a parquet footer, a row group, a checkpoint's piece) without fetching the rest.

Bad input (an unknown scheme, a bucket that does not exist, missing credentials) raises `StorageError` naming the
location: `check_location` makes the bucket and credential checks once, before a job's work starts.
"""

from __future__ import annotations

import fcntl
import functools
import os
import re
import tempfile
import urllib.parse
from pathlib import Path

import pyarrow.fs as pafs

SCHEMES = ("s3", "gs", "file")
"""The URI schemes a location may have; any other `scheme://` is refused by name."""

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class StorageError(ValueError):
    """A location that cannot be used (unknown scheme, no such bucket, no credentials), named in the message."""


def is_uri(location: str) -> bool:
    """True for `scheme://...` (any scheme: `resolve_location` refuses the unknown ones), False for a local path."""
    return bool(_SCHEME.match(str(location)))


def _scheme(location: str) -> str:
    scheme = _SCHEME.match(location).group(1).lower()
    if scheme not in SCHEMES:
        raise StorageError(f"{location}: unknown scheme {scheme}:// (a location is a local path or one of "
                           f"{', '.join(s + '://' for s in SCHEMES)})")
    return scheme


def resolve_location(value: str, base_dir: str | Path, follow_links: bool = True) -> str:
    """A URI kept as it is (`file://x` becomes the local absolute path x); a local path made absolute against
    `base_dir`, its symlinks resolved unless `follow_links` is False (a pointer kept as a pointer)."""
    value = str(value)
    if is_uri(value):
        if _scheme(value) != "file":
            return value
        value = urllib.parse.unquote(urllib.parse.urlparse(value).path)
    path = Path(value) if Path(value).is_absolute() else Path(base_dir) / value
    return str(path.resolve()) if follow_links else os.path.abspath(path)


def join(location: str, *parts: str) -> str:
    """`location/part/...`: a URI joined with '/', a local path with the OS's separator."""
    if is_uri(location):
        return "/".join([location.rstrip("/"), *(part.strip("/") for part in parts)])
    return os.path.join(location, *parts)


def local_path(location: str) -> Path:
    """The local `Path` of a location; StorageError for a bucket URI (for code that still needs a POSIX path)."""
    if is_uri(location) and _scheme(location) != "file":
        raise StorageError(f"{location}: a local path is needed here, not object storage")
    return Path(resolve_location(location, os.getcwd(), follow_links=False))


def filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    """(pyarrow file system, path in it) of a location: what `pyarrow.parquet`, Ray Data and Ray Train's
    `storage_filesystem` take. A bucket's path is `bucket/key`."""
    if not is_uri(location) or _scheme(location) == "file":
        return pafs.LocalFileSystem(), str(local_path(location))
    scheme, rest = location.split("://", 1)
    return _bucket_filesystem(scheme.lower(), rest.split("/", 1)[0], _endpoint()), rest.rstrip("/")


def _endpoint() -> str | None:
    """S3's endpoint as AWS's tools read it (pyarrow reads the same variable; part of the cache key)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


@functools.lru_cache(maxsize=32)
def _bucket_filesystem(scheme: str, bucket: str, endpoint: str | None) -> pafs.FileSystem:
    if scheme == "s3" and endpoint:  # given explicitly: older pyarrow and AWS_ENDPOINT_URL_S3 are not read by Arrow
        return pafs.S3FileSystem(endpoint_override=endpoint)
    return pafs.FileSystem.from_uri(f"{scheme}://{bucket}")[0]


def read_bytes(location: str) -> bytes:
    """The object's or file's bytes; FileNotFoundError naming the location when there is none."""
    fs, path = filesystem(location)
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{location}: no such file or object") from err


def read_text(location: str) -> str:
    return read_bytes(location).decode()


def write_bytes(location: str, data: bytes) -> None:
    """Write the whole file or object: local, a temporary file put in place by `os.replace` (parents created);
    object storage, one PUT."""
    if not is_uri(location) or _scheme(location) == "file":
        path = local_path(location)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(_temporary_copy(path, data), path)
        return
    fs, path = filesystem(location)
    with fs.open_output_stream(path) as f:
        f.write(data)


def write_text(location: str, text: str) -> None:
    write_bytes(location, text.encode())


def _temporary_copy(path: Path, data: bytes) -> str:
    """A new file in `path`'s directory holding `data`, flushed: what `os.replace` / `os.link` then names."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, 0o644)  # mkstemp's 0600 would make the named file private
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return temporary


def _info(location: str) -> pafs.FileInfo:
    fs, path = filesystem(location)
    return fs.get_file_info(path)


def exists(location: str) -> bool:
    return _info(location).type != pafs.FileType.NotFound


def size(location: str) -> int:
    """Bytes of a file or object; FileNotFoundError naming the location when there is none."""
    info = _info(location)
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(f"{location}: no such file or object")
    return info.size


def modified(location: str) -> float:
    """Last modification, seconds since the epoch (an object's `Last-Modified`: the store's clock)."""
    info = _info(location)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{location}: no such file or object")
    return info.mtime.timestamp()


def list_prefix(location: str) -> list[str]:
    """Every file or object under the directory or prefix `location` (recursively), as locations, sorted; []
    when there is none."""
    fs, path = filesystem(location)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    return sorted(join(location, info.path[len(path):].lstrip("/"))
                  for info in infos if info.type == pafs.FileType.File)


def list_versions(location: str) -> list[tuple[str, int, str]]:
    """(relative name, size, version) of every file or object under the directory or prefix `location`
    (recursively), sorted by name; [] when there is none. The version is S3's ETag (a rewrite of the same size in
    the same second still changes it), elsewhere the modification time in ns. A directory marker (a key ending in
    '/', which Arrow leaves) is not a file."""
    if is_uri(location) and _scheme(location) == "s3":
        bucket, _, key = location.split("://", 1)[1].partition("/")
        prefix = f"{key.rstrip('/')}/" if key else ""
        pages = _s3_client(_endpoint()).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted((found["Key"][len(prefix):], found["Size"], found["ETag"])
                      for page in pages for found in page.get("Contents", []) if not found["Key"].endswith("/"))
    fs, path = filesystem(location)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    return sorted((info.path[len(path):].lstrip("/"), info.size, str(info.mtime_ns))
                  for info in infos if info.type == pafs.FileType.File)


def delete(location: str, missing_ok: bool = True) -> None:
    """Remove a file or object (not a directory)."""
    fs, path = filesystem(location)
    try:
        fs.delete_file(path)
    except FileNotFoundError:
        if not missing_ok:
            raise FileNotFoundError(f"{location}: no such file or object") from None


def open_input_file(location: str):
    """A seekable reader (`pyarrow.NativeFile`): on object storage each `read_at`/`seek`+`read` is a ranged GET,
    so a parquet footer or one row group is read without the rest of the object."""
    fs, path = filesystem(location)
    try:
        return fs.open_input_file(path)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{location}: no such file or object") from err


def upload_file(local_file: str | Path, location: str) -> None:
    """A local file's bytes to a location (streamed, not held in memory); a local destination is written by
    `os.replace` as `write_bytes` does."""
    fs, path = filesystem(location)
    if not is_uri(location) or _scheme(location) == "file":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        temporary = _temporary_copy(Path(path), b"")
        pafs.copy_files(str(local_file), temporary, source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=fs)
        os.replace(temporary, path)
        return
    pafs.copy_files(str(local_file), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def download_file(location: str, local_file: str | Path) -> None:
    """A location's bytes to a local file, put in place by `os.replace` (a reader never sees part of it)."""
    fs, path = filesystem(location)
    destination = Path(local_file)
    destination.parent.mkdir(parents=True, exist_ok=True)
    temporary = _temporary_copy(destination, b"")
    try:
        pafs.copy_files(path, temporary, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    except FileNotFoundError as err:
        os.unlink(temporary)
        raise FileNotFoundError(f"{location}: no such file or object") from err
    os.replace(temporary, destination)


def upload_dir(local_dir: str | Path, location: str, last: str | None = None) -> list[str]:
    """Every file under `local_dir` to the same relative names under `location`; `last` (a relative name), when
    given, is written after all the others, so a reader that waits for it sees a complete directory. Returns the
    relative names, sorted."""
    root = Path(local_dir)
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    for name in sorted(names, key=lambda n: n == last):
        upload_file(root / name, join(location, *name.split(os.sep)))
    return names


# --- conditional writes ---------------------------------------------------------------------------------------

def _s3_key(location: str) -> tuple[str, str]:
    scheme = _scheme(location)
    if scheme != "s3":
        raise StorageError(f"{location}: conditional writes are not supported on {scheme}:// yet (s3:// and local "
                           f"paths are)")
    bucket, _, key = location.split("://", 1)[1].partition("/")
    return bucket, key


@functools.lru_cache(maxsize=4)
def _s3_client(endpoint: str | None):
    import boto3  # only object storage needs it

    # a session of its own: boto3's default session keeps the credentials it first found
    return boto3.session.Session().client("s3", endpoint_url=endpoint)


def _refused(err) -> bool:
    """An S3 precondition that did not hold: the object exists (If-None-Match), has another ETag or is gone
    (If-Match), or another conditional write to it is in flight."""
    code = err.response.get("Error", {}).get("Code", "")
    return code in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "404", "412", "409")


def _conditional_put(location: str, data: bytes, **condition: str) -> bool:
    """One PutObject under `condition` (IfNoneMatch / IfMatch); False when S3 refused it for the condition."""
    from botocore.exceptions import ClientError

    bucket, key = _s3_key(location)
    try:
        _s3_client(_endpoint()).put_object(Bucket=bucket, Key=key, Body=data, **condition)
    except ClientError as err:
        if _refused(err):
            return False
        raise
    return True


def create_if_absent(location: str, data: bytes) -> bool:
    """Create the file or object holding `data` unless it exists; True when this call created it."""
    if is_uri(location) and _scheme(location) != "file":
        return _conditional_put(location, data, IfNoneMatch="*")
    path = local_path(location)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = _temporary_copy(path, data)
    try:
        os.link(temporary, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(temporary)
    return True


def read_versioned(location: str) -> tuple[bytes, str]:
    """The bytes and the version they are (for `replace_if_version`); FileNotFoundError when there is none."""
    if is_uri(location) and _scheme(location) != "file":
        from botocore.exceptions import ClientError

        bucket, key = _s3_key(location)
        try:
            response = _s3_client(_endpoint()).get_object(Bucket=bucket, Key=key)
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise FileNotFoundError(f"{location}: no such object") from None
            raise
        return response["Body"].read(), response["ETag"]
    with open(local_path(location), "rb") as f:  # the version of exactly the file read: a replace makes a new one
        return f.read(), _local_version(os.fstat(f.fileno()))


def _local_version(stat: os.stat_result) -> str:
    return f"{stat.st_ino}-{stat.st_mtime_ns}-{stat.st_size}"


def replace_if_version(location: str, data: bytes, version: str) -> bool:
    """Replace the file or object with `data` if it still is `version`; True when replaced, False when it
    changed or is gone since it was read."""
    if is_uri(location) and _scheme(location) != "file":
        return _conditional_put(location, data, IfMatch=version)
    path = local_path(location)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        try:
            fcntl.flock(directory, fcntl.LOCK_EX)  # released when closed
        except OSError as err:
            raise OSError(err.errno, f"{location}: the file system gives no flock on {path.parent} (on "
                                     f"Lustre: mount with -o flock), which a conditional replace needs: "
                                     f"{err.strerror}") from None
        try:
            if _local_version(os.stat(path)) != version:
                return False
        except FileNotFoundError:
            return False
        os.replace(_temporary_copy(path, data), path)
        return True
    finally:
        os.close(directory)


def check_location(location: str, field: str) -> None:
    """Before a job's work: the scheme is known and, for a bucket, it exists and the credentials reach it;
    StorageError naming `field` and the location otherwise. Local paths need nothing here."""
    if not is_uri(location) or _scheme(location) == "file":
        return
    bucket = location.split("://", 1)[1].split("/", 1)[0]
    if _scheme(location) != "s3":
        if _info(f"gs://{bucket}").type == pafs.FileType.NotFound:
            raise StorageError(f"{field}: {location}: bucket {bucket} does not exist")
        return
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    try:
        _s3_client(_endpoint()).head_bucket(Bucket=bucket)
    except NoCredentialsError:
        raise StorageError(f"{field}: {location}: no credentials for object storage (set AWS_ACCESS_KEY_ID and "
                           f"AWS_SECRET_ACCESS_KEY, or run with an instance or service-account role)") from None
    except ClientError as err:
        code = err.response.get("Error", {}).get("Code", "")
        what = f"bucket {bucket} does not exist" if code in ("404", "NoSuchBucket") else \
            f"bucket {bucket} cannot be reached ({code}: {err.response.get('Error', {}).get('Message', err)})"
        raise StorageError(f"{field}: {location}: {what}") from None
    except BotoCoreError as err:
        raise StorageError(f"{field}: {location}: object storage cannot be reached: {err}") from None
