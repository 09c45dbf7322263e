"""Where each stage writes under `output_dir`, and how a stage marks its output complete.

    <output_dir>/download/<source>/...             raw Hub files, + _provenance.json once all are verified
    <output_dir>/download/manifest.json            provenance of every Hub source (repo, commit, files, hashes)
    <output_dir>/staging/<source>/NNNNN.parquet    one file per input file: columns text, source, doc_id
    <output_dir>/staging/<source>/_COMPLETE.json   rows per file, record counts + the fingerprint of the inputs
    <output_dir>/quarantine/<source>/NNNNN.jsonl   the bad records of input file NNNNN (staging.py)
    <output_dir>/tokenizer/                        tokenizer.json + tokenizer_config.json
    <output_dir>/packed/SSSS-DDDDDDDDDDDDDDDD.parquet  packed rows (input_ids, split) per batch, before the shuffle
    <output_dir>/packed/_COMPLETE.json
    <output_dir>/shards                            pointer (symlink) to the current version, shards.vNNNN
    <output_dir>/shards.vNNNN/{train,val}/RRRRR.parquet  one file per training rank; versions are never changed
    <output_dir>/shards.vNNNN/manifest.json

A stage writes into `<dir>.partial` (staging per source, pack, shuffle: resumable, keyed by the stage's
fingerprint) or `<dir>.tmp-<pid>` (the tokenizer) and renames it into place when done, so a directory that
exists is complete; its marker records a fingerprint of everything it was built from, and a stage whose recorded
fingerprint matches is skipped on the next run. `.tmp-<pid>` directories of processes that are gone are removed, with a message.

Every file is written under a name unique to its writer (`temp_path`: a task attempt that Ray retries while the
first attempt still runs, e.g. on a node it lost contact with, never writes into the other's file) and committed
with `commit_file`: fsync the file, rename it, fsync the directory, so a file that exists under its final name
holds all of its bytes even after the node crashes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

COMPLETE = "_COMPLETE.json"


def fingerprint(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


BYTE_SHAPING_LIBRARIES = ("tokenizers", "pyarrow", "numpy")
"""The libraries whose version can change a stage's bytes (the encoder's ids, the parquet and JSON readers and
writers, the arithmetic of the permutations): part of every stage's fingerprint, so an upgrade reruns the stage,
saying so, instead of resuming with output that the new versions would not write."""


def library_versions() -> dict[str, str | None]:
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {name: version(name) for name in BYTE_SHAPING_LIBRARIES}


def stage_fingerprint(inputs: dict) -> tuple[str, dict]:
    """A stage's fingerprint and what it is a hash of: `inputs` plus `versions` (library_versions). Markers record
    both (`fingerprint`, `fingerprint_inputs`) so that a rerun can name what changed (changed_inputs)."""
    full = {**inputs, "versions": library_versions()}
    return fingerprint(full), json.loads(json.dumps(full, sort_keys=True, default=str))


def _short(value: object) -> str:
    """A value as a change message shows it: itself when short, else the start of it (a string: a hash) or of
    its hash (a list, a dict)."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    if len(text) <= 24:
        return text
    return (text if isinstance(value, str) else fingerprint(value))[:12] + "..."


def changed_inputs(old: dict | None, new: dict) -> str:
    """What differs between two fingerprints' inputs: `field old -> new` per changed field, a library by its name
    (`tokenizers 0.21.0 -> 0.22.1`); an output that records no inputs (made before they were recorded) says so."""
    if not isinstance(old, dict):
        return "its inputs (the output records none)"

    def fields(inputs: dict) -> dict:
        return {**{k: v for k, v in inputs.items() if k != "versions"}, **inputs.get("versions", {})}

    before, after = fields(old), fields(new)
    changes = [f"{key} {_short(before.get(key, 'absent'))} -> {_short(after.get(key, 'absent'))}"
               for key in sorted(before.keys() | after.keys()) if before.get(key) != after.get(key)]
    return ", ".join(changes) if changes else "nothing recorded"


