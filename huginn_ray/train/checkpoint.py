"""What a checkpoint holds, and how a worker writes and reads its part.

Every worker reports one directory to Ray Train, which merges them into one checkpoint directory:

    model/model.safetensors, model/config.json   the model in the Hugging Face layout (rank 0)
    optimizer.pt                                 optimizer state, identical on every rank (rank 0; unsharded)
    optimizer_shard_{l:05d}_of_{S:05d}.pt        with optim.sharding=node: local rank l's shard, written by the
                                                 ranks of node 0 (every node holds the same shards); read by
                                                 every rank with local rank l, whatever the number of nodes
    trainer_state.json                           step, tokens seen, MLflow run id, world size (rank 0)
    rank_{r:05d}.pt                              rank r's reader state and RNG states (every rank)
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

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


def write(directory: Path, rank: int, model, optimizer, state: TrainerState, reader_state: dict, device) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    sharding = getattr(optimizer, "sharding", None)
    if rank == 0:
        save_pretrained(model, directory / "model")
        if sharding is None:
            torch.save(optimizer.state_dict(), directory / "optimizer.pt")
        (directory / "trainer_state.json").write_text(json.dumps(asdict(state), indent=2))
    if sharding is not None and rank < sharding.layout.node_size:  # node 0 writes every shard once
        torch.save(optimizer.state_dict(), directory / shard_file(rank, sharding.layout.node_size))
    torch.save({"reader": reader_state, "rng": rng_states(device)}, directory / rank_file(rank))


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
    """Load model and optimizer in place, restore the RNGs; returns the trainer state and the reader state."""
    state = TrainerState(**json.loads((directory / "trainer_state.json").read_text()))
    if state.world_size != world_size:
        raise ValueError(
            f"checkpoint {directory} was written by {state.world_size} ranks, this run has {world_size}: "
            "the per-rank reader states do not carry over"
        )
    model.load_state_dict(load_pretrained(directory / "model", device=device).state_dict())
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
