"""Save and load models in the Hugging Face layout: `model.safetensors` + `config.json`; load a training
checkpoint's model the same way (its `model/config.json` beside the DCP `state/` that holds the weights).

Loading reads safetensors only (never pickle), so a checkpoint from an untrusted source cannot run code.
A tied `lm_head.weight` is not stored twice: like `transformers`, the file holds `transformer.wte.weight`
and the head is re-tied on load.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from huginn_ray.model.config import ModelConfig
from huginn_ray.model.model import RecurrentGPT, rope_table

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
TRAINING_STATE_DIR = "state"
"""A training checkpoint's torch.distributed.checkpoint directory, beside its `model/` (huginn_ray.train.checkpoint)."""


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


def resolve_model_dir(path: str | Path) -> Path:
    """The model directory (config.json + weights) of `path`: the directory itself, the `model/` of a training
    checkpoint, or the newest checkpoint's `model/` under a training output directory."""
    path = Path(path)
    for candidate in (path, path / "model"):
        if (candidate / CONFIG_NAME).is_file():
            return candidate
    found = sorted(path.glob(f"**/model/{CONFIG_NAME}"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise ValueError(f"no model ({CONFIG_NAME} + {WEIGHTS_NAME}) in or under {path}")
    return found[-1].parent


def _weight_files(directory: Path) -> list[Path]:
    """model.safetensors, or the shards named by model.safetensors.index.json (the released layout)."""
    if (directory / WEIGHTS_NAME).is_file():
        return [directory / WEIGHTS_NAME]
    index = directory / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    raise ValueError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {directory}")


def _training_state(directory: Path) -> Path | None:
    """The DCP directory of a training checkpoint whose `model/` is `directory`, if it is one."""
    state = directory.parent / TRAINING_STATE_DIR
    return state if directory.name == "model" and (state / ".metadata").is_file() else None


def _load_training_checkpoint(state_dir: Path, config: ModelConfig, device, dtype) -> RecurrentGPT:
    """The model of a training checkpoint, read by this one process from the pieces every rank wrote (any
    layout: replicate or hsdp, any world size); the optimizer state is not read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with torch.device("meta"):
        model = RecurrentGPT(config)
    model.to_empty(device=device)
    model.freqs_cis = rope_table(config.head_dim, config.block_size, config.rope_base).to(device)
    if config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    tensors = {key: value for key, value in model.state_dict().items()
               if not (config.tie_embeddings and key == "lm_head.weight")}
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the point here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": tensors}, storage_reader=dcp.FileSystemReader(state_dir), no_dist=True)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP wraps the file system's and planner's errors
        failures = getattr(err, "failures", {0: (err, None)})
        raise ValueError(f"{state_dir}: the training checkpoint's model cannot be read ("
                         + "; ".join(f"{type(e).__name__}: {e}" for e, _ in failures.values())[:400] + ")") from None
    if dtype is not None:
        model.to(dtype)
        model.freqs_cis = model.freqs_cis.float()
    return model


def load_pretrained(directory: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = torch.float32) -> RecurrentGPT:
    """Load a directory written by save_pretrained or the export, the released Huginn-0125 layout
    (config.json with the released keys, safetensors shards with an index), or a training checkpoint's `model/`. Weights are cast to `dtype`
    (None keeps the stored dtype); the RoPE table is recomputed in fp32 when the file has none or a rounded one."""
    directory = Path(directory)
    config = ModelConfig.from_json(directory / CONFIG_NAME)
    if (state_dir := _training_state(directory)) is not None:
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


def _atomic_write(target: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
