"""The Huginn recurrent-depth transformer (arXiv 2502.05171).

    tokens -> embedding * sqrt(D) -> prelude -> e
    s_0 ~ noise;  s_{i+1} = core(adapter(concat[s_i, e]))   for depth r = n + k iterations
    ln_f(s_r) -> coda -> ln_f -> tied head -> logits

The first n iterations run without autograd and only the last k carry gradients (truncated backprop), so the
memory a training step keeps does not grow with the sampled depth. Parameter and buffer names are those of
the released Hugging Face checkpoint, so state_dicts move between the two unchanged.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from huginn_ray.model.attention import CausalSelfAttention, rope_table
from huginn_ray.model.cache import KVCache
from huginn_ray.model.config import ModelConfig
from huginn_ray.model.loss import chunked_cross_entropy


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

    compiled_sandwich = None
    """Set by compile_blocks: a torch.compile'd `sandwich`, used whenever no KV cache is passed."""

    def forward(self, x: Tensor, rope: Tensor, cache: KVCache | None = None, block_index: int = 0) -> Tensor:
        if cache is None and self.compiled_sandwich is not None:
            return self.compiled_sandwich(x, rope)
        return self.sandwich(x, rope, cache, block_index)

    def sandwich(self, x: Tensor, rope: Tensor, cache: KVCache | None = None, block_index: int = 0) -> Tensor:
        x = self.norm_2(self.attn(self.norm_1(x), rope, cache, block_index) + x)
        return self.norm_4(self.mlp(self.norm_3(x)) + x)


CHECKPOINT_OPTIONS = dict(use_reentrant=False, preserve_rng_state=False, determinism_check="none")
"""Activation checkpointing without RNG bookkeeping: nothing inside a block draws random numbers."""


class RecurrentCore(nn.Module):
    """The core block: its sandwich blocks, applied once per recurrence iteration.

    `forward` runs every iteration of one forward pass in one call, so a wrapper that hooks module calls (FSDP2,
    huginn_ray.train.parallel) gathers the core's weights once per step and reduces their gradients once, after
    the backward of the last use, instead of once per iteration. The blocks are its children "0", "1", ..., so
    the parameter names (`transformer.core_block.{i}....`) are the released checkpoint's. It is not an
    nn.ModuleList: torch 2.11's fully_shard refuses any ModuleList, even one with its own forward."""

    def __init__(self, blocks: Iterable[nn.Module]):
        super().__init__()
        for index, block in enumerate(blocks):
            self.add_module(str(index), block)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __getitem__(self, index: int) -> nn.Module:
        return list(self._modules.values())[index]

    def iterate(self, state: Tensor, injected: Tensor, adapter_weight: Tensor, rope: Tensor,
                cache: KVCache | None = None, first_block_index: int = 0) -> Tensor:
        """One iteration. adapter(concat[s, e]) = W[:, :D] s + W[:, D:] e: `injected` is W[:, D:] e (the same in
        every iteration), `adapter_weight` is W[:, :D]. The block index keys the KV cache only."""
        x = F.linear(state, adapter_weight) + injected
        for offset, block in enumerate(self):
            x = block(x, rope) if cache is None else block(x, rope, cache, first_block_index + offset)
        return x

    def forward(self, state: Tensor, injected: Tensor, adapter_weight: Tensor, rope: Tensor,
                num_steps: tuple[int, int], checkpointing: bool = False, cache: KVCache | None = None,
                block_offset: int = 0) -> tuple[Tensor, Tensor]:
        """`n` iterations without gradients, then `k` with (each recomputed in backward when `checkpointing`).
        Returns the final state and the state before the last iteration (for telemetry). Iteration i's blocks
        have KV-cache indices block_offset + len(self) * i + j (the released bookkeeping)."""
        n, k = num_steps
        previous = state
        with torch.no_grad():
            for iteration in range(n):
                previous, state = state, self.iterate(state, injected, adapter_weight, rope, cache,
                                                      block_offset + len(self) * iteration)
        for iteration in range(n, n + k):
            previous = state
            if checkpointing:
                state = self._iterate_checkpointed(state, injected, adapter_weight, rope)
            else:
                state = self.iterate(state, injected, adapter_weight, rope, cache, block_offset + len(self) * iteration)
        return state, previous

    def _iterate_checkpointed(self, state: Tensor, injected: Tensor, adapter_weight: Tensor, rope: Tensor) -> Tensor:
        """One iteration with every block checkpointed on its own (the adapter with the first block): backward
        recomputes one block at a time, so its transient is one block's activations, for one saved input per
        block (training only: no KV cache)."""
        def adapter_and_first_block(state: Tensor) -> Tensor:
            return self[0](F.linear(state, adapter_weight) + injected, rope)

        x = checkpoint(adapter_and_first_block, state, **CHECKPOINT_OPTIONS)
        for block in list(self)[1:]:
            x = checkpoint(block, x, rope, **CHECKPOINT_OPTIONS)
        return x