def current_marker(directory: Path, expected: str, inputs: dict, stage: str, name: str = COMPLETE) -> dict | None:
    """The marker of `directory` when its fingerprint is `expected`; else None, after saying what changed when an
    output of other inputs is there (`[pack] <dir>: tokenizers 0.21.0 -> 0.22.1 changed; the stage reruns`)."""
    marker = read_marker(directory, name)
    if marker is None:
        return None
    if marker.get("fingerprint") == expected:
        return marker
    print(f"[{stage}] {directory}: {changed_inputs(marker.get('fingerprint_inputs'), inputs)} changed; the stage "
          "reruns", flush=True)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(final: Path) -> None:
    """Remove `<final>.tmp-<pid>` / `<final>.old-<pid>` directories and `<final>.link-<pid>` pointers whose process
    is gone (a crashed run).

    Pids are those of this host: run a pipeline's driver on one host (the Ray head) at a time."""
    if not final.parent.is_dir():
        return
    for path in final.parent.glob(f"{final.name}.*-*"):
        kind, _, pid = path.name[len(final.name) + 1:].partition("-")
        if kind in ("tmp", "old", "link") and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            print(f"[cleanup] removing {path}: temporary {'pointer' if kind == 'link' else 'directory'} of a run "
                  f"that is no longer alive (pid {pid})", flush=True)
            if path.is_symlink():
                path.unlink()
            else:
                shutil.rmtree(path, ignore_errors=True)


def clean_stale_under(root: Path) -> None:
    """clean_stale for every stage directory under an output root (run at the start of a pipeline run)."""
    for parent in (root, root / "staging", root / "download"):
        if parent.is_dir():
            for path in parent.glob("*.*-*"):
                clean_stale(path.with_name(path.name.split(".tmp-")[0].split(".old-")[0].split(".link-")[0]))


def _version_number(pointer: Path, path: Path) -> int | None:
    suffix = path.name[len(pointer.name):]
    return int(suffix[2:]) if suffix.startswith(".v") and suffix[2:].isdigit() else None


def versions(pointer: Path) -> list[Path]:
    """The published versions of `pointer`: its `<name>.vNNNN` directories, oldest first."""
    found = [p for p in pointer.parent.glob(f"{pointer.name}.v*")
             if _version_number(pointer, p) is not None and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: _version_number(pointer, p))


def publish_version(directory: Path, pointer: Path) -> Path:
    """A complete `directory` becomes the next immutable version `<pointer>.vNNNN`, and `pointer` (a symlink
    naming it relative to its folder, so the output root can move) is moved to it in one rename: a reader sees the
    old version or the new one, never a mix or nothing, and one that resolved the pointer keeps its version
    (nothing here deletes a version: remove_old_versions). A `pointer` that is still a directory (published
    before versions) becomes the version before the new one. Returns the new version's path.

    A crash between the version's rename and the pointer's leaves a newest version the pointer does not name;
    finish_publish (a rerun, before it looks at the pointer) moves the pointer to it."""
    if pointer.is_dir() and not pointer.is_symlink():
        pointer.rename(pointer.with_name(f"{pointer.name}.v{_next_version(pointer):04d}"))
    version = pointer.with_name(f"{pointer.name}.v{_next_version(pointer):04d}")
    directory.rename(version)
    fsync_dir(pointer.parent)
    _point(pointer, version)
    return version


def _next_version(pointer: Path) -> int:
    existing = versions(pointer)
    return _version_number(pointer, existing[-1]) + 1 if existing else 1


def _point(pointer: Path, version: Path) -> None:
    link = pointer.with_name(f"{pointer.name}.link-{os.getpid()}")
    link.unlink(missing_ok=True)
    os.symlink(version.name, link)
    os.replace(link, pointer)  # atomic on POSIX file systems (local, NFS, Lustre, GPFS): one rename
    fsync_dir(pointer.parent)


def finish_publish(pointer: Path) -> None:
    """Point `pointer` at its newest version when a crash stopped publish_version between its two renames."""
    existing = versions(pointer)
    if existing and pointer.is_symlink() and Path(os.readlink(pointer)).name != existing[-1].name:
        print(f"[recover] {existing[-1]} was published but {pointer} still names {os.readlink(pointer)} (a run "
              f"stopped in between): moving the pointer to it", flush=True)
        _point(pointer, existing[-1])
    elif existing and not pointer.exists() and not pointer.is_symlink():
        print(f"[recover] {existing[-1]} was published, {pointer} does not exist yet: pointing it there", flush=True)
        _point(pointer, existing[-1])


