"""When a collective hangs: the flight recorder's dump of every rank, and one console line naming the ranks that
did not arrive.

torch's flight recorder (c10d `FlightRecorder`, for gloo and NCCL/RCCL process groups alike) keeps, in every
process, a ring buffer of the last `TORCH_FR_BUFFER_SIZE` collectives it entered: process group, sequence number
in that group, op (`gloo:all_reduce`, `nccl:all_gather`), sizes, dtypes; and per group the sequence number of the
last collective enqueued and the last completed. The launcher sets its variables for every worker
(`flight_recorder_env`): NCCL's watchdog then writes the buffer to `<run_dir>/flight_recorder/rank_<k>` when a
collective times out (`TORCH_NCCL_DUMP_ON_TIMEOUT`). Gloo has no watchdog (a collective raises in the calling
thread at the timeout) and nothing names the ranks that are missing, so every rank runs this watch:

- a daemon thread reads the recorder's per-group status every `poll_s` (no I/O, nothing per collective);
- when a collective of this rank has been in flight for half the process-group timeout, the thread posts it at
  the c10d store (`hang_watch/signal`; the first rank to post is the reporter);
- every rank's thread checks that key each poll (one store look-up per rank and poll: NCCL's own watchdog checks
  its dump signal the same way). Seeing it, a rank writes its recorder's dump to `<run_dir>/flight_recorder/
  rank_<k>` and posts the last sequence number it entered in each group;
- the reporter reads them and prints one line: the ranks of the group whose last sequence number is behind the
  hung collective's did not arrive (each with its node and the last collective it entered); ranks that posted
  nothing did not answer (a dead process, or one holding the interpreter lock).

All of this happens before the collective's own timeout raises, while every rank is still alive to answer. A
rank that is merely slow past half the timeout is named too (the line says how long the others waited). One
dump per process: a restarted worker group is a new set of processes.

With the run directory in a bucket, a process writes its dump to a local directory named by the run
(huginn_ray.train.run_files) and uploads it to `<run_dir>/flight_recorder/rank_<k>`: this watch's dump once its
answer is posted, NCCL's own when the worker's watch ends (a process NCCL's watchdog kills first leaves it in that
local directory).

The dumps are torch's own pickle (NCCL's dump format). torch's analyzer, `python -m
torch.distributed.flight_recorder.fr_trace <run_dir>/flight_recorder -p rank_`, is made for them, but in torch
2.13 it stops on gloo's dumps (gloo's recorder leaves the groups' ranks out of `pg_config`), hence this line.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.distributed import distributed_c10d

from huginn_ray.train import run_files
from huginn_ray.train.warmup import PREFIX as WARMUP_PREFIX

BUFFER_ENTRIES = 2000
"""Collectives each rank's flight recorder keeps (torch's default; a step of the Frontier run enters a few
hundred)."""
DUMP_PREFIX = "rank_"
"""Dump file names: rank_<k> (the analyzer's `-p rank_`)."""
HANG_FRACTION = 0.5
"""A collective in flight this fraction of the process-group timeout is reported: early enough that every rank is
alive to answer and the report is out before the collective raises, late enough that only a hang or a severe
straggler reaches it."""
KEY = "hang_watch"
DUMP_DIR = "flight_recorder"
"""The run directory's directory of dumps."""


def dump_dir(run_dir: str | Path) -> Path:
    """Where this process writes its dump: `<run_dir>/flight_recorder`, or, for a run directory in a bucket, a
    local directory named by the run whose files are uploaded there (huginn_ray.train.run_files)."""
    return run_files.local_dir(run_dir, DUMP_DIR)


def flight_recorder_env(run_dir: str | Path) -> dict[str, str]:
    """Environment of every training worker, set before its process group exists: the recorder on, NCCL's (and
    RCCL's) dump at a watchdog timeout, into the run directory. A torch with the generic recorder (2.13 here)
    reads the TORCH_FR_* names and warns about the TORCH_NCCL_* ones they replace; an older one reads only those."""
    prefix = str(dump_dir(run_dir) / DUMP_PREFIX)
    generic = hasattr(c10d, "_dump_fr_trace")
    return {
        "TORCH_FR_BUFFER_SIZE" if generic else "TORCH_NCCL_TRACE_BUFFER_SIZE": str(BUFFER_ENTRIES),
        "TORCH_FR_DUMP_TEMP_FILE" if generic else "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }


@dataclass(frozen=True)
class Collective:
    group: str
    """The process group's name in the recorder (the default group: "0")."""
    seq: int
    """Its sequence number in that group (1-based)."""
    op: str
    """The recorder's name of it, e.g. gloo:all_reduce."""

    def describe(self) -> str:
        return f"{self.op} #{self.seq} of process group {self.group}"


def _recorder(backend: str):
    """The recorder's (pickle, json) dump functions for the default group's backend: NCCL (and RCCL) keep their
    own recorder, gloo the generic one."""
    if backend == "nccl" and hasattr(c10d, "_dump_nccl_trace_json"):
        return c10d._dump_nccl_trace, c10d._dump_nccl_trace_json
    return c10d._dump_fr_trace, c10d._dump_fr_trace_json


def group_ranks(group: str) -> list[int]:
    """Global ranks of the process group the recorder calls `group`."""
    for pg, name in distributed_c10d._world.pg_names.items():
        if name == group:
            return dist.get_process_group_ranks(pg)
    return list(range(dist.get_world_size()))


def last_entered(entries: list[dict]) -> dict[str, Collective]:
    """Per process group, the newest collective in the recorder's entries."""
    newest: dict[str, Collective] = {}
    for entry in entries:
        group = entry["process_group"][0]
        if group not in newest or entry["collective_seq_id"] > newest[group].seq:
            newest[group] = Collective(group, entry["collective_seq_id"], entry["profiling_name"])
    return newest


class HangWatch:
    """This rank's watch (see the module's docstring); `start` it after the process group exists."""

    def __init__(self, run_dir: str | Path, timeout_s: float, rank: int, store, backend: str):
        self.run_dir = str(run_dir)
        self.dumps = dump_dir(run_dir)
        self.dumps.mkdir(parents=True, exist_ok=True)  # NCCL's own dump (at its watchdog's timeout) does not create it
        self.timeout_s = timeout_s
        self.after_s = HANG_FRACTION * timeout_s
        self.poll_s = min(1.0, timeout_s / 20)
        self.rank = rank
        self.store = store
        self.dump_pickle, self.dump_json = _recorder(backend)
        self.in_flight: dict[str, tuple[int, float]] = {}
        """Per group id: the oldest collective this rank has not completed, and since when (monotonic)."""
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hang_watch", daemon=True)

    def start(self) -> "HangWatch":
        self.thread.start()
        return self

    def stop(self) -> None:
        """Ends the watch; a report under way gets the time it may take (its answers' wait)."""
        self.stopped.set()
        self.thread.join(timeout=self.timeout_s / 4)

    def _run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            if self.poll():
                return

    def poll(self) -> bool:
        """One look: post a collective of this rank in flight too long, then answer a posted signal (dump, and the
        report when this rank posted it). True once this rank has answered: the watch is done."""
        hung = self._hung_collective()
        if hung is not None:
            signal = json.dumps({"rank": self.rank, "group": hung[0].group, "seq": hung[0].seq,
                                 "op": hung[0].op, "waited_s": hung[1]})
            reporter = self.store.compare_set(f"{KEY}/signal", "", signal).decode() == signal
        else:
            reporter = False
        if reporter or self.store.check([f"{KEY}/signal"]):
            self._dump_and_answer()
            if reporter:
                print(self._report(json.loads(signal)), flush=True)
            return True
        return False

    def _hung_collective(self) -> tuple[Collective, float] | None:
        """The collective this rank has waited in for `after_s` or more (the longest waiting), and how long."""
        now = time.monotonic()
        status = json.loads(self.dump_json(False))["pg_status"]  # keyed by the group's id in this process
        for pg_id, counts in status.items():
            enqueued, completed = int(counts["last_enqueued_collective"]), int(counts["last_completed_collective"])
            if enqueued <= completed:
                self.in_flight.pop(pg_id, None)
            elif self.in_flight.get(pg_id, (None,))[0] != completed + 1:
                self.in_flight[pg_id] = (completed + 1, now)
        waiting = [(now - since, pg_id, seq) for pg_id, (seq, since) in self.in_flight.items()
                   if now - since >= self.after_s]
        if not waiting:
            return None
        waited, pg_id, seq = max(waiting)
        entries = json.loads(self.dump_json(True))["entries"]
        entry = next(e for e in entries if str(e["pg_id"]) == pg_id and e["collective_seq_id"] == seq)
        # the group's name, the same on every rank (its id counts this process's groups)
        return Collective(entry["process_group"][0], seq, entry["profiling_name"]), waited

    def _dump_and_answer(self) -> None:
        """This rank's recorder into its dump file; its last collective of every group to the store."""
        trace = self.dump_pickle()
        self.dump_file.write_bytes(trace)
        newest = last_entered(pickle.loads(trace).get("entries", []))
        self.store.set(f"{KEY}/entered/{self.rank}",
                       json.dumps({group: [c.seq, c.op] for group, c in newest.items()}))
        self.publish()  # after the answer: an upload must not keep the reporter waiting

    @property
    def dump_file(self) -> Path:
        return self.dumps / f"{DUMP_PREFIX}{self.rank}"

    def publish(self) -> None:
        """This rank's dump (this watch's, or NCCL's own at a watchdog timeout), if there is one, uploaded to
        `<run_dir>/flight_recorder/` when the run directory is a bucket; a failed upload is said, not raised."""
        if not self.dump_file.is_file():
            return
        try:
            run_files.publish(self.dump_file, self.run_dir)
        except OSError as err:
            print(f"[huginn] hang watch: rank {self.rank}'s flight recorder stays in {self.dump_file} "
                  f"({type(err).__name__}: {err})", flush=True)

    def _report(self, signal: dict) -> str:
        """The console line: who waited where, which ranks did not arrive, which did not answer."""
        hung = Collective(signal["group"], signal["seq"], signal["op"])
        ranks = group_ranks(hung.group)
        keys = {r: f"{KEY}/entered/{r}" for r in ranks}
        deadline = time.monotonic() + self.timeout_s / 4  # answers come within a poll or two
        while time.monotonic() < deadline and not self.store.check(list(keys.values())):
            time.sleep(self.poll_s / 4)
        behind, silent = [], []
        for r in ranks:
            if not self.store.check([keys[r]]):
                silent.append(f"rank {r} ({self._node(r)})")
                continue
            seq, op = json.loads(self.store.get(keys[r])).get(hung.group, [0, "none"])
            if seq < hung.seq:
                behind.append(f"rank {r} ({self._node(r)}, last entered {op} #{seq})")
        return (f"[huginn] hang watch: rank {signal['rank']} has waited {signal['waited_s']:.1f} s in "
                f"{hung.describe()} (ranks {ranks}, pg_timeout_s={self.timeout_s:g}); did not arrive: "
                f"{', '.join(behind) or 'none'}; did not answer: {', '.join(silent) or 'none'}; every rank's flight "
                f"recorder in {run_files.published_dir(self.run_dir, DUMP_DIR)}/{DUMP_PREFIX}<rank>")

    def _node(self, rank: int) -> str:
        key = f"{WARMUP_PREFIX}/host/{rank}"  # registered by every rank at startup (warmup.register_node)
        return f"node {self.store.get(key).decode()}" if self.store.check([key]) else "node unknown"


@contextlib.contextmanager
def watching(run_dir: str | Path, timeout_s: float):
    """This rank's hang watch for the duration of the block (the process group must exist); at its end, a dump
    NCCL's watchdog wrote is published too."""
    watch = HangWatch(run_dir, timeout_s, dist.get_rank(), distributed_c10d._get_default_store(),
                      dist.get_backend()).start()
    try:
        yield watch
    finally:
        watch.stop()
        watch.publish()