def compile_blocks(model: "RecurrentGPT", **compile_kwargs) -> "RecurrentGPT":
    """Regional compilation: compile every sandwich block (prelude, core, coda) on its own, as torchtitan does
    per transformer block, instead of the whole forward. The recurrent loop stays in Python, so a newly
    sampled depth reuses the compiled blocks instead of recompiling; all blocks share one compiled graph per
    (grad mode, input dtype, shape). Inside a block the compiler fuses the memory-bound work around the
    matmuls: the RMSNorms with their fp32 round trip and the residual adds before them, qk_bias + RoPE + casts,
    SiLU(gate) * up. Parameter names and state_dict keys do not change. Calls with a KV cache (generation)
    run the eager block, whose shapes change at every token. Returns the model."""
    for block in model.blocks():
        block.compiled_sandwich = torch.compile(block.sandwich, **compile_kwargs)
    return model


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
    logits: Tensor | None
    """(batch, length, padded_vocab_size), always fp32; None when the loss was computed in chunks."""
    loss: Tensor | None
    """Mean next-token cross-entropy when labels were given."""
    num_steps: tuple[int, int]
    """The (no-grad, grad) iterations this forward ran."""
    telemetry: dict[str, Tensor] | None = None
    """Latent-state statistics when requested (return_telemetry=True), as device scalars."""


