"""What a checkpoint holds, and how the workers write and read it.

Every worker reports one directory to Ray Train, which merges them into one checkpoint directory:

    state/                     model and optimizer in torch.distributed.checkpoint (DCP) format: every rank writes
                               the tensors it holds (its shards under hsdp); a tensor held whole by several ranks
                               (replicate, or the replicas of a shard) is written once, by one of them, DCP
                               spreading those writes over the ranks; `.metadata` (rank 0) maps every tensor to
                               its pieces, so any layout reads it back (resharding)
    model/config.json          the model's shape (rank 0): `load_pretrained` and the export read a checkpoint as a
                               model directory, whatever layout wrote it
    trainer_state.json         step, tokens seen, MLflow run id, the data position (rows consumed per stream, with
                               the shard count and global batch that define it), world size and layout (rank 0)
    checkpoint_complete.json   every file above of every rank with its size in bytes, and the step (rank 0,
                               written last, once every rank's save succeeded): the tensor files' sizes come from
                               `.metadata`, which records where DCP wrote every piece (file, offset, length), so
                               no rank sends rank 0 its file list

A directory is complete when its marker is readable and every file it lists is there with the listed size:
ranks upload their parts independently (README, "What is atomic"), so a directory with no marker, a missing or
truncated file is a save that did not finish, and `resume` passes over it to the previous checkpoint.

What each rank pays does not grow with the world size W on the path every run takes (README, "Cost at scale"): the
save's agreement and the resume's agreement on each candidate are one all-reduce of a small count each; rank 0
alone lists the candidates and sends the list (one broadcast); each rank checks the sizes of its own share of the
marker's files (about one file each), so a checkpoint's W + 4 files are checked once, not once per rank. Only a
failure costs more: a missing or short file makes every rank check every file, and every rank's reason is
gathered (`collectives.all_ranks`), so that the message names the failure as every rank sees it.

Saves write a local directory; everything that reads a checkpoint (`resume`, `incomplete`, `read_trainer_state`,
`read_tensors`) takes a location, a local path or a bucket's prefix (huginn_ray.storage): on a bucket the
candidates are listed, the sizes checked and the tensors read by ranged GETs where they are, not downloaded.

During a run each rank's `Checkpointer` starts its saves (synchronous or in the background) and hands each one to
Ray Train once every rank's part is complete.
"""

from __future__ import annotations

import json
import tempfile
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pyarrow.fs as pafs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, \
    set_optimizer_state_dict

from huginn_ray import storage
from huginn_ray.checkpoint_layout import MARKER, TRAINING_STATE_DIR, incomplete, read_text
from huginn_ray.model.pretrained import CONFIG_NAME
from huginn_ray.train import replica_read
from huginn_ray.train.collectives import all_ranks, count_ranks, from_rank0, world_size
from huginn_ray.train.parallel import lazy_gloo_group


@dataclass
class TrainerState:
    step: int = 0
    """Optimizer steps done."""
    tokens: int = 0
    """Tokens trained on, all ranks together."""
    mlflow_run_id: str | None = None
    """The MLflow run this training run logs to."""
    num_streams: int = 0
    """Train shards of the data order (huginn_ray.train.data_order)."""
    global_batch_rows: int = 0
    """Rows per optimizer step of the data order."""
    data_dir: str = ""
    """The shard version the run reads (RunPlan.data_dir); a resumed run keeps it ("": written before it was
    recorded)."""
    rows_per_stream: int = 0
    """The data position: rows every stream has given (step x global_batch_rows / num_streams)."""
    world_size: int = 0
    """Ranks that wrote the checkpoint; informative: any allowed worker count resumes from it."""
    layout: str = ""
    """parallelism of the run that wrote it (`replicate` or `hsdp, shard_size S`); informative: any layout reads it."""


IO_ATTEMPTS = 3
"""DCP reads and writes are tried this often (1 s, then 2 s apart) before the error counts: a transient error of a
shared file system must not mark a good checkpoint as broken."""


