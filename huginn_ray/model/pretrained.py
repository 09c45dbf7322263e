"""Save and load models in the Hugging Face layout: `model.safetensors` + `config.json`; load a training
checkpoint's model the same way (its `model/config.json` beside the DCP `state/` that holds the weights).

Loading reads safetensors only (never pickle), so a checkpoint from an untrusted source cannot run code.
A tied `lm_head.weight` is not stored twice: like `transformers`, the file holds `transformer.wte.weight`
and the head is re-tied on load.

Here a model directory is read by one process. Loading one into a training model whose ranks each hold a part of
it, the replicas of a part dividing the reads, is training's (huginn_ray.train.init_from.load_weights_into).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from huginn_ray.checkpoint_layout import TRAINING_STATE_DIR, incomplete
from huginn_ray.config import ConfigError
from huginn_ray.model.config import ModelConfig
from huginn_ray.model.attention import rope_table
from huginn_ray.model.model import RecurrentGPT

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"


def save_pretrained(model: RecurrentGPT, directory: str | Path) -> Path:
    """Write config.json and model.safetensors into `directory` (created if needed); each file appears
    complete or not at all."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {key: value.detach().cpu().contiguous() for key, value in model.state_dict().items()}
    if model.config.tie_embeddings:
        del tensors["lm_head.weight"]
    _atomic_write(directory / WEIGHTS_NAME, lambda path: save_file(tensors, path, metadata={"format": "pt"}))
    _atomic_write(directory / CONFIG_NAME, lambda path: model.config.to_json(path))
    return directory


def resolve_model_dir(path: str | Path, purpose: str = "--checkpoint", log=None) -> Path:
    """The model directory (config.json + weights) that `path` names: a model directory, a training checkpoint
    (or its `model/`), or the newest complete checkpoint under a training output directory (newest: its model's
    config.json was written last). A training checkpoint is taken only when complete (its marker lists every file
    with its size: huginn_ray.checkpoint_layout.incomplete); errors start with `purpose` (the option or key that
    gave the path), and `log` gets a line naming the checkpoint taken from an output directory and every newer one
    skipped, with why."""
    path = Path(path)
    for candidate in (path, path / "model"):
        if (candidate / CONFIG_NAME).is_file():
            checkpoint = _checkpoint_of(candidate)
            if checkpoint is not None and (why := incomplete(checkpoint)) is not None:
                raise ConfigError(f"{purpose}: {checkpoint} is not a complete checkpoint: {why}")
            return candidate
    found = sorted(path.glob(f"**/model/{CONFIG_NAME}"), key=lambda p: p.stat().st_mtime, reverse=True)
    if not found:
        raise ConfigError(f"{purpose}: no model ({CONFIG_NAME} + {WEIGHTS_NAME}) in or under {path}")
    skipped = []
    for config in found:
        checkpoint = _checkpoint_of(config.parent)
        why = incomplete(checkpoint) if checkpoint is not None else None
        if why is None:
            if log is not None:
                log(f"[huginn] {purpose}: {checkpoint or config.parent}, the newest complete checkpoint under {path}"
                    + (f"; skipped {'; '.join(skipped)}" if skipped else ""))
            return config.parent
        skipped.append(f"{checkpoint} ({why})")
    raise ConfigError(f"{purpose}: no complete checkpoint under {path}: {'; '.join(skipped)}")


def _checkpoint_of(model_dir: Path) -> Path | None:
    """The training checkpoint whose `model/` is `model_dir` (it has the DCP `state/` beside), or None."""
    return model_dir.parent if model_dir.name == "model" and (model_dir.parent / TRAINING_STATE_DIR).is_dir() else None


def _weight_files(directory: Path) -> list[Path]:
    """model.safetensors, or the shards named by model.safetensors.index.json (the released layout)."""
    if (directory / WEIGHTS_NAME).is_file():
        return [directory / WEIGHTS_NAME]
    index = directory / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    raise ValueError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {directory}")


def training_state(directory: Path) -> Path | None:
    """The DCP directory of a training checkpoint whose `model/` is `directory`, if it is one."""
    state = directory.parent / TRAINING_STATE_DIR
    return state if directory.name == "model" and (state / ".metadata").is_file() else None


def _load_training_checkpoint(state_dir: Path, config: ModelConfig, device, dtype) -> RecurrentGPT:
    """The model of a training checkpoint, read by this one process from the pieces every rank wrote (any
    layout: replicate or hsdp, any world size); the optimizer state is not read."""
    with torch.device("meta"):
        model = RecurrentGPT(config)
    model.allocate(device)
    tensors = {key: value for key, value in model.state_dict().items()
               if not (config.tie_embeddings and key == "lm_head.weight")}
    _read_checkpoint_model(state_dir, tensors)
    if dtype is not None:
        model.to(dtype)
        model.freqs_cis = model.freqs_cis.float()
    return model


def _read_checkpoint_model(state_dir: Path, tensors: dict) -> None:
    """Read a training checkpoint's model tensors in place into `tensors` (name -> tensor), by this one process."""
    import torch.distributed.checkpoint as dcp

    with reading_checkpoint_model(state_dir):
        dcp.load({"model": tensors}, storage_reader=dcp.FileSystemReader(state_dir), no_dist=True)


