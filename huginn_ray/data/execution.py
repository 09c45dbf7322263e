"""How the stages run on Ray Data's streaming executor.

The tokenize+pack stage, where the records are many and the work per record is the pipeline's largest, is a
dataset of documents: a read, `map_batches` with a callable class on an actor pool (the tokenizer loaded once per
actor), a write (huginn_ray/data/tokenize_pack.py). Ray Data streams the records between the operators with its
backpressure and shows their progress in records.

The other stages do a few large units of work each (a file to download, stage, scan or convert; a group of
packed files to map; a run of shards to reduce) and hand `run_tasks` a function and one tuple of arguments per
unit:

    results = run_tasks(fetch_file, [(repo, commit, f, ...) for f in files], name="download",
                        num_cpus=0.25, max_concurrent=8)

Each call is one row of a dataset (`from_items`, one row per block: the arguments pickled) and
`map_batches(batch_size=1)` calls the function on it, so one Ray task runs one call and returns its (small) result
as one row. Ray Data keeps as many tasks in flight as the cluster's CPUs and memory (and `max_concurrent`) allow,
shows progress bars (calls, throughput, ETA; off under `prepare_data.py --quiet`) and per-operator metrics in the
dashboard. An exception the function raises is not retried and fails the stage.

Memory: tasks and actors declare `memory=` to Ray. Calls with different declarations go to different operators
(one per declaration, rounded up to an eighth of its power of two so that a few operators cover every size); a
declaration is capped at the largest node's memory, so every task can be scheduled. A unit whose worker was killed
runs again with twice its memory, never the same (rerun_killed, for both shapes).

The functions and the pack stage's writer write their outputs themselves (unique temp name, fsync, rename:
huginn_ray/data/layout.py), so a retried attempt rewrites what a dead one left half-done, and the stage's output
does not depend on which attempt or which worker ran a unit.
"""

from __future__ import annotations

import pickle
import warnings
from typing import Callable


def original_error(err: BaseException, types: tuple[type, ...]) -> BaseException:
    """The first exception of `types` behind Ray's wrappers (RayTaskError, UserCodeException, ...), else `err`."""
    seen, todo = set(), [err]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, types) and getattr(current, "cause", None) is None:  # Ray's task errors subclass
            return current                                                     # the original, wrapping it in .cause
        todo += [getattr(current, "cause", None), current.__cause__, current.__context__]
    return err


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


def _one_call(fn: Callable, common: dict, name: str) -> Callable:
    """The map_batches function: one row = one call of fn; named `name` in progress bars and the dashboard. An
    error of this project's own (DataError, TokenRangeError, ...: it names the file and record) comes back as the
    call's result, so the driver raises that very exception; Ray's wrapper would keep only its text, buried in a
    traceback and followed by Ray Data's retry hint. Other errors go through Ray Data's retries and reporting."""

    def call(batch: dict) -> dict:
        args = pickle.loads(batch["args"][0])
        try:
            result, failed = fn(*args, **common), False
        except Exception as err:
            if not type(err).__module__.startswith("huginn_ray."):
                raise
            result, failed = err, True
        return {"call": [int(batch["call"][0])], "result": [pickle.dumps(result)], "failed": [failed]}

    call.__name__ = call.__qualname__ = name
    return call


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


def run_tasks(fn: Callable, calls: list[tuple], *, name: str, common: dict | None = None,
              memory: list[int] | int | None = None, num_cpus: float = 1.0, max_concurrent: int | None = None,
              on_result: Callable[[int, object], None] | None = None) -> list:
    """fn(*call, **common) for every call, one Ray task each, on Ray Data's streaming executor.

    `memory`: one declaration for all calls or one per call. `on_result(i, result)` is called on the driver as
    results arrive (any order); the results are returned in call order. A killed worker: rerun_killed."""
    if not calls:
        return []
    per_call = memory if isinstance(memory, list) else [memory] * len(calls)
    cap = node_memory_cap()
    declared = [declared_memory(estimate, cap) for estimate in per_call]
    results: list = [None] * len(calls)
    finished: set[int] = set()

    def run(todo: list[int], declared: list[int | None]) -> None:
        for i, result in _run_once(fn, [(i, calls[i], declared[i]) for i in todo], name, common or {},
                                   num_cpus, max_concurrent):
            results[i] = result
            finished.add(i)
            if on_result is not None:
                on_result(i, result)

    rerun_killed(run, declared, name=name, unfinished=lambda todo: [i for i in todo if i not in finished])
    return results


def _run_once(fn: Callable, calls: list[tuple[int, tuple, int | None]], name: str, common: dict,
              num_cpus: float, max_concurrent: int | None):
    """Yield (call index, result) of every (index, args, memory=) as it arrives: one Ray Data pass, one operator
    per memory declaration, unioned; a task whose worker dies is not retried (max_retries=0)."""
    import ray.data

    operators: dict[int | None, list[dict]] = {}
    for i, args, declared in calls:
        operators.setdefault(declared, []).append({"call": i, "args": pickle.dumps(args)})
    udf = _one_call(fn, common, name)
    datasets = []
    for declared, rows in operators.items():
        with warnings.catch_warnings():
            # max_retries has no named parameter in Ray 2.60: passed as a remote arg, which warns that remote args
            # are deprecated; tests/test_data_pipeline.py (a worker killed in pack and in the shuffle, rerun with
            # twice its memory) fails if it stops applying
            warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
            datasets.append(ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
                udf, batch_size=1, compute=ray.data.TaskPoolStrategy(size=max_concurrent), num_cpus=num_cpus,
                memory=declared, max_retries=0))
    dataset = datasets[0].union(*datasets[1:]) if len(datasets) > 1 else datasets[0]
    for row in dataset.iter_rows():
        i = int(row["call"])
        result = pickle.loads(row["result"])
        if row["failed"]:
            raise result
        yield i, result
