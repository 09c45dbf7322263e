"""How the stages run on Ray Data's streaming executor: every stage is a dataset of its records.

    read_datasource(unit_reads(name, units, read))   one read task per unit of work (a file to download, a unit
                                                     of staged documents, a hash bucket): read(unit) yields its
                                                     records
      -> map_batches(fn or Class)                    the work on the records: a function on tasks, or a callable
                                                     class on an actor pool where it holds state worth loading
                                                     once (the tokenizer, the n-gram set)
      -> write_datasink(sink)                        the unit's output files, committed (layout.py)

Ray Data streams the records between the operators with its backpressure and shows their progress in records and
blocks. Where read, map and write are tasks that declare the same resources (`task_args`), Ray Data fuses them into
one task per unit and the records never cross the object store (the download, the filter's scan, dedup and filter
passes); where the map is an actor pool (tokenize + pack), the records go through the object store to the actors
and on to the writer. Where a unit's work is one sequential pass (staging a file, the shuffle's map groups and
reducers, the released data's files), `run_unit_tasks` runs it as one read task that commits its own files and
returns only what it committed: no operator between, no records in Ray Data.

Memory: tasks and actors declare `memory=` to Ray. Units with different declarations go to different datasets
(one per declaration, rounded up to an eighth of its power of two so that a few cover every size, run one after
the other: `run_units`); a declaration is capped at the largest node's memory, so every task can be scheduled.
Operators run with max_retries=0 / max_restarts=0, so a killed worker stops the dataset, and the unfinished units
run again with twice their memory, never the same (rerun_killed). An error of the project's own (DataError,
TokenRangeError, DownloadError: it names the file and record) reaches the driver as that very exception
(project_error), not Ray's wrapper of it.

The writers commit their outputs themselves (unique temp name, fsync, rename: huginn_ray/data/layout.py), so a
rerun keeps what a killed attempt committed and rewrites what it left half-done, and the stage's output does not
depend on which attempt or which worker ran a unit.
"""
from __future__ import annotations

import contextlib
import functools
import pickle
import warnings
from typing import Any, Callable, Iterable


def _behind_wrappers(err: BaseException):
    """`err` and the exceptions behind it, breadth first: Ray's wrappers (RayTaskError, UserCodeException, ...)
    hold the original in `.cause`, Python's chains in __cause__ / __context__."""
    seen, todo = set(), [err]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [getattr(current, "cause", None), current.__cause__, current.__context__]


def original_error(err: BaseException, types: tuple[type, ...]) -> BaseException:
    """The first exception of `types` behind Ray's wrappers, else `err` (Ray's task errors subclass the original's
    type and wrap it in .cause: the one without a cause is the original)."""
    return next((e for e in _behind_wrappers(err) if isinstance(e, types) and getattr(e, "cause", None) is None), err)


def node_memory_cap() -> int:
    """The memory Ray offers on its largest live node (0 when it reports none)."""
    import ray

    sizes = [n["Resources"].get("memory", 0) for n in ray.nodes() if n.get("Alive")]
    return int(max(sizes)) if sizes else 0


