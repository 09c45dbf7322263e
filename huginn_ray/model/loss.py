"""The language-model loss without the full logits: head + cross-entropy over chunks of tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int,
                          ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of `F.linear(hidden, weight).float()` against labels, chunk_tokens rows at a time.

    Equal to `F.cross_entropy(lm_head(hidden).float(), labels, ignore_index=...)` (to fp32 rounding), but
    only one (chunk_tokens x vocab) block of logits exists at a time. The forward computes the loss and keeps
    only references to hidden, weight and labels for backward; backward recomputes each chunk's logits and
    forms its gradients there (chunked_cross_entropy_grads). Cost: the head takes 4 matmuls instead of the
    unchunked 3 (its forward matmul runs again in backward). In exchange nothing gradient- or weight-sized
    lives from the end of the forward through the model's backward: the fp32 accumulator of the weight's
    gradient and the weight in the matmul dtype exist only while the loss's own backward runs, first in the
    model's backward (huginn_ray.train.memory plans that moment). Under autocast the matmuls run in the
    autocast dtype, as `lm_head` would, in forward and backward alike. Without gradients (evaluation) the forward is all it costs:
    one matmul per chunk."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _ChunkedCrossEntropy.apply(hidden, weight, labels, chunk_tokens, ignore_index)


def chunked_cross_entropy_grads(hidden: Tensor, weight: Tensor, labels: Tensor, grad_output: Tensor,
                                chunk_tokens: int, ignore_index: int, dtype: torch.dtype, need_hidden: bool = True,
                                need_weight: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of `grad_output * chunked_cross_entropy(...)` for hidden and weight (None where not needed).

    Chunk by chunk: logits = hidden_chunk @ weight.T in `dtype` (the forward's matmul dtype), then
    d loss / d logits = (softmax - one-hot) x grad_output / (number of counted tokens) on counted rows and 0 on
    ignored ones, cast to `dtype`; hidden's gradient is that times the weight, and the weight's gradient
    accumulates (gradient.T @ hidden_chunk) in fp32 and is cast to the weight's dtype at the end. Alive at
    the peak: the fp32 accumulator, hidden's gradient, the weight in `dtype` (a copy unless it is the weight's
    own dtype), one chunk's logits and their gradient, and for a `dtype` other than fp32 one weight-sized
    product per chunk (a matmul cannot add bf16 products into fp32 in place)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    w = weight.to(dtype)
    valid = y != ignore_index
    row_scale = (valid * (grad_output / valid.sum().clamp(min=1)))[:, None]  # all ignored: zero gradients
    grad_h = torch.empty_like(h) if need_hidden else None
    grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
    for start in range(0, h.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        h_c = h[rows].to(dtype)
        grad_logits = F.linear(h_c, w).float()
        _exp_minus_max_(grad_logits)
        grad_logits.div_(grad_logits.sum(dim=-1, keepdim=True))  # softmax
        target = torch.where(valid[rows], y[rows], 0)[:, None]
        grad_logits.scatter_add_(1, target, torch.full(target.shape, -1.0, device=target.device))
        grad_logits = grad_logits.mul_(row_scale[rows]).to(dtype)
        if grad_h is not None:
            grad_h[rows] = grad_logits @ w
        if grad_w is not None and dtype == torch.float32:
            grad_w.addmm_(grad_logits.t(), h_c)  # in place: no weight-sized product
        elif grad_w is not None:
            grad_w += grad_logits.t() @ h_c  # the product in `dtype` (weight-sized), added in fp32
        del h_c, grad_logits  # before the next chunk's blocks exist, not while they are made
    grad_h = grad_h.view(hidden.shape) if grad_h is not None else None
    grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
    return grad_h, grad_w


def _exp_minus_max_(logits: Tensor) -> Tensor:
    """exp(logits - row max) in place; returns the row max. In place so that no second (chunk x vocab) block
    is made: torch.logsumexp allocates one inside its kernel."""
    row_max = logits.amax(dim=-1, keepdim=True)
    logits.sub_(row_max).exp_()
    return row_max


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int, ignore_index: int) -> Tensor:
        device_type = hidden.device.type
        autocast = torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if autocast else weight.dtype  # meta: no autocast
        h = hidden.reshape(-1, hidden.shape[-1])
        y = labels.reshape(-1)
        w = weight.to(dtype)
        valid = y != ignore_index
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, h.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = F.linear(h[rows].to(dtype), w).float()
            target = torch.where(valid[rows], y[rows], 0)[:, None]
            picked = logits.gather(1, target)
            row_max = _exp_minus_max_(logits)
            log_sum_exp = logits.sum(dim=-1, keepdim=True).log_().add_(row_max)
            total += ((log_sum_exp - picked)[:, 0] * valid[rows]).sum()
            del logits  # before the next chunk's logits exist, not while they are made
        ctx.save_for_backward(hidden, weight, labels)  # references: no new memory
        # backward runs outside the forward's autocast state: it recomputes in the dtype recorded here
        ctx.chunk_tokens, ctx.ignore_index, ctx.dtype = chunk_tokens, ignore_index, dtype
        return total / valid.sum()

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        hidden, weight, labels = ctx.saved_tensors
        grad_h, grad_w = chunked_cross_entropy_grads(
            hidden, weight, labels, grad_output, ctx.chunk_tokens, ctx.ignore_index, ctx.dtype,
            need_hidden=ctx.needs_input_grad[0], need_weight=ctx.needs_input_grad[1])
        return grad_h, grad_w, None, None, None

