"""The Huginn recurrent-depth transformer (arXiv 2502.05171), in one file.

    tokens -> embedding * sqrt(D) -> prelude -> e
    s_0 ~ noise;  s_{i+1} = core(adapter(concat[s_i, e]))   for depth r = n + k iterations
    ln_f(s_r) -> coda -> ln_f -> tied head -> logits

The first n iterations run without autograd and only the last k carry gradients (truncated backprop), so the
memory a training step keeps does not grow with the sampled depth. Parameter and buffer names are those of
the released Hugging Face checkpoint, so state_dicts move between the two unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from huginn_ray.model.config import ModelConfig


# ---------------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Normalise in fp32, cast back to the input dtype, then scale (the weight stays fp32 under autocast)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rope_table(head_dim: int, length: int, base: float) -> Tensor:
    """(1, length, 1, head_dim/2, 2) fp32 table of (cos, sin) for angle t / base^(2j/head_dim)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)[None, :, None]


def apply_rope(q: Tensor, k: Tensor, table: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate adjacent pairs (2j, 2j+1) of every head vector (GPT-J convention), in fp32."""
    heads = q.shape[2]
    pairs = torch.cat([q, k], dim=2).float().unflatten(-1, (-1, 2))
    cos, sin = table[..., 0], table[..., 1]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
    q_rot, k_rot = rotated.to(q.dtype).split(heads, dim=2)
    return q_rot, k_rot


class KVCache:
    """Keys and values per block index, for generation (the `full` strategy of the reference).

    Block indices: prelude blocks 0..P-1, core block j of iteration i gets P + L*i + j, coda blocks -1, -2, ...
    Every index holds the keys/values of all positions seen so far, so a cached step attends exactly as a
    full recomputation at the same depth would.
    """

    def __init__(self) -> None:
        self.entries: dict[int, tuple[Tensor, Tensor]] = {}

    def __len__(self) -> int:
        """Number of positions cached (read off the first prelude/core block)."""
        return next(iter(self.entries.values()))[0].shape[1] if self.entries else 0

    def past_length(self, index: int) -> int:
        """Positions already cached for block `index` (the attention's query offset)."""
        return self.entries[index][0].shape[1] if index in self.entries else 0

    def update(self, index: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if index in self.entries:
            past_k, past_v = self.entries[index]
            k, v = torch.cat([past_k, k], dim=1), torch.cat([past_v, v], dim=1)
        self.entries[index] = (k, v)
        return k, v


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.Wqkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)  # rows: [Q | K | V]
        if config.qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.heads, self.head_dim))
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x: Tensor, rope: Tensor, cache: KVCache | None = None, block_index: int = 0) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.Wqkv(x).view(batch, length, 3, self.heads, self.head_dim).unbind(dim=2)
        if hasattr(self, "qk_bias"):
            q = (q + self.qk_bias[0]).to(q.dtype)
            k = (k + self.qk_bias[1]).to(q.dtype)
        q, k = apply_rope(q, k, rope)
        mask, causal = None, True
        if cache is not None:
            past = cache.past_length(block_index)
            k, v = cache.update(block_index, k, v)
            if past:  # queries sit at positions past..past+length-1: SDPA's is_causal would align them at 0
                mask = torch.ones(length, past + length, dtype=torch.bool, device=x.device).tril(diagonal=past)
                causal = False
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=causal
        )
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 2 * config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)  # SiLU on the first half, times the second
        return self.proj(F.silu(gate) * up)