def with_retries(what: str, action):
    """`action()`, retried up to IO_ATTEMPTS times on the file system's errors (OSError); DCP reports a failure on
    any rank as a CheckpointException on every rank alike, and the replica-spread read an OSError on every replica
    of the group alike, so the ranks that share a collective retry it together. Other errors (a missing key,
    another shape) are raised at once."""
    for attempt in range(1, IO_ATTEMPTS + 1):
        try:
            return action()
        except (OSError, CheckpointException) as err:
            if attempt == IO_ATTEMPTS or not transient(err):
                raise
            print(f"[huginn] {what}: {describe_error(err)}; retrying ({attempt}/{IO_ATTEMPTS})", flush=True)
            time.sleep(attempt)


def transient(err: BaseException) -> bool:
    """An I/O error, on every rank that failed."""
    if isinstance(err, CheckpointException):
        return all(isinstance(failure, OSError) for failure, _ in err.failures.values())
    return isinstance(err, OSError)


def describe_error(err: BaseException) -> str:
    """One line: the error of each failed rank (DCP), or the error itself."""
    if isinstance(err, CheckpointException):
        return "; ".join(f"rank {rank}: {type(failure).__name__}: {failure}"
                         for rank, (failure, _) in sorted(err.failures.items()))
    return f"{type(err).__name__}: {err}"


def model_state(model) -> dict:
    """The model's tensors by name, aliasing the model's own (DTensor shards under hsdp), so DCP loads in place.
    A tied head is the embedding: stored once, under `transformer.wte.weight`."""
    state = get_model_state_dict(model)
    if model.config.tie_embeddings:
        del state["lm_head.weight"]
    return state


@dataclass
class PendingSave:
    """A save this rank started: its small files are written, DCP's tensor files may still be in flight."""

    directory: Path
    step: int
    rank: int
    future: Future
    """Done when DCP has written this rank's tensor files (at once for a synchronous save)."""


def write(directory: Path, rank: int, model, optimizer, state: TrainerState, device) -> bool:
    """Save synchronously: every rank writes its files, then rank 0 the marker. True when the checkpoint is complete
    on every rank (a failed save is reported and leaves no marker). Every rank calls it: DCP's save and the file
    lists are collectives (without a process group, one process: this rank's files alone)."""
    return finish_save(start_save(directory, rank, model, optimizer, state, device), device)


def start_save(directory: Path, rank: int, model, optimizer, state: TrainerState, device,
               background_group=None) -> PendingSave:
    """Write this rank's small files, then its tensors through DCP: synchronously, or with `background_group` (a
    gloo group of every rank, used by nothing else) asynchronously: DCP copies the state to host memory here,
    and writes it from a background thread, whose collectives run on that group so that they never interleave
    with training's. The caller must pass the result to `finish_save` before the next save."""
    directory.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (directory / "model").mkdir(exist_ok=True)
        model.config.to_json(directory / "model" / CONFIG_NAME)
        (directory / "trainer_state.json").write_text(json.dumps(asdict(state), indent=2))
    tensors = {"model": model_state(model), "optim": get_optimizer_state_dict(model, optimizer)}
    writer = dcp.FileSystemWriter(directory / TRAINING_STATE_DIR, overwrite=True)
    future = Future()
    try:
        if background_group is None:
            with_retries(f"writing {directory / TRAINING_STATE_DIR}",
                         lambda: dcp.save(tensors, storage_writer=writer, planner=SmallValuesOnRankZero()))
            future.set_result(None)
        else:
            saving = dcp.async_save(tensors, storage_writer=writer, process_group=background_group,
                                    planner=SmallValuesOnRankZero())
            future = getattr(saving, "upload_completion", saving)  # a Future, or an AsyncSaveResponse holding one
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP raises on every rank alike; finish_save reports
        future.set_exception(err)
    return PendingSave(directory, state.step, rank, future)


