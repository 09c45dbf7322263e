"""Attention: rotary position embedding, causal self-attention over scaled_dot_product_attention, and which of
SDPA's kernels a training run may use.

Left alone, SDPA picks a kernel per call and may fall back to the math kernel, which materialises
batch x heads x T^2 scores. A training run therefore probes the fused kernels for its shape
(`probe_attention_backends`), chooses one (`choose_attention_backend`, which refuses the math kernel for long
sequences unless asked for) and restricts every attention call of the model to it (`restrict_attention`).
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from huginn_ray.model.cache import KVCache
from huginn_ray.model.config import ModelConfig


def rope_table(head_dim: int, length: int, base: float) -> Tensor:
    """(1, length, 1, head_dim/2, 2) fp32 table of (cos, sin) for angle t / base^(2j/head_dim)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)[None, :, None]


def rotate(x: Tensor, table: Tensor) -> Tensor:
    """Rotate adjacent pairs (2j, 2j+1) of every head vector (GPT-J convention), in fp32. One elementwise
    expression, which a compiled block fuses with the qk_bias add and the casts into a single pass."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = table[..., 0], table[..., 1]
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2).to(x.dtype)



SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
FUSED_BACKENDS = ("flash", "efficient", "cudnn")
"""In order of preference. All keep O(T) memory per head; the math kernel materialises the T x T scores. cuDNN's
kernel (NVIDIA GPUs with cuDNN 9) comes last: it takes shapes the other two may not (e.g. a head_dim flash
lacks), and where several take the shape torch picks among the allowed ones by its own priority."""
MATH_MAX_SEQ_LEN = 1024
"""Longest training sequence the math kernel may serve without `attention_backend: math`: at nebel's shape
(55 heads, T = 4096) it would materialise 55 x 4096^2 scores per call and sequence, 1.7 GiB in bf16, kept for
backward in every attention of every gradient iteration."""


class AttentionBackendError(ValueError):
    """No fused attention kernel takes the training shape, and the sequence is too long for the math kernel."""


@dataclass(frozen=True)
class AttentionShape:
    """One attention call of a training step: q, k and v are (batch, heads, seq_len, head_dim) in `dtype`."""

    batch: int
    heads: int
    seq_len: int
    head_dim: int
    dtype: torch.dtype

    def describe(self) -> str:
        return (f"micro-batch {self.batch} x {self.heads} heads x seq_len {self.seq_len} x head_dim {self.head_dim}, "
                f"{str(self.dtype).removeprefix('torch.')}")

    def math_scores_gib(self) -> float:
        """What the math kernel materialises per call: batch x heads x seq_len^2 scores in `dtype`."""
        return self.batch * self.heads * self.seq_len**2 * self.dtype.itemsize / 2**30


def probe_attention_backends(shape: AttentionShape, device: torch.device) -> dict[str, str | None]:
    """Which fused kernels take `shape` on `device`: for each of FUSED_BACKENDS, None when that kernel alone ran a
    causal forward and backward of one sequence of the shape, else why not (torch's warnings when it gives them,
    else its error). The math kernel takes every shape. Costs one attention call of one sequence per kernel; draws
    no random numbers (a run's random streams do not depend on the probe)."""
    q = torch.zeros(1, shape.heads, shape.seq_len, shape.head_dim, device=device, dtype=shape.dtype,
                    requires_grad=True)
    serves = {}
    for name in FUSED_BACKENDS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel([SDPA_BACKENDS[name]]):
                    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
                serves[name] = None
            except RuntimeError as err:
                reasons = [str(w.message) for w in caught if "kernel not used because" in str(w.message)]
                serves[name] = "; ".join(reasons) or str(err).splitlines()[0]
    return serves


def choose_attention_backend(serves: dict[str, str | None], shape: AttentionShape, requested: str) -> str:
    """The kernel a run trains with: `requested` "math" is the math kernel on purpose; "auto" is the first fused
    kernel that takes the shape (`serves`: probe_attention_backends), else the math kernel for a sequence of at
    most MATH_MAX_SEQ_LEN tokens. Raises AttentionBackendError, naming the shape and why each fused kernel does
    not take it, when only the math kernel would serve a longer sequence."""
    if requested == "math":
        return "math"
    if requested != "auto":
        raise ValueError(f"attention_backend must be 'auto' or 'math', got {requested!r}")
    for name in FUSED_BACKENDS:
        if serves[name] is None:
            return name
    if shape.seq_len <= MATH_MAX_SEQ_LEN:
        return "math"
    reasons = "; ".join(f"{name}: {serves[name]}" for name in FUSED_BACKENDS)
    raise AttentionBackendError(
        f"only the math attention kernel takes the training shape ({shape.describe()}): it would materialise "
        f"{shape.batch} x {shape.heads} x {shape.seq_len}^2 scores per call ({shape.math_scores_gib():.2f} GiB), "
        f"out of memory or many times slower than a fused kernel. Not taken: {reasons}. Set "
        f"attention_backend: math to train with the math kernel on purpose, or use a shape a fused kernel takes")


def restrict_attention(model: nn.Module, backend: str | None) -> nn.Module:
    """Let every attention call of `model` (a RecurrentGPT: every block of its `blocks()`) use only the kernel
    chosen for training: for a fused kernel the fused kernels (any of FUSED_BACKENDS; torch picks by its priority),
    for "math" the math kernel; None lifts the restriction (torch's own choice). A call no allowed kernel takes then
    fails instead of falling back silently."""
    allowed = None if backend is None else \
        [SDPA_BACKENDS[name] for name in (("math",) if backend == "math" else FUSED_BACKENDS)]
    for block in model.blocks():
        block.attn.sdpa_backends = allowed
    return model


class SequenceSplit(Protocol):
    """A sequence split over several ranks (context parallelism; huginn_ray.train.context_parallel implements it):
    this rank holds the tokens at `positions`, and `attend` is causal attention of its queries over the whole
    sequence's keys and values."""

    positions: Tensor
    """This rank's positions in the sequence (int64, on the model's device), in the order its tokens come."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q, k, v: (batch, heads, local length, head_dim) at `positions`; returns the output, shaped as q."""


class CausalSelfAttention(nn.Module):
    sdpa_backends: list[SDPBackend] | None = None
    """The scaled_dot_product_attention kernels this module may use (restrict_attention); None: torch's choice."""
    sequence_split: SequenceSplit | None = None
    """Set by RecurrentGPT.split_sequence: calls without a KV cache attend through it (context parallelism)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.Wqkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)  # rows: [Q | K | V]
        if config.qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.heads, self.head_dim))
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x: Tensor, rope: Tensor, cache: KVCache | None = None, block_index: int = 0) -> Tensor:
        batch, length, width = x.shape
        qkv = self.Wqkv(x).view(batch, length, 3, self.heads, self.head_dim)
        # q and k side by side, a view of the projection (no copy): one bias add and one rotation for both
        qk, v = qkv[:, :, :2], qkv[:, :, 2]
        if hasattr(self, "qk_bias"):
            qk = (qk + self.qk_bias[:, 0]).to(qk.dtype)
        q, k = rotate(qk, rope[:, :, None]).unbind(dim=2)
        mask, causal = None, True
        if cache is not None:
            mask = cache.attention_mask(block_index, length)  # before update: the queries follow the past
            k, v = cache.update(block_index, k, v)
            causal = mask is None
        with sdpa_kernel(self.sdpa_backends) if self.sdpa_backends else nullcontext():
            if cache is None and self.sequence_split is not None:
                y = self.sequence_split.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            else:
                y = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=causal
                )
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))