class SandwichBlock(nn.Module):
    """Pre-norm on each branch input and a norm on each residual sum: four RMSNorms per block."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.norm_3 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = GatedMLP(config)
        self.norm_4 = RMSNorm(config.n_embd, config.norm_eps)

    def forward(self, x: Tensor, rope: Tensor, cache: KVCache | None = None, block_index: int = 0) -> Tensor:
        x = self.norm_2(self.attn(self.norm_1(x), rope, cache, block_index) + x)
        return self.norm_4(self.mlp(self.norm_3(x)) + x)


# ---------------------------------------------------------------------------------------------------------
# Depth sampling
# ---------------------------------------------------------------------------------------------------------
def sample_recurrence(step: int, mean_recurrence: int, mean_backprop_depth: int) -> tuple[int, int]:
    """Depth (n no-grad iterations, k grad iterations) for a 1-based training step: poisson-lognormal-filling.

    lambda ~ LogNormal(ln(mean) - 1/8, 1/2), total p = Poisson(lambda) + 1, gradients on the last
    k = min(p, mean_backprop_depth). The generator is seeded by the step alone, so every rank draws the same
    depth without communicating, and a resumed run draws the same depths as an uninterrupted one.
    """
    no_grad_mean = max(mean_recurrence - mean_backprop_depth, 0)
    sigma = 0.5
    mu = math.log(no_grad_mean + mean_backprop_depth) - sigma**2 / 2
    generator = torch.Generator(device="cpu")
    generator.manual_seed((514229 + step) % (2**31 - 1))
    rate = torch.zeros(1).log_normal_(mean=mu, std=sigma, generator=generator)
    total = int(torch.poisson(rate, generator=generator).item()) + 1
    return max(total - mean_backprop_depth, 0), min(mean_backprop_depth, total)


# ---------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------
@dataclass
class ModelOutput:
    logits: Tensor
    """(batch, length, padded_vocab_size), always fp32."""
    loss: Tensor | None
    """Mean next-token cross-entropy when labels were given."""
    num_steps: tuple[int, int]
    """The (no-grad, grad) iterations this forward ran."""
    telemetry: dict[str, float] | None = None
    """Latent-state statistics when requested (return_telemetry=True)."""


class RecurrentGPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
            prelude=nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_prelude)),
            adapter=nn.Linear(2 * config.n_embd, config.n_embd, bias=False),
            core_block=nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_recurrent_block)),
            coda=nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_coda)),
            ln_f=RMSNorm(config.n_embd, config.norm_eps),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.register_buffer("freqs_cis", rope_table(config.head_dim, config.block_size, config.rope_base))
        self.reset_parameters()

    # ---- initialisation (takase, training-code variant: both halves of mlp.fc at the base std) -----------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        std, out_std = self.config.init_std, self.config.init_std_out_proj
        D = self.config.n_embd

        def trunc_normal(tensor: Tensor, sigma: float) -> None:
            nn.init.trunc_normal_(tensor, mean=0.0, std=sigma, a=-3 * sigma, b=3 * sigma)

        trunc_normal(self.transformer.wte.weight, std)
        if not self.config.tie_embeddings:
            trunc_normal(self.lm_head.weight, std)
        trunc_normal(self.transformer.adapter.weight, std)
        for block in self.blocks():
            for rows in block.attn.Wqkv.weight.split(D):  # Q, K and V initialised separately
                trunc_normal(rows, std)
            trunc_normal(block.attn.proj.weight, out_std)
            for half in block.mlp.fc.weight.chunk(2):
                trunc_normal(half, std)
            trunc_normal(block.mlp.proj.weight, out_std)
            if hasattr(block.attn, "qk_bias"):
                block.attn.qk_bias.zero_()
            for norm in (block.norm_1, block.norm_2, block.norm_3, block.norm_4):
                norm.weight.fill_(1.0)
        self.transformer.ln_f.weight.fill_(1.0)

    def blocks(self):
        t = self.transformer
        return [*t.prelude, *t.core_block, *t.coda]

    # ---- forward -------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        num_steps: int | tuple[int, int] | None = None,
        input_states: Tensor | None = None,
        ignore_index: int = -100,
        return_telemetry: bool = False,
        cache: KVCache | None = None,
    ) -> ModelOutput:
        """num_steps: (n, k) runs n iterations without and k with gradients. An int r runs r iterations, all
        without gradients in eval mode, the last min(r, mean_backprop_depth) with gradients in train mode.
        None means the mean depth: (mean_recurrence, 0) in eval, the sampler's mean split in train mode.
        input_states replaces the random initial latent state. ignore_index applies to labels."""
        position = len(cache) if cache is not None else 0
        self._check_input_ids(input_ids, position)
        n, k = self._resolve_num_steps(num_steps)
        rope = self.freqs_cis[:, position : position + input_ids.shape[1]]

        x = self.transformer.wte(input_ids) * self.config.embedding_scale
        for index, block in enumerate(self.transformer.prelude):
            x = block(x, rope, cache, index)
        embedded = x

        state = self._initial_state(embedded) if input_states is None else input_states
        previous_state = state
        with torch.no_grad():
            for iteration in range(n):
                previous_state = state
                state = self._core(state, embedded, rope, cache, iteration)
        for iteration in range(n, n + k):
            previous_state = state
            if self.config.activation_checkpointing and self.training and torch.is_grad_enabled():
                state = checkpoint(self._core, state, embedded, rope, cache, iteration,
                                   use_reentrant=False, preserve_rng_state=False, determinism_check="none")
            else:
                state = self._core(state, embedded, rope, cache, iteration)

        latent = self.transformer.ln_f(state)
        x = latent
        for index, block in enumerate(self.transformer.coda):
            x = block(x, rope, cache, -1 - index)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x).float()

        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index)
        telemetry = None
        if return_telemetry:
            telemetry = latent_telemetry(embedded, previous_state, latent, x, (n, k))
        return ModelOutput(logits=logits, loss=loss, num_steps=(n, k), telemetry=telemetry)

    def _core(self, state: Tensor, embedded: Tensor, rope: Tensor, cache: KVCache | None, iteration: int) -> Tensor:
        x = self.transformer.adapter(torch.cat([state, embedded], dim=-1))  # state first, then e
        first_index = self.config.n_layers_in_prelude + self.config.n_layers_in_recurrent_block * iteration
        for offset, block in enumerate(self.transformer.core_block):
            x = block(x, rope, cache, first_index + offset)
        return x

    def _initial_state(self, embedded: Tensor) -> Tensor:
        if self.config.state_init == "zero":
            return torch.zeros_like(embedded)
        std = self.config.init_std
        state = torch.empty_like(embedded)
        nn.init.trunc_normal_(state, mean=0.0, std=std, a=-3 * std, b=3 * std)
        return state * self.config.embedding_scale

    def _resolve_num_steps(self, num_steps: int | tuple[int, int] | None) -> tuple[int, int]:
        backprop = self.config.mean_backprop_depth
        if num_steps is None:
            num_steps = self.config.mean_recurrence
        if isinstance(num_steps, int):
            if num_steps < 0:
                raise ValueError(f"num_steps must be >= 0, got {num_steps}")
            if not self.training:
                return num_steps, 0
            return max(num_steps - backprop, 0), min(num_steps, backprop)
        n, k = (int(v) for v in num_steps)
        if n < 0 or k < 0:
            raise ValueError(f"num_steps=(n, k) must be non-negative, got {(n, k)}")
        return n, k

    def _check_input_ids(self, input_ids: Tensor, position: int) -> None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (batch, length), got {tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be int64 or int32, got {input_ids.dtype}")
        length = position + input_ids.shape[1]
        if length > self.config.block_size:
            raise ValueError(
                f"sequence length {length} exceeds block_size={self.config.block_size} of this model"
            )
        if input_ids.device.type == "meta":
            return
        out_of_range = (input_ids < 0) | (input_ids >= self.config.vocab_size)
        if out_of_range.any():
            row, col = (int(i) for i in out_of_range.nonzero()[0])
            raise ValueError(
                f"token id {int(input_ids[row, col])} at (batch {row}, position {col}) is outside the "
                f"vocabulary [0, {self.config.vocab_size})"
            )

    # ---- state_dict with a readable error for checkpoints of another shape --------------------------------
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if strict:
            expected = self.state_dict()
            missing = [key for key in expected if key not in state_dict]
            unexpected = [key for key in state_dict if key not in expected]
            if missing or unexpected:
                raise ValueError(
                    f"state_dict does not match RecurrentGPT({self.config.name}): "
                    + (f"missing key {missing[0]!r} ({len(missing)} missing)" if missing else "")
                    + ("; " if missing and unexpected else "")
                    + (f"unexpected key {unexpected[0]!r} ({len(unexpected)} unexpected)" if unexpected else "")
                )
            for key, tensor in expected.items():
                if tuple(state_dict[key].shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"state_dict key {key!r} has shape {tuple(state_dict[key].shape)}, but this "
                        f"RecurrentGPT({self.config.name}) expects {tuple(tensor.shape)}: was it saved from another config?"
                    )
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # ---- generation ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        num_steps: int | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        eos_token_id: int | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Append up to max_new_tokens tokens; greedy when temperature == 0. Every token runs `num_steps`
        core iterations (default mean_recurrence). With use_cache, keys/values are kept per block index and
        position, so each new token costs one position instead of the whole sequence."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if input_ids.shape[-1] + max_new_tokens > self.config.block_size:
            raise ValueError(
                f"prompt length {input_ids.shape[-1]} + max_new_tokens {max_new_tokens} exceeds "
                f"block_size={self.config.block_size} of this model"
            )
        depth = self.config.mean_recurrence if num_steps is None else num_steps
        was_training = self.training
        self.eval()
        try:
            cache = KVCache() if use_cache else None
            tokens = input_ids
            next_input = input_ids
            finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
            for _ in range(max_new_tokens):
                logits = self(next_input if use_cache else tokens, num_steps=(depth, 0), cache=cache).logits[:, -1]
                logits = logits[:, : self.config.vocab_size]
                next_token = self._pick(logits, temperature, top_k, generator)
                if eos_token_id is not None:
                    next_token = torch.where(finished, torch.full_like(next_token, eos_token_id), next_token)
                    finished |= next_token == eos_token_id
                tokens = torch.cat([tokens, next_token[:, None]], dim=1)
                next_input = next_token[:, None]
                if eos_token_id is not None and bool(finished.all()):
                    break
            return tokens
        finally:
            self.train(was_training)

    @staticmethod
    def _pick(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
        if temperature == 0:
            return logits.argmax(dim=-1)
        logits = logits / temperature
        if top_k is not None:
            threshold = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < threshold, float("-inf"))
        return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]


@torch.no_grad()
def latent_telemetry(embedded: Tensor, previous_state: Tensor, latent: Tensor, last_hidden: Tensor,
                     num_steps: tuple[int, int]) -> dict[str, float]:
    """How the recurrence behaved this step: norms of the latent state, its change in the last iteration,
    its distance from the input embedding e, and how similar token states have become (collapse shows as
    correlation near 1)."""
    def mean_token_norm(x: Tensor) -> float:
        return float(x.float().norm(dim=-1).mean())

    def token_correlation(x: Tensor) -> float:
        tokens = x[0].float()
        tokens = tokens - tokens.mean(dim=0, keepdim=True)
        tokens = F.normalize(tokens, dim=-1)
        length = tokens.shape[0]
        return float((tokens @ tokens.T).mean()) - 1.0 / length

    residual = mean_token_norm(latent - previous_state)
    state_norm = mean_token_norm(latent)
    return {
        "recurrent_state_norm": state_norm,
        "last_hidden_norm": mean_token_norm(last_hidden),
        "recurrent_residual": residual,
        "rel_residual": residual / max(state_norm, 1e-12),
        "recurrent_diff": mean_token_norm(latent - embedded),
        "recurrent_state_token_corr": token_correlation(latent),
        "last_hidden_token_corr": token_correlation(last_hidden),
        "num_steps_no_grad": float(num_steps[0]),
        "num_steps_with_grad": float(num_steps[1]),
    }