def declared_memory(estimate: int | None, cap: int) -> int | None:
    """`estimate` rounded up to an eighth of its power of two (≤ 12.5 % more), at most `cap` (when known)."""
    if not estimate:
        return None
    step = max(1, (1 << (int(estimate).bit_length() - 1)) // 8)
    rounded = -(-int(estimate) // step) * step
    return min(rounded, cap) if cap else rounded


KILL_RETRIES = 4
"""Times a stage reruns the calls that a killed worker interrupted, each time with twice the memory (so up to 16x
the first declaration); one more kill fails the stage, naming it."""

UNDECLARED_MEMORY = 1 << 30
"""What a call that declares no memory (downloads, staging) is taken to have had when its worker is killed: its
rerun declares twice this."""


def killed_worker_errors() -> tuple[type, ...]:
    """How Ray reports a task whose worker was killed: OutOfMemoryError (Ray's memory monitor killed it),
    WorkerCrashedError (the process died: the kernel's OOM killer, a SIGKILL), NodeDiedError (its node is gone),
    ActorDiedError (an actor's process died; see killed_worker)."""
    from ray.exceptions import ActorDiedError, NodeDiedError, OutOfMemoryError, WorkerCrashedError

    return OutOfMemoryError, WorkerCrashedError, NodeDiedError, ActorDiedError


def killed_worker(err: BaseException) -> BaseException | None:
    """The error behind `err` that says a worker was killed, else None (an actor whose __init__ raised died of
    that error, not of a kill)."""
    killed = original_error(err, killed_worker_errors())
    if not isinstance(killed, killed_worker_errors()) or getattr(killed, "actor_init_failed", False):
        return None
    return killed


class KilledTaskError(RuntimeError):
    """A task's worker was killed and a rerun cannot help: it already had the most memory a node offers, or
    workers were killed KILL_RETRIES + 1 times."""


def memory_after_kill(declared: int | None, cap: int, name: str) -> int:
    """The memory= of a call rerun after its worker was killed: twice what it declared (UNDECLARED_MEMORY when
    nothing), at most `cap` (the largest node's memory; 0: unknown). Never the same: a call that had `cap` already
    raises KilledTaskError naming the operator."""
    if cap and declared is not None and declared >= cap:
        raise KilledTaskError(f"{name}: a task killed with memory={declared / 2**30:.2f} GiB, the most a node "
                              "offers; a rerun cannot get more (give the nodes more memory, or make the task smaller)")
    grown = 2 * (declared or UNDECLARED_MEMORY)
    return min(grown, cap) if cap else grown


def rerun_killed(run: Callable[[list[int], list[int | None]], None], declared: list[int | None], *, name: str,
                 unfinished: Callable[[list[int]], list[int]]) -> None:
    """run(todo, declared) for the units 0..n-1, each with its memory= declaration, until it returns; when a worker
    was killed (killed_worker), the units that had not finished (`unfinished(todo)`) run again, each with twice
    its memory (memory_after_kill), up to KILL_RETRIES times.

    Ray Data's default for a killed worker (max_retries=-1, and actors restarted) retries forever with the same
    declaration; the stages run with max_retries=0 and actors never restarted, so the dataset stops at the kill
    and this loop decides. Ray Data does not say which unit's worker was killed, so every unfinished one grows;
    a unit's outputs are committed files that its rerun finds and keeps."""
    cap = node_memory_cap()
    todo, kills = list(range(len(declared))), 0
    while todo:
        try:
            run(todo, declared)
            return
        except Exception as err:
            killed = killed_worker(err)
            if killed is None:
                raise
            kills += 1
            if kills > KILL_RETRIES:
                raise KilledTaskError(f"{name}: workers were killed {kills} times, the last: {killed}") from err
            todo = unfinished(todo)
            for i in todo:
                declared[i] = memory_after_kill(declared[i], cap, name)
            print(f"[{name}] a worker was killed ({type(killed).__name__}); rerunning the {len(todo)} units that "
                  "had not finished, each with twice its memory", flush=True)


def unit_reads(name: str, units: list, read: Callable[..., Iterable], *, rows: Callable | None = None,
               files: Callable | None = None):
    """A Ray Data datasource (operator `Read<name>`) of one read task per unit: `read(unit)` yields the unit's
    blocks (pyarrow tables); `rows(unit)` and `files(unit)`, when given, its row count and input files for Ray
    Data's metadata. Pass `override_num_blocks=len(units)` to read_datasource: Ray Data would otherwise split the
    blocks of a read with fewer tasks than it wants."""
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class UnitReads(Datasource):
        def estimate_inmemory_data_size(self) -> int | None:
            return None

        def get_name(self) -> str:
            return name

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                           data_context=None) -> list[ReadTask]:
            return [ReadTask(functools.partial(read, unit),
                             BlockMetadata(num_rows=rows(unit) if rows else None, size_bytes=None,
                                           input_files=files(unit) if files else None, exec_stats=None))
                    for unit in units]

    return UnitReads()


def run_unit_tasks(name: str, units: list, work: Callable[[Any], Any], memory: int | None, *,
                   files: Callable[[Any], list[str]] | None = None) -> list:
    """`work(unit)` for each unit, each in one Ray Data read task (operator `Read<name>`, `memory=` declared, no
    retry by Ray) that reads, works on and commits its unit itself and hands Ray Data only what `work` returns
    (pickled: what it committed); returns those, one per unit, in no particular order. `files(unit)`, when given,
    names its input files for Ray Data's metadata. A dataset that fails returns nothing: what its completed tasks
    committed is in their files.

    Where a unit's work is one sequential pass (a file staged, a map group or a reducer of the shuffle), this is
    cheaper than records through a read, a map and a write operator: no Arrow table per step, and no held copy
    (Ray Data 2.60's write operator tees its task's blocks and drains the copy for its statistics only after the
    datasink's write returns, so a write that gathers its unit keeps all of it twice)."""
    import pyarrow as pa
    import ray.data

    def task(unit) -> list:
        return [pa.table({"returned": pa.array([pickle.dumps(work(unit))], pa.binary())})]

    with quiet_remote_args():
        dataset = ray.data.read_datasource(unit_reads(name, units, task, files=files), override_num_blocks=len(units),
                                           ray_remote_args=task_args(memory))
    return [pickle.loads(row["returned"]) for row in dataset.take_all()]


def table_sink(name: str, write: Callable[[Iterable], Any], collect: Callable[[list], Any] | None = None):
    """A Ray Data datasink (the write of a stage, `name` in its progress) whose write, in each write task, is
    `write(tables)` over the pyarrow tables of the task's blocks, in order; what `write` returns is the task's
    write result. With `collect`, `.results` is `collect([every task's write result])` once the dataset completes
    (`collect([])` before, and after a dataset that failed)."""
    from ray.data.block import BlockAccessor
    from ray.data.datasource import Datasink

    class TableSink(Datasink):
        def __init__(self):
            self.results = None if collect is None else collect([])

        def get_name(self) -> str:
            return name

        def write(self, blocks, ctx):
            return write(BlockAccessor.for_block(block).to_arrow() for block in blocks)

        def on_write_complete(self, write_result) -> None:
            if collect is not None:
                self.results = collect(write_result.write_returns)

    return TableSink()


def task_args(memory: int | None) -> dict:
    """The remote args of every operator of a fused pass: the same for all (Ray Data fuses only operators whose
    args agree), one CPU, the unit's memory, no retry by Ray (a kill is rerun_killed's to decide)."""
    return {"num_cpus": 1, "max_retries": 0, **({"memory": memory} if memory else {})}


@contextlib.contextmanager
def quiet_remote_args():
    """max_retries / max_restarts have no named parameter in Ray 2.60: passed as remote args, which warns that
    remote args are deprecated. rerun_killed relies on them (a killed worker must stop the dataset): the kill tests
    (tests/test_data_pipeline.py, test_data_decontaminate.py, test_data_hub_download.py) fail if they stop
    applying."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        yield


@contextlib.contextmanager
def block_size(target_bytes: int | None):
    """Ray Data's target block size while a stage runs: None turns block splitting (and merging) off, so that a
    block from the read reaches the map and the write whole (a pack batch, a scan unit, a bucket's record)."""
    from ray.data import DataContext

    context = DataContext.get_current()
    shaping = context.target_max_block_size
    context.target_max_block_size = target_bytes
    try:
        yield
    finally:
        context.target_max_block_size = shaping


def project_error(err: BaseException) -> BaseException:
    """The error to raise on the driver for a failed dataset: a killed worker's error as it is (rerun_killed reads
    it), else the first error of this project's own behind Ray's wrappers (it names the file and row), else
    `err`."""
    if killed_worker(err) is not None:
        return err
    return next((e for e in _behind_wrappers(err)
                 if type(e).__module__.startswith("huginn_ray.") and getattr(e, "cause", None) is None), err)


def run_units(name: str, estimates: list[int | None], run_class: Callable[[list[int], int | None], None],
              finished: Callable[[int], bool]) -> None:
    """run_class(units, memory) for the units 0..n-1, grouped by their declared memory (`estimates`, rounded:
    declared_memory), one dataset per class, smallest first; a unit whose worker was killed runs again with twice
    its memory until `finished(unit)` (rerun_killed); an error of the project's own is raised as itself."""
    if not estimates:
        return
    cap = node_memory_cap()

    def run(todo: list[int], declared: list[int | None]) -> None:
        classes: dict[int | None, list[int]] = {}
        for i in todo:
            classes.setdefault(declared[i], []).append(i)
        for memory, members in sorted(classes.items(), key=lambda kv: kv[0] or 0):
            try:
                run_class(members, memory)
            except Exception as err:
                cause = project_error(err)
                if cause is err:
                    raise
                raise cause from None

    rerun_killed(run, [declared_memory(e, cap) for e in estimates], name=name,
                 unfinished=lambda todo: [i for i in todo if not finished(i)])
