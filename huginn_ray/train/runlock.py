"""One writer per run: `<run directory>/LOCK` names the driver that holds the run, in a local directory or a bucket.

A second job on the same run directory while the holder is alive is refused before Ray starts, naming the holder
(host, PID, since when). The lock lives on huginn_ray.storage's conditional writes, one implementation for local
paths and object storage alike:
- taking it is `create_if_absent` (O_EXCL-like locally, `If-None-Match: *` on S3): of two jobs starting at the
  same moment, one wins and the other is refused naming the lock;
- the holder rewrites it every HEARTBEAT_S (`replace_if_version`, its record's `beat` counting up, so every
  heartbeat is a new version), while it still holds its own record;
- a stale lock is taken over by `replace_if_version` from the version that was judged stale: of two jobs taking
  over the same stale lock, one wins, and the other, looking again, finds the winner alive. Stale is a holder
  on this host whose PID is gone or reused by another program (at once), or one from another host (a job
  resubmitted into a new allocation, whose head is another node) whose lock was last written more than STALE_S
  ago, by the storage's clock (a file's mtime, an object's Last-Modified); before that it is refused, naming the
  lock to delete if that job is known to be gone.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from huginn_ray import storage

LOCK_NAME = "LOCK"
HEARTBEAT_S = 30.0
STALE_S = 300.0


class RunLockError(RuntimeError):
    """Another live job holds this run directory."""


def _process_start(pid: int) -> str | None:
    """Start time of `pid` in clock ticks since boot (distinguishes a reused PID), None if it does not exist."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"


def _read_holder(location: str) -> tuple[dict, str | None]:
    """The lock's holder record ({} when empty or torn) and the version it was read at; FileNotFoundError when
    there is none."""
    data, version = storage.read_versioned(location)
    try:
        holder = json.loads(data or b"{}")
    except ValueError:
        return {}, version
    return (holder if isinstance(holder, dict) else {}), version


def _alive(holder: dict) -> bool:
    start = _process_start(int(holder.get("pid", -1)))
    return start is not None and (start == "?" or holder.get("start") in (None, start))


class RunLock:
    """Held from `acquire` to `release` (also a context manager)."""

    def __init__(self, run_dir: str | Path, heartbeat_s: float = HEARTBEAT_S, stale_s: float = STALE_S):
        self.run_location = str(run_dir) if storage.is_uri(str(run_dir)) else str(Path(run_dir))
        self.location = storage.join(self.run_location, LOCK_NAME)
        self.path: Path | str = self.location if storage.is_uri(self.location) else Path(self.location)
        """The lock: a `Path` for a local run directory, the URI for one in a bucket."""
        self.held = False
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        self._stop = threading.Event()
        self._token = uuid.uuid4().hex  # this lock's records, told apart from another lock of the same process
        self._beat = 0

    def _record(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid()),
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "token": self._token}

    def _encoded(self) -> bytes:
        self._beat += 1
        return json.dumps({**self._record(), "beat": self._beat}).encode()

    def acquire(self) -> str | None:
        """Take the lock; returns a message when a stale lock was taken over. Raises RunLockError."""
        storage.check_location(self.run_location, "run directory")
        message = None
        for _ in range(3):
            if storage.create_if_absent(self.location, self._encoded()):
                return self._hold(message)
            try:
                holder, version = self._look_at_holder()
                silent_s = time.time() - storage.modified(self.location)
            except FileNotFoundError:
                continue
            who = f"host {holder.get('host', '?')}, PID {holder.get('pid', '?')}, since {holder.get('since', '?')}"
            if holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid():
                raise RunLockError(f"{self.run_location} is already locked by this process")
            if holder and holder.get("host") != socket.gethostname():
                if silent_s <= self.stale_s:
                    raise RunLockError(
                        f"another job holds run directory {self.run_location} ({who}, heartbeat {silent_s:.0f} s "
                        f"ago) on another host; it is taken over once its heartbeat is {self.stale_s:.0f} s old, "
                        f"or delete {self.location} if that job is known to be gone")
            elif holder and _alive(holder):
                raise RunLockError(
                    f"another job is writing run directory {self.run_location} ({who}): refusing to start a "
                    f"second writer; wait for it, stop it, or choose another run_name / out_dir")
            message = (f"took over the stale lock {self.location} of a job that is no longer running ({who}, "
                       f"heartbeat {silent_s:.0f} s ago)" if holder else
                       f"took over the unreadable lock {self.location}")
            # from the version judged stale: of two jobs taking it over, one wins; the other looks again
            if storage.replace_if_version(self.location, self._encoded(), version):
                return self._hold(message)
        raise RunLockError(f"could not take {self.location}: other jobs keep taking it")

    def _look_at_holder(self) -> tuple[dict, str]:
        """The holder and its version; an empty or torn record (a store that exposes a write in progress) is
        read once more before it counts as unreadable."""
        holder, version = _read_holder(self.location)
        if not holder:
            time.sleep(0.2)
            holder, version = _read_holder(self.location)
        return holder, version

    def _hold(self, message: str | None) -> str | None:
        self.held = True
        threading.Thread(target=self._heartbeat, name="huginn-run-lock", daemon=True).start()
        return message

    def _ours(self) -> tuple[bool, str | None]:
        """Whether the lock still holds this lock's record, and its version."""
        try:
            holder, version = _read_holder(self.location)
        except (OSError, ValueError):
            return False, None
        return holder.get("token") == self._token, version

    def _heartbeat(self) -> None:
        failing = False
        while not self._stop.wait(self.heartbeat_s):
            try:
                ours, version = self._ours()
                if ours:
                    storage.replace_if_version(self.location, self._encoded(), version)
                failing = False
            except OSError as err:  # the next beat tries again; said once per streak of failures
                if not failing:
                    print(f"[huginn] warning: could not renew the run lock {self.location}: {err}", flush=True)
                failing = True

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        self._stop.set()
        try:
            if self._ours()[0]:
                storage.delete(self.location)
        except OSError:
            pass

    def __enter__(self) -> "RunLock":
        message = self.acquire()
        if message:
            print(f"[huginn] {message}", flush=True)
        return self

    def __exit__(self, *exc) -> None:
        self.release()
