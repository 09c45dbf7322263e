"""Where and in what precision a trained model runs at test time (generation, depth scaling, lm-eval, GSM8k).

    placement = inference_placement(device=None, dtype=None)   # the accelerator and bf16 when one is present
    model, backend = load_for_inference(model_dir, placement)

`device` is `cpu` or `cuda[:N]` (ROCm's torch answers to `cuda` too); `dtype` is `float32` or `bfloat16`, the
dtype the weights are loaded in (the RMSNorms still normalise in fp32, and the RoPE table stays fp32). The
attention kernel follows training's policy (huginn_ray.model.attention.choose_attention_backend): the first fused
kernel that takes one sequence of the model's full length on the device, else the math kernel for a model of at
most MATH_MAX_SEQ_LEN positions; the model is then restricted to it, so a call no fused kernel takes fails
instead of silently materialising T x T scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from huginn_ray.model.attention import (AttentionShape, choose_attention_backend, probe_attention_backends,
                                        restrict_attention)
from huginn_ray.model.model import RecurrentGPT
from huginn_ray.model.pretrained import load_pretrained

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class InferencePlacement:
    device: torch.device
    """The device the model runs on."""
    dtype_name: str
    """`float32` or `bfloat16`: the dtype the weights are loaded in."""

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    def describe(self) -> str:
        return f"{self.device}, {self.dtype_name}"


def inference_placement(device: str | None = None, dtype: str | None = None,
                        check_present: bool = True) -> InferencePlacement:
    """The device and dtype asked for, checked before any model is loaded; unset: `cuda` and `bfloat16` when an
    accelerator is present, else `cpu` and `float32`. Raises ValueError naming `device` or `dtype`.
    check_present=False checks the names only (a driver that places work on a cluster's GPUs has none itself)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        where = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be one of {', '.join(DEVICE_TYPES)} (cuda:N for one GPU), got {device!r}") \
            from None
    if where.type not in DEVICE_TYPES:
        raise ValueError(f"device must be one of {', '.join(DEVICE_TYPES)} (cuda:N for one GPU), got {device!r}")
    if where.type == "cuda" and check_present:
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this torch sees no GPU (torch.cuda.is_available() is False)")
        if where.index is not None and where.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    if dtype is None:
        dtype = "bfloat16" if where.type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return InferencePlacement(where, dtype)


def attention_for_inference(model: RecurrentGPT, placement: InferencePlacement) -> str:
    """Choose training's attention kernel for one sequence of the model's full length on the device and restrict
    `model` to it; returns the kernel's name."""
    config = model.config
    shape = AttentionShape(1, config.num_attention_heads, config.block_size, config.head_dim, placement.dtype)
    backend = choose_attention_backend(probe_attention_backends(shape, placement.device), shape, "auto")
    restrict_attention(model, backend)
    return backend


def load_for_inference(model_dir: str | Path, placement: InferencePlacement) -> tuple[RecurrentGPT, str]:
    """The model of `model_dir` on the placement's device and dtype, in eval mode, restricted to the chosen
    attention kernel; returns it with the kernel's name."""
    model = load_pretrained(model_dir, device=placement.device, dtype=placement.dtype).eval()
    return model, attention_for_inference(model, placement)
