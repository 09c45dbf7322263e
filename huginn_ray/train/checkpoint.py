"""What a checkpoint holds, and how a worker writes and reads its part.

Every worker reports one directory to Ray Train, which merges them into one checkpoint directory:

    model/model.safetensors, model/config.json   the model in the Hugging Face layout (rank 0)
    optimizer.pt                                 optimizer state, identical on every rank (rank 0; unsharded)
    optimizer_shard_{l:05d}_of_{S:05d}.pt        with optim.sharding=node: local rank l's shard, written by the
                                                 ranks of node 0 (every node holds the same shards); read by
                                                 every rank with local rank l, whatever the number of nodes
    trainer_state.json                           step, tokens seen, MLflow run id, world size (rank 0)
    rank_{r:05d}.pt                              rank r's reader state and RNG states (every rank)
    checkpoint_complete.json                     every file above of every rank with its size in bytes, and
                                                 the step (rank 0, written last, after gathering every
                                                 rank's list)

A directory is complete when its marker is readable and every file it lists is there with the listed size:
ranks upload their parts independently (README, "What is atomic"), so a directory with no marker, a missing or
truncated file is a save that did not finish, and `resume` passes over it to the previous checkpoint.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from huginn_ray.model import load_pretrained, save_pretrained


@dataclass
class TrainerState:
    step: int = 0
    """Optimizer steps done."""
    tokens: int = 0
    """Tokens trained on, all ranks together."""
    mlflow_run_id: str | None = None
    """The MLflow run this training run logs to."""
    world_size: int = 0
    """Ranks that wrote the checkpoint."""


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def rng_states(device: torch.device) -> dict:
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


def shard_file(local_rank: int, node_size: int) -> str:
    return f"optimizer_shard_{local_rank:05d}_of_{node_size:05d}.pt"


MARKER = "checkpoint_complete.json"


def write(directory: Path, rank: int, model, optimizer, state: TrainerState, reader_state: dict, device) -> None:
    """Write this rank's files, then (rank 0) the marker listing every rank's files. Every rank calls it: the
    file lists travel in one collective (without a process group, one process: this rank's files alone)."""
    files = write_rank_files(directory, rank, model, optimizer, state, reader_state, device)
    every_rank = all_ranks(files, device)
    if rank == 0:
        write_marker(directory, state.step, every_rank)


def write_rank_files(directory: Path, rank: int, model, optimizer, state: TrainerState, reader_state: dict,
                     device) -> dict[str, int]:
    """This rank's part of the checkpoint; returns its files (relative paths) and their sizes in bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    sharding = getattr(optimizer, "sharding", None)
    names = [rank_file(rank)]
    if rank == 0:
        save_pretrained(model, directory / "model")
        names += ["model/model.safetensors", "model/config.json", "trainer_state.json"]
        if sharding is None:
            torch.save(optimizer.state_dict(), directory / "optimizer.pt")
            names.append("optimizer.pt")
        (directory / "trainer_state.json").write_text(json.dumps(asdict(state), indent=2))
    if sharding is not None and rank < sharding.layout.node_size:  # node 0 writes every shard once
        torch.save(optimizer.state_dict(), directory / shard_file(rank, sharding.layout.node_size))
        names.append(shard_file(rank, sharding.layout.node_size))
    torch.save({"reader": reader_state, "rng": rng_states(device)}, directory / rank_file(rank))
    return {name: (directory / name).stat().st_size for name in names}


def write_marker(directory: Path, step: int, files_of_every_rank: list[dict[str, int]]) -> None:
    files = {name: size for files in files_of_every_rank for name, size in files.items()}
    (directory / MARKER).write_text(json.dumps({"step": step, "files": files}, indent=2, sort_keys=True))


def all_ranks(value, device) -> list:
    """`value` (anything JSON can hold) of every rank, in rank order: one all-gather of its JSON bytes on the
    training device (NCCL needs device tensors, and torch's object collectives pick the device by
    torch.cuda.current_device(), which nothing here sets). Without a process group: this process's value."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    data = json.dumps(value).encode()
    world_size = dist.get_world_size()
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64, device=device))
    lengths = [int(length.item()) for length in lengths]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty(max(lengths), dtype=torch.uint8, device=device) for _ in range(world_size)]
    dist.all_gather(gathered, padded.to(device))
    return [json.loads(bytes(g[:n].cpu().tolist())) for g, n in zip(gathered, lengths)]