def remove_old_versions(pointer: Path) -> list[Path]:
    """Delete every version of `pointer` but the one it names now; returns what was removed. Only while no
    training run reads an old version: a run reads the version it resolved at its start until it ends."""
    current = Path(os.path.realpath(pointer)).name if pointer.exists() else None
    removed = [p for p in versions(pointer) if p.name != current]
    for path in removed:
        shutil.rmtree(path)
    return removed


def tmp_dir_for(final: Path) -> Path:
    clean_stale(final)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished directory into place; an older version is deleted only after the swap."""
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old)


def temp_path(final: Path) -> Path:
    """Where one writer (one task attempt) writes `final` before commit_file: `<name>.<random>.tmp`.

    Names ending in `.tmp` are never read; a resumed stage deletes them."""
    return final.with_name(f"{final.name}.{uuid.uuid4().hex[:12]}.tmp")


def commit_file(tmp: Path, final: Path) -> None:
    """fsync `tmp`, rename it to `final` (atomic), fsync the directory: `final` is complete or absent."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def write_json(path: Path, data: dict) -> None:
    tmp = temp_path(path)
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    commit_file(tmp, path)


def read_marker(directory: Path, name: str = COMPLETE) -> dict | None:
    path = directory / name
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def is_complete(directory: Path, expected_fingerprint: str, name: str = COMPLETE) -> bool:
    marker = read_marker(directory, name)
    return marker is not None and marker.get("fingerprint") == expected_fingerprint


PLAN = "_PLAN.json"
"""Marks a stage's work directory in progress: the fingerprint of the inputs its committed files are for."""


def resumable_work_dir(final: Path, fingerprint: str, stage: str, noun: str, total: int | None = None,
                       inputs: dict | None = None) -> Path:
    """`final`.partial, where a stage commits its output files one by one: kept, with the files that an
    interrupted run with the same inputs committed (its temp files removed), or else made anew, saying what
    changed (`inputs`: the fingerprint's inputs, recorded in the PLAN)."""
    work = final.with_name(final.name + ".partial")
    previous = read_marker(work, PLAN)
    if previous is not None and previous.get("fingerprint") == fingerprint:
        done = sum(1 for _ in work.glob("*.parquet"))
        print(f"[{stage}] resuming {work}: {done}{f'/{total}' if total is not None else ''} {noun} already "
              "written are kept", flush=True)
        remove_temp_files(work)
    else:
        if work.exists():
            why = changed_inputs(previous.get("fingerprint_inputs") if previous else None, inputs or {})
            print(f"[{stage}] removing {work}: left by a run with other inputs or settings ({why} changed)",
                  flush=True)
            shutil.rmtree(work)
        work.mkdir(parents=True)
        write_json(work / PLAN, {"fingerprint": fingerprint, "fingerprint_inputs": inputs})
    return work


def remove_temp_files(work: Path) -> None:
    """Temp files left by attempts whose worker died (a retry committed the file)."""
    for stale in work.glob("*.tmp"):
        stale.unlink()


def commit_work_dir(work: Path, final: Path, marker: dict) -> None:
    """A resumable work directory whose files are all committed becomes `final`, with its completeness marker.

    Recoverable from either side of every step: until the marker is committed into the work directory, `final`
    (if any) is untouched and the work directory keeps its PLAN, so a rerun resumes it; from then on the work
    directory is complete and `finish_commit` (called by a rerun before it looks at `final`) completes the swap,
    also when a crash left `final` renamed away (`<final>.old-<pid>`, removed as stale)."""
    remove_temp_files(work)
    write_json(work / COMPLETE, marker)
    finish_commit(final, quiet=True)


def finish_commit(final: Path, quiet: bool = False) -> None:
    """Move `<final>.partial` into place when it holds a completeness marker: a commit_work_dir that a crash
    interrupted after the marker was written (a no-op otherwise)."""
    work = final.with_name(final.name + ".partial")
    if read_marker(work) is None:
        return
    if not quiet:
        print(f"[recover] {work} is complete (a run stopped while moving it into place): moving it to {final}",
              flush=True)
    (work / PLAN).unlink(missing_ok=True)
    replace_dir(work, final)

