"""Save and load models in the Hugging Face layout: `model.safetensors` + `config.json`.

Loading reads safetensors only (never pickle), so a checkpoint from an untrusted source cannot run code.
A tied `lm_head.weight` is not stored twice: like `transformers`, the file holds `transformer.wte.weight`
and the head is re-tied on load.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from huginn_ray.model.config import ModelConfig
from huginn_ray.model.model import RecurrentGPT

WEIGHTS_NAME = "model.safetensors"
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


def load_pretrained(directory: str | Path, device: str | torch.device = "cpu") -> RecurrentGPT:
    directory = Path(directory)
    config = ModelConfig.from_json(directory / CONFIG_NAME)
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise ValueError(f"no {WEIGHTS_NAME} in {directory}")
    try:
        state_dict = load_file(weights, device=str(device))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{weights} is not a readable safetensors file: {err}") from None
    if config.tie_embeddings and "lm_head.weight" not in state_dict and "transformer.wte.weight" in state_dict:
        state_dict["lm_head.weight"] = state_dict["transformer.wte.weight"]
    with torch.device("meta"):
        model = RecurrentGPT(config)
    try:
        model.load_state_dict(state_dict, strict=True, assign=True)
    except ValueError as err:
        raise ValueError(f"{weights}: {err}") from None
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
