"""One writer per run: `<out_dir>/<run_name>/LOCK` names the driver that holds the run.

A second job on the same run directory while the holder is alive is refused before Ray starts, naming the holder
(host, PID, since when). A lock whose holder is dead (same host, PID gone or reused by another program) is taken
over with a message, atomically (`RunLock._remove_stale`: of two jobs taking over the same stale lock, one
wins). The holder touches the file every HEARTBEAT_S; a lock from another host (a job resubmitted
into a new allocation, whose head is another node) is taken over once its heartbeat is older than STALE_S, and
refused before that, naming the file to delete if that job is known to be gone. The file is created with
O_EXCL, so two jobs starting at the same moment cannot both win.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

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


def _read_holder(path: Path) -> tuple[dict, str | None]:
    """The lock's holder record ({} when empty or torn) and the text it was read from (None when the file cannot
    be read); FileNotFoundError when there is none."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise
    except OSError:
        return {}, None
    try:
        holder = json.loads(text or "{}")
    except ValueError:
        return {}, text
    return (holder if isinstance(holder, dict) else {}), text


def _alive(holder: dict) -> bool:
    start = _process_start(int(holder.get("pid", -1)))
    return start is not None and (start == "?" or holder.get("start") in (None, start))


class RunLock:
    """Held from `acquire` to `release` (also a context manager)."""

    def __init__(self, run_dir: str | Path, heartbeat_s: float = HEARTBEAT_S, stale_s: float = STALE_S):
        self.path = Path(run_dir) / LOCK_NAME
        self.held = False
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        self._stop = threading.Event()

    def _record(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid()),
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def acquire(self) -> str | None:
        """Take the lock; returns a message when a stale lock was taken over. Raises RunLockError."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        message = None
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                try:
                    holder, seen = _read_holder(self.path)
                except FileNotFoundError:
                    continue
                if not holder:  # being written right now by a job that just won, or torn: look again
                    time.sleep(0.2)
                    try:
                        holder, seen = _read_holder(self.path)
                    except FileNotFoundError:
                        continue
                who = f"host {holder.get('host', '?')}, PID {holder.get('pid', '?')}, since {holder.get('since', '?')}"
                if holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid():
                    raise RunLockError(f"{self.path.parent} is already locked by this process")
                try:
                    silent_s = time.time() - self.path.stat().st_mtime
                except FileNotFoundError:
                    continue
                if holder and holder.get("host") != socket.gethostname():
                    if silent_s <= self.stale_s:
                        raise RunLockError(
                            f"another job holds run directory {self.path.parent} ({who}, heartbeat {silent_s:.0f} s "
                            f"ago) on another host; it is taken over once its heartbeat is {self.stale_s:.0f} s old, "
                            f"or delete {self.path} if that job is known to be gone")
                elif holder and _alive(holder):
                    raise RunLockError(
                        f"another job is writing run directory {self.path.parent} ({who}): refusing to start a "
                        f"second writer; wait for it, stop it, or choose another run_name / out_dir")
                message = (f"took over the stale lock {self.path} of a job that is no longer running ({who}, "
                           f"heartbeat {silent_s:.0f} s ago)" if holder else f"took over the unreadable lock {self.path}")
                self._remove_stale(seen)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self._record(), f)
            self.held = True
            threading.Thread(target=self._heartbeat, name="huginn-run-lock", daemon=True).start()
            return message
        raise RunLockError(f"could not take {self.path}: other jobs keep taking it")

    def _remove_stale(self, seen: str | None) -> None:
        """Remove the lock file judged stale, and only that one: two jobs that both judged it stale must not
        remove the lock the first of them has just created. It is renamed to a name of this job's own (atomic:
        one of them gets it) and deleted only if it holds what was read (a holder's record names its host and
        PID; the inode number is no proof: a new file may reuse the stale one's); a fresh lock moved by mistake
        is put back (os.link: never over a lock that yet another job created meanwhile)."""
        claim = self.path.with_name(f"{LOCK_NAME}.takeover-{socket.gethostname()}-{os.getpid()}")
        try:
            os.rename(self.path, claim)
        except FileNotFoundError:
            return
        if seen is None or claim.read_text() == seen:
            os.unlink(claim)
            return
        try:
            os.link(claim, self.path)
        except FileExistsError:
            pass
        os.unlink(claim)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        self._stop.set()
        try:
            holder = json.loads(self.path.read_text())
            if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                self.path.unlink()
        except (OSError, ValueError):
            pass

    def __enter__(self) -> "RunLock":
        message = self.acquire()
        if message:
            print(f"[huginn] {message}", flush=True)
        return self

    def __exit__(self, *exc) -> None:
        self.release()