class SmallValuesOnRankZero(DefaultSavePlanner):
    """DCP's save planner, except that the small values every rank holds whole (non-tensor values, plain tensors of
    at most replica_read.SMALL_BYTES: the optimizer's step counters) are written by rank 0 alone, one run of its
    file. DCP's own deduplication would deal them one by one over the ranks' files (about 300 of them for the
    nebel), and the ranks reading them back at resume would open one file for each few bytes.

    DCP's save-plan caching is on: a rank whose local plan is the one of its previous save sends an empty plan, and
    the coordinator reuses the global plan it made then, so that a save after the first exchanges O(1) per rank
    instead of every rank's plan (about 300 items each) on rank 0."""

    def __init__(self):
        super().__init__(enable_plan_caching=True)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if not self.is_coordinator:
            self.plan = plan = self.without_rank_zero_values(plan)
        return plan

    @staticmethod
    def without_rank_zero_values(plan: SavePlan) -> SavePlan:
        """The plan of a rank other than 0: without the small values every rank holds whole."""
        return replace(plan, items=[item for item in plan.items if not written_by_rank_zero(item)])


def written_by_rank_zero(item: WriteItem) -> bool:
    """A non-tensor value, or a plain (not DTensor: every rank holds it whole) tensor of a few bytes."""
    if item.type == WriteItemType.BYTE_IO:
        return True
    return item.type == WriteItemType.TENSOR and \
        item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize <= replica_read.SMALL_BYTES


def finish_save(pending: PendingSave, device) -> bool:
    """Wait for this rank's tensor files, then agree with every rank (one all-reduce of the failed ranks' count):
    when every rank's save succeeded, rank 0 writes the marker (`write_marker`), and the checkpoint is complete;
    otherwise every rank's error is gathered, rank 0 reports the failure, no marker is written, and the previous
    checkpoint stays the newest complete one. Returns whether this checkpoint is complete."""
    error, files = None, {}
    try:
        pending.future.result()
        if pending.rank == 0:  # before the agreement: a `.metadata` rank 0 cannot read fails the save everywhere
            files = marker_files(pending.directory)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - any failure of the save: agree, then report
        error = describe_error(err)
    failed, = count_ranks([error is not None], device)
    if failed:
        failures = [(r, e) for r, e in enumerate(all_ranks(error, device)) if e is not None]
        if pending.rank == 0:
            print(f"[huginn] the checkpoint of step {pending.step} failed ({describe(failures, world_size())}); "
                  "the previous complete checkpoint stays the newest", flush=True)
        return False
    if pending.rank == 0:
        write_marker(pending.directory, pending.step, files)
    return True