@contextmanager
def reading_checkpoint_model(state_dir: Path):
    """Around a read of a training checkpoint's model (by one process, or by every rank: huginn_ray.train.init_from):
    its failure becomes one ValueError naming `state_dir` and each failing rank's error (DCP wraps the file system's
    and planner's errors); DCP's warning that it reads in one process, which is the point of a one-process read, is
    silenced."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP wraps the file system's and planner's errors
        failures = getattr(err, "failures", {0: (err, None)})
        raise ValueError(f"{state_dir}: the training checkpoint's model cannot be read ("
                         + "; ".join(f"{type(e).__name__}: {e}" for e, _ in failures.values())[:400] + ")") from None


def load_pretrained(directory: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = torch.float32) -> RecurrentGPT:
    """Load a directory written by save_pretrained or the export, the released Huginn-0125 layout
    (config.json with the released keys, safetensors shards with an index), or a training checkpoint's `model/`. Weights are cast to `dtype`
    (None keeps the stored dtype); the RoPE table is recomputed in fp32 when the file has none or a rounded one."""
    directory = Path(directory)
    config = ModelConfig.from_json(directory / CONFIG_NAME)
    if (state_dir := training_state(directory)) is not None:
        return _load_training_checkpoint(state_dir, config, device, dtype)
    state_dict = {}
    for weights in _weight_files(directory):
        try:
            state_dict.update(load_file(weights, device=str(device)))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{weights} is not a readable safetensors file: {err}") from None
    for key, tensor in state_dict.items():
        if dtype is not None and tensor.is_floating_point() and key != "freqs_cis":
            state_dict[key] = tensor.to(dtype)
    if state_dict.get("freqs_cis") is None or state_dict["freqs_cis"].dtype != torch.float32:
        state_dict["freqs_cis"] = rope_table(config.head_dim, config.block_size, config.rope_base).to(device)
    if config.tie_embeddings and "transformer.wte.weight" in state_dict:
        state_dict["lm_head.weight"] = state_dict["transformer.wte.weight"]
    with torch.device("meta"):
        model = RecurrentGPT(config)
    try:
        model.load_state_dict(state_dict, strict=True, assign=True)
    except ValueError as err:
        raise ValueError(f"{directory}: {err}") from None
    if config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    return model


def check_weights(directory: str | Path, config: ModelConfig) -> None:
    """Raise ValueError unless `directory` holds every parameter of a model of `config` with its shape, reading
    only the files' headers (the safetensors headers, a training checkpoint's DCP metadata)."""
    directory = Path(directory)
    with torch.device("meta"):
        shapes = {key: list(p.shape) for key, p in RecurrentGPT(config).named_parameters()}
    if (state_dir := training_state(directory)) is not None:
        import torch.distributed.checkpoint as dcp

        metadata = dcp.FileSystemReader(state_dir).read_metadata().state_dict_metadata
        stored = {key.removeprefix("model."): list(getattr(meta, "size", [])) for key, meta in metadata.items()
                  if key.startswith("model.")}
        where = state_dir
    else:
        stored = {key: tensor.shape for key, tensor in tensor_locations(directory).items()}
        where = directory
    missing = sorted(set(shapes) - set(stored))
    if missing:
        raise ValueError(f"{where}: no {', '.join(missing[:5])} (the model of its {CONFIG_NAME} has them)")
    for key, shape in shapes.items():
        if stored[key] != shape:
            raise ValueError(f"{where}: {key} has shape {stored[key]}, the model of its {CONFIG_NAME} has {shape}")


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor of a safetensors model directory is stored."""

    file: Path
    shape: list[int]


def open_weights(file: Path):
    """A safetensors file of a model directory, opened on the host for its tensors and slices (memory-mapped; the
    format holds no code to run)."""
    return safe_open(str(file), framework="pt", device="cpu")


def tensor_locations(directory: Path) -> dict[str, StoredTensor]:
    """Every stored tensor's name -> the safetensors file that holds it, and its shape (the files' headers)."""
    location = {}
    for file in _weight_files(directory):
        try:
            with open_weights(file) as f:
                location.update({key: StoredTensor(file, list(f.get_slice(key).get_shape())) for key in f.keys()})
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{file} is not a readable safetensors file: {err}") from None
    return location


def weights_digest(directory: str | Path) -> tuple[str, str]:
    """(what was hashed, its sha256): the sha256 of the model's weights themselves, tensor by tensor in name order
    (each tensor's name, dtype and shape, then its bytes), read one tensor at a time: from the safetensors files
    (one or the shards of an index; a tied head and the RoPE table are left out) or from a training checkpoint's
    DCP state (whatever layout wrote it). The same tensors give the same digest in either layout."""
    directory = Path(directory)
    digest = hashlib.sha256()

    def add(name: str, tensor: torch.Tensor) -> None:
        digest.update(f"{name} {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}\n".encode())
        digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())

    if (state_dir := training_state(directory)) is not None:
        import torch.distributed.checkpoint as dcp

        metadata = dcp.FileSystemReader(state_dir).read_metadata().state_dict_metadata
        names = sorted(key.removeprefix("model.") for key in metadata
                       if key.startswith("model.") and key != "model.freqs_cis")
        for name in names:
            meta = metadata[f"model.{name}"]
            tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
            _read_checkpoint_model(state_dir, {name: tensor})
            add(name, tensor)
        return f"{len(names)} tensors of {state_dir}", digest.hexdigest()
    tied = ModelConfig.from_json(directory / CONFIG_NAME).tie_embeddings
    location = tensor_locations(directory)
    names = sorted(key for key in location if key != "freqs_cis" and not (tied and key == "lm_head.weight"))
    for name in names:
        with open_weights(location[name].file) as f:
            add(name, f.get_tensor(name))
    files = sorted({location[name].file.name for name in names})
    return f"{len(names)} tensors of {directory} ({', '.join(files)})", digest.hexdigest()


def _atomic_write(target: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