def incomplete(directory: Path) -> str | None:
    """Why `directory` is not a complete checkpoint (no or unreadable marker, a listed file missing or of
    another size), or None when it is complete."""
    try:
        listing = json.loads((directory / MARKER).read_text())
        files, step = listing["files"], listing["step"]
        if not (isinstance(files, dict) and isinstance(step, int)):
            raise ValueError("'files' is not a mapping or 'step' not an integer")
    except FileNotFoundError:
        return f"no {MARKER}: the save did not finish"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MARKER} cannot be read ({type(err).__name__}: {err})"
    for name, size in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            return f"{name} is missing ({MARKER} lists it with {size} bytes)"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {MARKER} lists {size}: truncated or rewritten"
    return None


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


def read(directory: Path, rank: int, world_size: int, model, optimizer, device) -> tuple[TrainerState, dict]:
    """Load model and optimizer in place, restore the RNGs; returns the trainer state and the reader state.
    A file that cannot be read raises CheckpointError naming it; a checkpoint of another layout, ValueError."""
    try:
        state = TrainerState(**json.loads((directory / "trainer_state.json").read_text()))
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"{directory / 'trainer_state.json'}: cannot be read "
                              f"({type(err).__name__}: {err})") from None
    if state.world_size != world_size:
        raise ValueError(
            f"checkpoint {directory} was written by {state.world_size} ranks, this run has {world_size}: "
            "the per-rank reader states do not carry over"
        )
    try:
        model.load_state_dict(load_pretrained(directory / "model", device=device).state_dict())
    except (OSError, ValueError, RuntimeError) as err:  # load_pretrained names the file; RuntimeError: another shape
        raise CheckpointError(f"{directory / 'model'}: cannot be loaded into this model ({str(err)[:300]})") from None
    read_optimizer(directory, optimizer, device)
    per_rank = load_file(directory / rank_file(rank), ("reader", "rng"))
    set_rng_states(per_rank["rng"], device)
    return state, per_rank["reader"]


def read_optimizer(directory: Path, optimizer, device) -> None:
    """Load the optimizer state this rank needs: the whole state, or its local rank's shard only."""
    sharding = getattr(optimizer, "sharding", None)
    shards = sorted(directory.glob("optimizer_shard_*_of_*.pt"))
    if sharding is None:
        if shards:
            raise ValueError(f"checkpoint {directory} holds an optimizer sharded over nodes (optim.sharding=node, "
                             f"{shards[0].name}); this run has optim.sharding=none")
        load_optimizer_file(directory / "optimizer.pt", ("state", "param_groups"), optimizer, device)
        return
    node_size = sharding.layout.node_size
    path = directory / shard_file(sharding.layout.local_rank, node_size)
    if not path.is_file():
        if not shards:
            raise ValueError(f"checkpoint {directory} holds an unsharded optimizer (optim.sharding=none); this run "
                             f"has optim.sharding=node")
        written = int(shards[0].stem.rsplit("_of_", 1)[1])
        raise ValueError(f"checkpoint {directory} was written with node_size={written} (optimizer shards per node), "
                         f"this run has node_size={node_size}: the optimizer shards do not carry over")
    load_optimizer_file(path, ("shard", "node_size", "local_rank", "owners"), optimizer, device)


def load_optimizer_file(path: Path, expected_keys: tuple[str, ...], optimizer, device) -> None:
    try:
        optimizer.load_state_dict(load_file(path, expected_keys, map_location=device))
    except CheckpointError:
        raise
    except (ValueError, KeyError, RuntimeError) as err:
        raise CheckpointError(f"{path}: does not fit this model's optimizer ({err})") from None