class RecurrentGPT(nn.Module):
    loss_chunk_tokens: int = 0
    """> 0: with labels, compute the head and the loss over chunks of this many tokens (chunked_cross_entropy)
    instead of materialising (tokens x padded vocab) fp32 logits. The training loop sets it from its config."""
    check_token_ids: bool = True
    """Check in every forward that token ids lie in [0, vocab_size); costs a host sync. The training loop
    turns it off because its collate step checks every batch on the host before it reaches the device."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
            prelude=nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_prelude)),
            adapter=nn.Linear(2 * config.n_embd, config.n_embd, bias=False),
            core_block=RecurrentCore(SandwichBlock(config) for _ in range(config.n_layers_in_recurrent_block)),
            coda=nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_coda)),
            ln_f=RMSNorm(config.n_embd, config.norm_eps),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.register_buffer("freqs_cis", rope_table(config.head_dim, config.block_size, config.rope_base))
        self.reset_parameters()

    @torch.no_grad()
    def materialize(self, device: torch.device | str) -> "RecurrentGPT":
        """Allocate a model built on the meta device on `device` and initialise it there (`initialise`): bitwise
        the model constructed on `device`, without a CPU copy first."""
        return self.allocate(device).initialise()

    def allocate(self, device: torch.device | str) -> "RecurrentGPT":
        """Give a model built on the meta device (possibly FSDP2-sharded: each rank its shards) uninitialised
        storage on `device`, the tied head re-tied (`to_empty` gives every module a tensor of its own) and the
        RoPE table computed; the weights are then initialised or loaded."""
        self.to_empty(device=device)
        if self.config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.freqs_cis = rope_table(self.config.head_dim, self.config.block_size, self.config.rope_base).to(device)
        return self

    @torch.no_grad()
    def initialise(self) -> "RecurrentGPT":
        """Draw the initial weights into allocated storage (whole, or this rank's FSDP2 shards) from torch's
        global RNG: exactly the random numbers, in the order, that a model constructed on the device draws (the
        default inits of nn.Linear / nn.Embedding in construction order, which `reset_parameters` then
        overwrites, then `reset_parameters`), so the values are bitwise those of the whole-model init on every
        layout. A sharded parameter is drawn whole into one scratch buffer (the size of the largest sharded
        parameter, reused) and this rank keeps its rows: a rank holds its shards plus one parameter, never the
        whole model. The default inits are still drawn (into that scratch, or the parameter) because their random
        numbers decide where `reset_parameters`' draws start."""
        from torch.distributed.tensor import DTensor

        from huginn_ray.train.replica_read import local_rows

        sharded = [p for p in self.parameters() if isinstance(p, DTensor)]
        scratch = {p.dtype: torch.empty(max(q.numel() for q in sharded if q.dtype == p.dtype), dtype=p.dtype,
                                        device=p.to_local().device) for p in sharded}

        def draw(param: Tensor, init) -> None:
            target, rows = local_rows(param)
            if rows is None:
                init(target)
                return
            whole = scratch[param.dtype][: param.numel()].view(param.shape)
            init(whole)
            target.copy_(whole[rows])

        for module in self.modules():  # nn.Embedding's and nn.Linear's own reset_parameters (no padding index, no bias)
            if isinstance(module, nn.Embedding):
                draw(module.weight, nn.init.normal_)
            elif isinstance(module, nn.Linear):
                draw(module.weight, lambda whole: nn.init.kaiming_uniform_(whole, a=math.sqrt(5)))
        self.reset_parameters(draw)
        return self

    # ---- initialisation (takase, training-code variant: both halves of mlp.fc at the base std) -----------
    @torch.no_grad()
    def reset_parameters(self, draw=None) -> None:
        """`draw(parameter, init)` applies `init` to the parameter's whole tensor: by default the parameter itself;
        `initialise` passes one that draws a sharded parameter whole and keeps this rank's rows."""
        draw = draw or (lambda param, init: init(param))
        std, out_std = self.config.init_std, self.config.init_std_out_proj
        D = self.config.n_embd

        def trunc_normal(sigma: float):
            return lambda tensor: nn.init.trunc_normal_(tensor, mean=0.0, std=sigma, a=-3 * sigma, b=3 * sigma)

        def in_blocks(split, sigma: float):
            return lambda whole: [trunc_normal(sigma)(block) for block in split(whole)]

        draw(self.transformer.wte.weight, trunc_normal(std))
        if not self.config.tie_embeddings:
            draw(self.lm_head.weight, trunc_normal(std))
        draw(self.transformer.adapter.weight, trunc_normal(std))
        for block in self.blocks():
            draw(block.attn.Wqkv.weight, in_blocks(lambda whole: whole.split(D), std))  # Q, K and V separately
            draw(block.attn.proj.weight, trunc_normal(out_std))
            draw(block.mlp.fc.weight, in_blocks(lambda whole: whole.chunk(2), std))
            draw(block.mlp.proj.weight, trunc_normal(out_std))
            if hasattr(block.attn, "qk_bias"):
                draw(block.attn.qk_bias, Tensor.zero_)
            for norm in (block.norm_1, block.norm_2, block.norm_3, block.norm_4):
                draw(norm.weight, lambda whole: whole.fill_(1.0))
        draw(self.transformer.ln_f.weight, lambda whole: whole.fill_(1.0))

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
        return_logits: bool = False,
    ) -> ModelOutput:
        """num_steps: (n, k) runs n iterations without and k with gradients. An int r runs r iterations, all
        without gradients in eval mode, the last min(r, mean_backprop_depth) with gradients in train mode.
        None means the mean depth: (mean_recurrence, 0) in eval, the sampler's mean split in train mode.
        input_states replaces the random initial latent state. ignore_index applies to labels.
        With labels and `loss_chunk_tokens` > 0 the loss is computed chunk by chunk without the full fp32
        logits, and `logits` is None unless return_logits=True."""
        position = len(cache) if cache is not None else 0
        self._check_input_ids(input_ids, position, values=self.check_token_ids)
        n, k = self._resolve_num_steps(num_steps)
        rope = self.freqs_cis[:, position : position + input_ids.shape[1]]

        # training only: generation passes a KV cache, evaluation runs without gradients
        checkpointing = (self.config.activation_checkpointing and self.training and torch.is_grad_enabled()
                         and cache is None)
        x = self.transformer.wte(input_ids) * self.config.embedding_scale
        for index, block in enumerate(self.transformer.prelude):
            x = checkpoint(block, x, rope, **CHECKPOINT_OPTIONS) if checkpointing else block(x, rope, cache, index)
        embedded = x

        state = self._initial_state(embedded) if input_states is None else input_states
        previous_state = state
        if n + k > 0:
            state, previous_state = self.transformer.core_block(
                state, self._inject(embedded), self._adapter_state_weight(), rope, (n, k), checkpointing, cache,
                self.config.n_layers_in_prelude)

        latent = self.transformer.ln_f(state)
        x = latent
        for index, block in enumerate(self.transformer.coda):
            x = checkpoint(block, x, rope, **CHECKPOINT_OPTIONS) if checkpointing else block(x, rope, cache, -1 - index)
        x = self.transformer.ln_f(x)

        logits, loss = None, None
        chunk = self.loss_chunk_tokens
        if labels is not None and chunk > 0 and not return_logits:
            loss = chunked_cross_entropy(x, self.lm_head.weight, labels, chunk, ignore_index)
        else:
            logits = self.lm_head(x).float()
            if labels is not None:
                loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index)
        telemetry = None
        if return_telemetry:
            telemetry = latent_telemetry(embedded, previous_state, latent, x, (n, k))
        return ModelOutput(logits=logits, loss=loss, num_steps=(n, k), telemetry=telemetry)

    def _inject(self, embedded: Tensor) -> Tensor:
        """e's half of the adapter, W[:, D:] e: the same in every iteration, so computed once per forward."""
        return F.linear(embedded, self.transformer.adapter.weight[:, self.config.n_embd :])

    def _adapter_state_weight(self) -> Tensor:
        """The state's half of the adapter, W[:, :D] (state first, then e, in the released concatenation)."""
        return self.transformer.adapter.weight[:, : self.config.n_embd]

    def _core(self, state: Tensor, injected: Tensor, rope: Tensor, cache: KVCache | None, iteration: int) -> Tensor:
        """One core iteration (generation steps them one at a time)."""
        first_index = self.config.n_layers_in_prelude + self.config.n_layers_in_recurrent_block * iteration
        return self.transformer.core_block.iterate(state, injected, self._adapter_state_weight(), rope, cache,
                                                   first_index)

    def _initial_state(self, embedded: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """The latent state the recurrence starts from: noise drawn from `generator` (None: torch's global one)."""
        if self.config.state_init == "zero":
            return torch.zeros_like(embedded)
        return self._noise_state(torch.empty_like(embedded).uniform_(*TRUNC_NORMAL_UNIFORM, generator=generator))

    def _noise_state(self, uniform: Tensor) -> Tensor:
        """Initial states from draws on TRUNC_NORMAL_UNIFORM (overwritten): truncated normal noise, scaled. A batch
        whose rows draw from their own generators draws each row, then maps them all at once."""
        return trunc_normal_from_uniform_(uniform, self.config.init_std) * self.config.embedding_scale

    def keyed_initial_state(self, keys: Tensor, seq_len: int, seed: int, device: torch.device) -> Tensor:
        """The initial latent state of rows with these keys (training's row keys, huginn_ray.train.shard_reader),
        drawn like the forward's own but row i from a generator seeded with `row_seed(seed, keys[i])`: a row gets
        the same noise on whichever rank, in whichever micro-batch it is trained (the forward's own draw comes
        from the rank's global RNG)."""
        state = torch.empty(len(keys), seq_len, self.config.n_embd, device=device)
        if self.config.state_init == "zero":
            return state.zero_()
        for row, key in enumerate(keys.tolist()):
            generator = torch.Generator(device=device).manual_seed(row_seed(seed, key))
            state[row].uniform_(*TRUNC_NORMAL_UNIFORM, generator=generator)
        return self._noise_state(state)

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

    def _check_input_ids(self, input_ids: Tensor, position: int, values: bool = True) -> None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (batch, length), got {tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be int64 or int32, got {input_ids.dtype}")
        length = position + input_ids.shape[1]
        if length > self.config.block_size:
            raise ValueError(
                f"sequence length {length} exceeds block_size={self.config.block_size} of this model"
            )
        if not values or input_ids.device.type == "meta":
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
    def _pick(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None,
              top_p: float | None = None) -> Tensor:
        """Greedy when temperature == 0; else a draw from softmax(logits / temperature) restricted to the top_k
        tokens, then to the smallest set of most probable tokens whose probability reaches top_p."""
        if temperature == 0:
            return logits.argmax(dim=-1)
        logits = logits / temperature
        if top_k is not None:
            threshold = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < threshold, float("-inf"))
        probs = logits.softmax(dim=-1)
        if top_p is not None and top_p < 1:
            ordered, order = probs.sort(dim=-1, descending=True)
            outside = ordered.cumsum(dim=-1) - ordered >= top_p  # the tokens before it already reach top_p
            probs = probs.scatter(-1, order, ordered.masked_fill(outside, 0.0))
        return torch.multinomial(probs, 1, generator=generator)[:, 0]


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
"""The uniform range whose inverse-CDF image is N(0, 1) truncated to [-3, 3] (trunc_normal_no_sync)."""


@torch.no_grad()
def trunc_normal_no_sync(tensor: Tensor, std: float, generator: torch.Generator | None = None) -> Tensor:
    """Fill with N(0, std^2) truncated to [-3 std, 3 std] by the inverse CDF, in place.

    This is how torch's `nn.init.trunc_normal_` sampled up to torch 2.5 (the reference's). Newer torch versions
    resample rejected values in a loop whose `mask.any()` reads the device once or more per call; the initial
    latent state is drawn in every forward, so that would be a host sync per micro-batch."""
    return trunc_normal_from_uniform_(tensor.uniform_(*TRUNC_NORMAL_UNIFORM, generator=generator), std)


@torch.no_grad()
def trunc_normal_from_uniform_(tensor: Tensor, std: float) -> Tensor:
    """The second half of trunc_normal_no_sync, in place: draws uniform on TRUNC_NORMAL_UNIFORM (each row from
    its own generator, say) to their truncated normal values, element by element, in one pass for all rows."""
    tensor.erfinv_()
    tensor.mul_(std * math.sqrt(2.0))
    return tensor.clamp_(min=-3 * std, max=3 * std)


@torch.no_grad()
def latent_telemetry(embedded: Tensor, previous_state: Tensor, latent: Tensor, last_hidden: Tensor,
                     num_steps: tuple[int, int]) -> dict[str, Tensor]:
    """How the recurrence behaved this step: norms of the latent state, its change in the last iteration,
    its distance from the input embedding e, and how similar token states have become (collapse shows as
    correlation near 1). Scalars on the model's device, so that the caller reads them with the rest of its
    metrics (training: once per log interval)."""
    def mean_token_norm(x: Tensor) -> Tensor:
        return x.float().norm(dim=-1).mean()

    def token_correlation(x: Tensor) -> Tensor:
        tokens = x[0].float()
        tokens = tokens - tokens.mean(dim=0, keepdim=True)
        tokens = F.normalize(tokens, dim=-1)
        length = tokens.shape[0]
        return (tokens @ tokens.T).mean() - 1.0 / length

    residual = mean_token_norm(latent - previous_state)
    state_norm = mean_token_norm(latent)
    return {
        "recurrent_state_norm": state_norm,
        "last_hidden_norm": mean_token_norm(last_hidden),
        "recurrent_residual": residual,
        "rel_residual": residual / state_norm.clamp(min=1e-12),
        "recurrent_diff": mean_token_norm(latent - embedded),
        "recurrent_state_token_corr": token_correlation(latent),
        "last_hidden_token_corr": token_correlation(last_hidden),
        "num_steps_no_grad": torch.tensor(float(num_steps[0]), device=latent.device),
        "num_steps_with_grad": torch.tensor(float(num_steps[1]), device=latent.device),
    }