class Checkpointer:
    """This rank's saves. Each is written into a local directory, then handed to Ray Train once every rank's part
    is complete (`ray.train.report`, CheckpointUploadMode.ASYNC: Ray uploads it in the background and deletes the
    local copy; its registration waits for every rank's upload). With `asynchronous`, DCP copies the state to host
    memory and writes it while training goes on; the save finishes, and is reported, at the next save or at the
    end. The last save of a run (its last step, a stop) is always synchronous."""

    def __init__(self, asynchronous: bool, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        # DCP's background thread needs a group of its own: its collectives must not interleave with training's
        self.background_group = lazy_gloo_group() if asynchronous else None
        self.pending: PendingSave | None = None
        self.metrics: dict = {}

    def save(self, model, optimizer, state: TrainerState, loss: float, stop_reason: str | None,
             final: bool) -> None:
        self.finish()
        directory = Path(tempfile.mkdtemp(prefix="huginn_ckpt_"))
        self.metrics = {"step": state.step, "loss": loss, "tokens": state.tokens, "stop_reason": stop_reason or ""}
        self.pending = start_save(directory, self.rank, model, optimizer, state, self.device,
                                  None if final else self.background_group)
        if final or self.background_group is None:
            self.finish()

    def finish(self) -> None:
        """Complete the save in flight, if any, and report it to Ray Train (every rank agrees whether it is
        complete; an incomplete one is reported by rank 0 and not handed to Ray)."""
        if self.pending is None:
            return
        import ray.train

        pending, self.pending = self.pending, None
        if finish_save(pending, self.device):
            ray.train.report(self.metrics, checkpoint=ray.train.Checkpoint.from_directory(str(pending.directory)),
                             checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)


SMALL_FILES = (f"model/{CONFIG_NAME}", "trainer_state.json", f"{TRAINING_STATE_DIR}/.metadata")
"""The files of a checkpoint other than DCP's tensor files, all written by rank 0."""


def marker_files(directory: Path) -> dict[str, int]:
    """Every file of a finished save with its size, as rank 0 sees them without asking the other ranks: its own
    small files by their sizes on disk, and every tensor file DCP's `.metadata` names, with the size its pieces
    give (the end of the last piece written into it: DCP writes a file's pieces back to back)."""
    sizes = {name: (directory / name).stat().st_size for name in SMALL_FILES}
    metadata = dcp.FileSystemReader(directory / TRAINING_STATE_DIR).read_metadata()
    for piece in metadata.storage_data.values():
        name = f"{TRAINING_STATE_DIR}/{piece.relative_path}"
        sizes[name] = max(sizes.get(name, 0), piece.offset + piece.length)
    return sizes


def write_marker(directory: Path, step: int, files: dict[str, int]) -> None:
    (directory / MARKER).write_text(json.dumps({"step": step, "files": files}, indent=2, sort_keys=True))




class CheckpointError(ValueError):
    """A checkpoint file that cannot be used (truncated, foreign, or from another run layout); names the file."""


def load_file(path: Path, expected_keys: tuple[str, ...], **kwargs) -> dict:
    """torch.load that names the file when it is missing, truncated, or not what this code wrote."""
    try:
        data = torch.load(path, weights_only=True, **kwargs)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing from the checkpoint") from None
    except Exception as err:  # noqa: BLE001 - torch raises RuntimeError, EOFError, UnpicklingError, ... for a bad file
        raise CheckpointError(f"{path}: cannot be read, truncated or not a torch file "
                              f"({type(err).__name__}: {str(err)[:200]})") from None
    missing = [k for k in expected_keys if not isinstance(data, dict) or k not in data]
    if missing:
        found = sorted(map(str, data))[:8] if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(f"{path}: not a file this code wrote (keys {missing} missing; found {found})")
    return data


def read_trainer_state(directory: str | Path) -> TrainerState:
    """The trainer state of a checkpoint (a local path or a bucket prefix)."""
    location = storage.join(str(directory), "trainer_state.json")
    try:
        return TrainerState(**json.loads(read_text(location)))
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"{location}: cannot be read ({type(err).__name__}: {err})") from None


def check_data_position(state: TrainerState, directory: str, num_streams: int, global_batch_rows: int) -> None:
    """A checkpoint continues only the data order it was written in: the same shard count and global batch."""
    if (state.num_streams, state.global_batch_rows) != (num_streams, global_batch_rows):
        raise ValueError(
            f"checkpoint {directory} was written with {state.num_streams} train shards and a global batch of "
            f"{state.global_batch_rows} rows, this run has {num_streams} shards and {global_batch_rows} rows "
            "(world_batch_size): its data position does not carry over")


