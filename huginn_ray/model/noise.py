"""The latent noise the recurrence starts from: truncated normal draws by inverse CDF (no host sync), and the seed
of each training row's own noise generator."""

from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor


ROW_KEY_BITS = 50
"""Row keys (huginn_ray.train.shard_reader: stream x 2^32 + row) below 2^50 pack beside the seed in `row_seed`."""


def row_seed(seed: int, key: int) -> int:
    """The seed of row `key`'s noise generator under run seed `seed` (a torch generator takes 64 bits):
    seed x 2^50 + key where that fits, as every run with seed < 2^14 has drawn it; otherwise a 64-bit BLAKE2b
    hash of (seed, key), so that no seed overflows and distinct seeds do not share rows' noise (a reduction
    modulo 2^64 would give seed s + 2^14 the noise of seed s)."""
    packed = seed * 2**ROW_KEY_BITS + key
    if key < 2**ROW_KEY_BITS and packed < 2**64:
        return packed
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _normal_cdf(x: float) -> float:
    return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0


TRUNC_NORMAL_UNIFORM = (2 * _normal_cdf(-3.0) - 1, 2 * _normal_cdf(3.0) - 1)
"""The uniform range whose inverse-CDF image is N(0, 1) truncated to [-3, 3] (trunc_normal_from_uniform_)."""


@torch.no_grad()
def trunc_normal_from_uniform_(tensor: Tensor, std: float) -> Tensor:
    """Map draws uniform on TRUNC_NORMAL_UNIFORM (each row from its own generator, say) to N(0, std^2) truncated to
    [-3 std, 3 std] by the inverse CDF, in place, element by element, in one pass for all rows.

    This is how torch's `nn.init.trunc_normal_` sampled up to torch 2.5 (the reference's). Newer torch versions
    resample rejected values in a loop whose `mask.any()` reads the device once or more per call; the initial
    latent state is drawn in every forward, so that would be a host sync per micro-batch."""
    tensor.erfinv_()
    tensor.mul_(std * math.sqrt(2.0))
    return tensor.clamp_(min=-3 * std, max=3 * std)