@dataclass
class Resumed:
    state: TrainerState
    reader_state: dict
    """This rank's reader state (ShardReader.load_state_dict)."""
    directory: Path
    """The checkpoint the run resumed from."""


def resume(registered: Path | None, run_dir: Path, rank: int, world_size: int, model, optimizer, device,
           log=None) -> Resumed | None:
    """Load the newest checkpoint that is complete and loads on every rank; None when there is none to resume.

    Candidates: `registered` (Ray Train's latest, `ray.train.get_checkpoint()`) first, then the other
    `checkpoint_*` directories under `run_dir` with a step up to its step, newest first. Rank 0's list is the
    one every rank walks. A candidate that is incomplete, or whose load raises CheckpointError on any rank (the
    ranks agree in one all-gather per candidate), is skipped with one message naming it and why. When none
    loads, raises CheckpointError naming every candidate tried, unless none of them ever was a checkpoint
    (Ray registered none and no marker vouches for its files: saves that did not finish), in which case the
    run starts from step 0 after saying so. Call on every rank."""
    log = log or (lambda message: print(message, flush=True))
    candidates = all_ranks([str(path) for path in resume_candidates(registered, run_dir)], device)[0]
    skipped, was_complete = [], registered is not None
    for directory in map(Path, candidates):
        why = incomplete(directory)
        complete = why is None
        if complete:
            try:
                state, reader_state = read(directory, rank, world_size, model, optimizer, device)
            except CheckpointError as err:
                why = str(err)
        # every rank decides from every rank's outcome, so all take the same branch (a shared file system may
        # show one node a file that another does not see yet)
        outcomes = all_ranks({"complete": complete, "why": why}, device)
        was_complete = was_complete or any(outcome["complete"] for outcome in outcomes)
        failures = [(r, outcome["why"]) for r, outcome in enumerate(outcomes) if outcome["why"] is not None]
        if not failures:
            if rank == 0:
                log(f"[huginn] resumed from {directory} at step {state.step}")
            return Resumed(state, reader_state, directory)
        skipped.append(f"{directory} ({describe(failures, len(outcomes))})")
        if rank == 0:
            log(f"[huginn] skipping checkpoint {skipped[-1]}")
    if was_complete:
        raise CheckpointError(f"no checkpoint of {run_dir} can be resumed from; tried, newest first: "
                              + "; ".join(skipped) + ". Move them away (or pick another run_name) to start over")
    if skipped and rank == 0:
        log(f"[huginn] no finished checkpoint in {run_dir} (only unfinished saves): starting at step 0")
    return None


def resume_candidates(registered: Path | None, run_dir: Path) -> list[Path]:
    """`registered` first, then the other checkpoint directories of the run, newest step first (ties: newest
    name; Ray names them by time). Without a registered checkpoint, every directory; with one, those whose
    step is not above its step (a newer directory is a save Ray never registered). A directory without a
    readable trainer_state.json comes last: it is incomplete, and the message will say so."""
    def step_of(directory: Path) -> int | None:
        try:
            return int(json.loads((directory / "trainer_state.json").read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    newest = step_of(registered) if registered is not None else None
    others = [p for p in sorted(run_dir.glob("checkpoint_*")) if p.is_dir()
              and (registered is None or p.resolve() != registered.resolve())]
    steps = {p: step_of(p) for p in others}
    ordered = sorted((p for p in others if steps[p] is not None and (newest is None or steps[p] <= newest)),
                     key=lambda p: (steps[p], p.name), reverse=True)
    unordered = [p for p in others if steps[p] is None]
    return ([registered] if registered is not None else []) + ordered + unordered


def describe(failures: list[tuple[int, str]], ranks_asked: int) -> str:
    """The ranks' reasons, each once: `reason` when every rank gave it, else `rank r, s: reason`."""
    by_reason: dict[str, list[int]] = {}
    for rank, reason in failures:
        by_reason.setdefault(reason, []).append(rank)
    return "; ".join(reason if len(ranks) == ranks_asked else f"rank {', '.join(map(str, ranks))}: {reason}"
                     for reason, ranks in by_reason.items())