def read_tensors(directory: str | Path, model, optimizer, replicas=None) -> None:
    """Load model and optimizer in place from the checkpoint's DCP state (a local path or a bucket prefix: ranged
    reads of the pieces this rank reads, never a download of the checkpoint), whatever layout wrote it (DCP reads
    the pieces of each tensor this rank holds). A collective: every rank calls it; a failure on any rank raises
    CheckpointError on every rank.

    `replicas`: the process group of the ranks that hold the same part of the state as this one (the mesh's
    "replicate" dimension). With it, each of them reads one contiguous 1/R of the stored bytes the group needs
    and the replicas complete each other in rounds of all-gather (huginn_ray.train.replica_read.read_dcp): the
    file system serves the state once, not once per replica. Without it (one process), this rank reads its whole
    part through DCP's load."""
    tensors = {"model": model_state(model), "optim": get_optimizer_state_dict(model, optimizer)}
    state_dir = storage.join(str(directory), TRAINING_STATE_DIR)
    try:
        with_retries(f"reading {state_dir}",
                     lambda: dcp.load(tensors, storage_reader=replica_read.counting_reader(state_dir))
                     if replicas is None else replica_read.read_dcp(state_dir, tensors, replicas))
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP's errors: missing file, short read, shape
        raise CheckpointError(f"{state_dir}: cannot be loaded into this model and optimizer "
                              f"({describe_error(err)[:600]})") from None
    set_optimizer_state_dict(model, optimizer, tensors["optim"])


@dataclass
class Resumed:
    state: TrainerState
    directory: str
    """The checkpoint the run resumed from (a location: huginn_ray.storage)."""


def checkpoint_location(checkpoint) -> str:
    """Where a Ray Train checkpoint is, as a location: its `.path` is a path inside its `.filesystem` (pyarrow):
    `s3://` + path on S3, `gs://` + path on GCS, the path itself on the local file system."""
    prefixes = {"s3": "s3://", "gcs": "gs://", "local": ""}
    kind = checkpoint.filesystem.type_name
    if kind not in prefixes:
        raise storage.StorageError(f"{checkpoint.path}: Ray Train's checkpoint is on a {kind} file system; "
                                   f"out_dir is a local path or an s3:// or gs:// URI")
    return prefixes[kind] + checkpoint.path


def resume(registered: str | Path | None, run_dir: str | Path, rank: int, model, optimizer, device,
           log=None, replicas=None) -> Resumed | None:
    """Load the newest checkpoint that is complete and loads on every rank; None when there is none to resume.
    Checkpoints and `run_dir` are locations (local paths or a bucket's prefixes: huginn_ray.storage).

    Candidates: `registered` (Ray Train's latest, `ray.train.get_checkpoint()`) first, then the other
    `checkpoint_*` directories under `run_dir` with a step up to its step, newest first: rank 0 lists them and
    sends the list to every rank. Each rank checks its share of a candidate's files (`incomplete`); when a share
    fails, every rank checks every file (so that all see the first failure, as the old full check did). A
    candidate that is incomplete, or whose load raises CheckpointError on any rank (the ranks agree by an
    all-reduce of the failing ranks' count, then, on a failure only, gather every rank's reason), is skipped with
    one message naming it and why (the ranks only when not every rank gave that reason). When none
    loads, raises CheckpointError naming every candidate tried, unless none of them ever was a checkpoint
    (Ray registered none and no marker vouches for its files: saves that did not finish), in which case the
    run starts from step 0 after saying so. Call on every rank; `replicas`: see `read_tensors`."""
    log = log or (lambda message: print(message, flush=True))
    ranks = world_size()
    candidates = from_rank0(resume_candidates(registered, run_dir) if rank == 0 else None, device)
    skipped, was_complete = [], registered is not None
    for directory in candidates:
        # every rank decides from every rank's outcome, so all take the same branch (a shared file system may show
        # one node a file that another does not see yet), and all enter DCP's collective load together
        complete, why, state = check_candidate(directory, rank, ranks)
        incomplete_ranks, failed = count_ranks([not complete, why is not None], device)
        was_complete = was_complete or incomplete_ranks == 0
        if incomplete_ranks and ranks > 1:
            # a rank's share has a missing or short file: on this path only, every rank checks every file, so
            # that each names the first failure as it sees it (a file that only some ranks miss names them)
            complete, why, state = check_candidate(directory, 0, 1)
            failed, = count_ranks([why is not None], device)
        if not failed:
            try:
                read_tensors(directory, model, optimizer, replicas)
            except CheckpointError as err:
                why = str(err)
            failed, = count_ranks([why is not None], device)
        if not failed:
            if rank == 0:
                log(f"[huginn] resumed from {directory} at step {state.step}")
            return Resumed(state, directory)
        failures = [(r, reason) for r, reason in enumerate(all_ranks(why, device)) if reason is not None]
        skipped.append(f"{directory} ({describe(failures, ranks)})")
        if rank == 0:
            log(f"[huginn] skipping checkpoint {skipped[-1]}")
    if was_complete:
        raise CheckpointError(f"no checkpoint of {run_dir} can be resumed from; tried, newest first: "
                              + "; ".join(skipped) + ". Move them away (or pick another run_name) to start over")
    if skipped and rank == 0:
        log(f"[huginn] no finished checkpoint in {run_dir} (only unfinished saves): starting at step 0")
    return None


