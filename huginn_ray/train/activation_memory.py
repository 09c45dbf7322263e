"""What one forward + loss of the model keeps for backward, measured, not estimated: the model runs on the meta
device (or on real tensors) under `saved_tensors_hooks` and the bytes of the distinct storages autograd saves are
summed (`saved_activation_bytes`), the peaks of what the chunked loss allocates are tracked (`PeakLiveBytes`), and
on GPU configurations bf16 autocast and the device's fused attention are emulated on meta (`AutocastOnMeta`).
The memory plan (huginn_ray.train.memory) counts these figures.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from huginn_ray.model import RecurrentGPT
from huginn_ray.model.loss import chunked_cross_entropy, chunked_cross_entropy_grads


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class AutocastOnMeta(TorchFunctionMode):
    """What bf16 autocast and the device's fused attention do, for meta tensors (autocast ignores meta).

    linear / matmul / attention get bf16 inputs; casts of leaf tensors that require grad and are no views (the
    weights, as autocast's weight cache decides) are cached for the whole forward; the head weight too, whose
    bf16 copy the chunked loss makes itself and holds for its forward; attention runs the flash kernel of the target
    device (`_scaled_dot_product_flash_attention` on GPUs, its CPU variant on CPU), which saves what the device
    saves instead of the math fallback meta would take."""

    LOWER = {F.linear, torch.matmul, torch.Tensor.matmul, torch.mm, torch.bmm}

    def __init__(self, bf16: bool, device_type: str):
        super().__init__()
        self.bf16 = bf16
        self.device_type = device_type
        self.cache: dict[tuple, torch.Tensor] = {}

    def _cast(self, t):
        if not (self.bf16 and isinstance(t, torch.Tensor) and t.dtype == torch.float32):
            return t
        if t.is_leaf and t.requires_grad and not t._is_view():
            # keyed by what is viewed, not by the Python object: a weight saved for backward comes back from
            # autograd as another object over the same storage
            key = (_storage_key(t), t.storage_offset(), tuple(t.shape), t.stride())
            if key not in self.cache:
                self.cache[key] = t.to(torch.bfloat16)
            return self.cache[key]
        return t.to(torch.bfloat16)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(*tree_map(self._cast, args), **tree_map(self._cast, kwargs))
        if func in self.LOWER:
            args, kwargs = tree_map(self._cast, args), tree_map(self._cast, kwargs)
        return func(*args, **kwargs)

    def _attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
        if attn_mask is not None:  # only generation passes a mask; training is causal without one
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)
        if self.device_type == "cpu":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]


class SavedBytes:
    """saved_tensors_hooks that sum the bytes of the distinct storages autograd keeps (parameters excluded)."""

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        key = _storage_key(t)
        if key not in self.exclude:
            self.storages[key] = t.untyped_storage().nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


class PeakLiveBytes(TorchDispatchMode):
    """Peak bytes alive at once of the storages created while this mode is active (meta or real tensors).

    Storages that existed before (inputs, and views or in-place results of them) are not counted; a created
    storage counts from the op that returns it until its last reference goes. Scratch memory inside one op's
    kernel is not seen (so the chunked loss forms its softmax in place rather than in torch.logsumexp)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        self.live = {key: (ref, size) for key, (ref, size) in self.live.items() if not ref.expired()}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and _storage_key(t) not in inputs:
                self.live[_storage_key(t)] = (StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
        self.peak = max(self.peak, sum(size for _, size in self.live.values()))
        return out


def saved_activation_bytes(model: RecurrentGPT, input_ids: torch.Tensor, num_steps: tuple[int, int],
                           bf16: bool = False, device_type: str = "cpu", loss_chunk_tokens: int = 0) -> dict:
    """Bytes autograd keeps for backward over one forward+loss of `model` (meta or real tensors).

    Returns {"activations", "recompute_block", "weight_casts", "loss_forward", "loss_backward"}: the saved
    storages of the whole forward, of the core's largest checkpointed segment (the adapter and the first block)
    without checkpointing (what its recomputation holds in backward), and of the bf16 weight casts alive at the end of the forward that are not among the saved
    storages; with `loss_chunk_tokens` (the forward's argument) the peaks of the chunked loss's own allocations in its forward
    (one chunk's logits) and in its backward, which runs first in backward while every activation is alive
    (the fp32 accumulator of the head weight's gradient, the weight in the matmul dtype, hidden's gradient,
    one chunk's logits and their gradient), both 0 without."""
    exclude = {_storage_key(t) for t in [*model.parameters(), *model.buffers()]}
    saved = SavedBytes(exclude)
    emulation = AutocastOnMeta(bf16, device_type) if input_ids.device.type == "meta" else None
    with saved.hooks(), (emulation or torch.enable_grad()):
        out = model(input_ids, labels=input_ids, num_steps=num_steps, loss_chunk_tokens=loss_chunk_tokens)
    casts = 0
    if emulation is not None:
        casts = sum(t.untyped_storage().nbytes() for t in emulation.cache.values()
                    if _storage_key(t) not in saved.storages)
    activations = saved.total
    loss_forward = loss_backward = 0
    if loss_chunk_tokens:  # the loss is the chunked loss's output: its node holds what it saved
        node = out.loss.grad_fn
        hidden, weight, labels = node.saved_tensors
        with torch.no_grad(), PeakLiveBytes() as forward_peak, (emulation or torch.no_grad()):
            chunked_cross_entropy(hidden, weight, labels, node.chunk_tokens, node.ignore_index)
        # meta has no autocast, so the node recorded fp32; backward recomputes in the forward's dtype
        dtype = torch.bfloat16 if (bf16 and emulation is not None) else node.dtype
        with torch.no_grad(), PeakLiveBytes() as backward_peak:
            grad_output = torch.ones((), device=hidden.device)  # what loss.backward() starts from
            chunked_cross_entropy_grads(hidden, weight, labels, grad_output, node.chunk_tokens, node.ignore_index,
                                        dtype)
        loss_forward, loss_backward = forward_peak.peak, backward_peak.peak
    del out
    # the core's largest checkpointed segment (the adapter and the first block) as backward recomputes it
    recompute = SavedBytes(exclude)
    with torch.no_grad():
        x = model.transformer.wte(input_ids) * model.config.embedding_scale
    embedded = x.detach().requires_grad_()
    state = torch.zeros_like(embedded).requires_grad_()
    rope = model.freqs_cis[:, : input_ids.shape[1]]
    emulation = AutocastOnMeta(bf16, device_type) if input_ids.device.type == "meta" else None
    core = model.transformer.core_block
    with recompute.hooks(), (emulation or torch.enable_grad()):
        core[0](F.linear(state, model.adapter_state_weight()) + model.inject(embedded), rope)
    return {"activations": activations, "recompute_block": recompute.total, "weight_casts": casts,
            "loss_forward": loss_forward, "loss_backward": loss_backward}