def check_candidate(directory: str, part: int, parts: int) -> tuple[bool, str | None, TrainerState | None]:
    """(complete, why not usable, trainer state) of a resume candidate, checking share `part` of `parts` of the
    marker's files (`incomplete`); a complete one whose trainer state cannot be read is not usable."""
    why, state = incomplete(directory, part, parts), None
    complete = why is None
    if complete:
        try:
            state = read_trainer_state(directory)
        except CheckpointError as err:
            why = str(err)
    return complete, why, state


def resume_candidates(registered: str | Path | None, run_dir: str | Path) -> list[str]:
    """`registered` first, then the other checkpoint directories of the run, newest step first (ties: newest
    name; Ray names them by time). Without a registered checkpoint, every directory; with one, those whose
    step is not above its step (a newer directory is a save Ray never registered). A directory without a
    readable trainer_state.json comes last: it is incomplete, and the message will say so. All as locations."""
    def step_of(directory: str) -> int | None:
        try:
            return int(json.loads(read_text(storage.join(directory, "trainer_state.json")))["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    registered = str(registered) if registered is not None else None
    newest = step_of(registered) if registered is not None else None
    others = [d for d in checkpoint_directories(str(run_dir))
              if registered is None or not same_location(d, registered)]
    steps = {d: step_of(d) for d in others}
    ordered = sorted((d for d in others if steps[d] is not None and (newest is None or steps[d] <= newest)),
                     key=lambda d: (steps[d], d.rstrip("/").rsplit("/", 1)[-1]), reverse=True)
    unordered = [d for d in others if steps[d] is None]
    return ([registered] if registered is not None else []) + ordered + unordered


def checkpoint_directories(run_dir: str) -> list[str]:
    """The `checkpoint_*` directories of a run directory (on a bucket: its `checkpoint_*/` prefixes), sorted."""
    if not storage.is_uri(run_dir):
        return sorted(str(p) for p in Path(run_dir).glob("checkpoint_*") if p.is_dir())
    fs, path = storage.filesystem(run_dir)
    found = fs.get_file_info(pafs.FileSelector(path, recursive=False, allow_not_found=True))
    return sorted(storage.join(run_dir, info.base_name) for info in found
                  if info.type == pafs.FileType.Directory and info.base_name.startswith("checkpoint_"))


def same_location(a: str, b: str) -> bool:
    """The same checkpoint: local paths compared with their links resolved, URIs as written."""
    if storage.is_uri(a) or storage.is_uri(b):
        return a.rstrip("/") == b.rstrip("/")
    return Path(a).resolve() == Path(b).resolve()


def describe(failures: list[tuple[int, str]], ranks_asked: int) -> str:
    """The ranks' reasons, each once: `reason` when every rank gave it, else `rank r, s: reason`."""
    by_reason: dict[str, list[int]] = {}
    for rank, reason in failures:
        by_reason.setdefault(reason, []).append(rank)
    return "; ".join(reason if len(ranks) == ranks_asked else f"rank {', '.join(map(str, ranks))}: {reason}"
                     for reason, ranks in by_reason.items())
