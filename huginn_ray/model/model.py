"""The Huginn recurrent-depth transformer (arXiv 2502.05171).

    tokens -> embedding * sqrt(D) -> prelude -> e                                    embed_and_prelude
    s_0 ~ noise                                                                       initial_state
    s_{i+1} = core(adapter(concat[s_i, e]))   for depth r = n + k iterations         inject, core_step
    ln_f(s_r) -> coda -> ln_f -> tied head -> logits                                  coda_and_head

The first n iterations run without autograd and only the last k carry gradients (truncated backprop), so the
memory a training step keeps does not grow with the sampled depth. `forward` runs every stage; generation and
training's memory plan call the stages (the public methods named on the right) one at a time. Parameter and
buffer names are those of the released Hugging Face checkpoint, so state_dicts move between the two unchanged.
The blocks are in huginn_ray.model.blocks, the latent noise in huginn_ray.model.noise. `split_sequence` trains on
a part of every sequence (context parallelism: the caller passes the split and its attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from huginn_ray.model.attention import SequenceSplit, rope_table
from huginn_ray.model.blocks import CHECKPOINT_OPTIONS, RecurrentCore, RMSNorm, SandwichBlock
from huginn_ray.model.cache import KVCache
from huginn_ray.model.config import ModelConfig
from huginn_ray.model.loss import chunked_cross_entropy
from huginn_ray.model.noise import TRUNC_NORMAL_UNIFORM, row_seed, trunc_normal_from_uniform_
from huginn_ray.model.telemetry import latent_telemetry


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
        loss_chunk_tokens: int = 0,
        check_token_ids: bool = True,
    ) -> ModelOutput:
        """num_steps: (n, k) runs n iterations without and k with gradients. An int r runs r iterations, all
        without gradients in eval mode, the last min(r, mean_backprop_depth) with gradients in train mode.
        None means the mean depth: (mean_recurrence, 0) in eval, the sampler's mean split in train mode.
        input_states replaces the random initial latent state. ignore_index applies to labels.
        loss_chunk_tokens > 0: with labels, the head and the loss are computed over chunks of this many tokens
        (chunked_cross_entropy) without materialising (tokens x padded vocab) fp32 logits, and `logits` is None
        unless return_logits=True (training passes its config's). check_token_ids: check that the token ids lie
        in [0, vocab_size), which costs a host sync (training turns it off: its collate step checks every batch
        on the host before it reaches the device)."""
        position = len(cache) if cache is not None else 0
        self._check_input_ids(input_ids, position, values=check_token_ids)
        n, k = self._resolve_num_steps(num_steps)
        rope = self.rope(position, input_ids.shape[1], cache is None)

        # training only: generation passes a KV cache, evaluation runs without gradients
        checkpointing = (self.config.activation_checkpointing and self.training and torch.is_grad_enabled()
                         and cache is None)
        embedded = self.embed_and_prelude(input_ids, rope, cache, checkpointing)

        state = self.initial_state(embedded) if input_states is None else input_states
        previous_state = state
        if n + k > 0:
            state, previous_state = self.transformer.core_block(
                state, self.inject(embedded), self.adapter_state_weight(), rope, (n, k), checkpointing, cache,
                self.config.n_layers_in_prelude)

        latent = self.transformer.ln_f(state)
        x = self.transformer.ln_f(self.coda(latent, rope, cache, checkpointing))

        logits, loss = None, None
        if labels is not None and loss_chunk_tokens > 0 and not return_logits:
            loss = chunked_cross_entropy(x, self.lm_head.weight, labels, loss_chunk_tokens, ignore_index)
        else:
            logits = self.lm_head(x).float()
            if labels is not None:
                loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index)
        telemetry = None
        if return_telemetry:
            telemetry = latent_telemetry(embedded, previous_state, latent, x, (n, k))
        return ModelOutput(logits=logits, loss=loss, num_steps=(n, k), telemetry=telemetry)

    # ---- the stages of a forward, one at a time (generation steps them; `cache` is any object with the KV-cache
    # protocol of CausalSelfAttention: KVCache, or generation's batched rows) ------------------------------------
    def embed_and_prelude(self, input_ids: Tensor, rope: Tensor, cache=None, checkpointing: bool = False) -> Tensor:
        """e: the embedding of `input_ids` (batch, length), scaled, through the prelude blocks; each block
        checkpointed on its own when `checkpointing` (training, no cache)."""
        x = self.transformer.wte(input_ids) * self.config.embedding_scale
        for index, block in enumerate(self.transformer.prelude):
            x = checkpoint(block, x, rope, **CHECKPOINT_OPTIONS) if checkpointing else block(x, rope, cache, index)
        return x

    def inject(self, embedded: Tensor) -> Tensor:
        """e's half of the adapter, W[:, D:] e: the same in every iteration, so computed once per forward."""
        return F.linear(embedded, self.transformer.adapter.weight[:, self.config.n_embd :])

    def adapter_state_weight(self) -> Tensor:
        """The state's half of the adapter, W[:, :D] (state first, then e, in the released concatenation)."""
        return self.transformer.adapter.weight[:, : self.config.n_embd]

    def core_step(self, state: Tensor, injected: Tensor, rope: Tensor, cache, iteration: int) -> Tensor:
        """One core iteration, `iteration` keying the cache's block indices (generation steps them one at a time;
        `injected` is `inject(e)`)."""
        first_index = self.config.n_layers_in_prelude + self.config.n_layers_in_recurrent_block * iteration
        return self.transformer.core_block.iterate(state, injected, self.adapter_state_weight(), rope, cache,
                                                   first_index)

    def coda(self, latent: Tensor, rope: Tensor, cache=None, checkpointing: bool = False) -> Tensor:
        """The coda blocks over the normalised final state ln_f(s_r); each checkpointed on its own when
        `checkpointing`."""
        x = latent
        for index, block in enumerate(self.transformer.coda):
            x = checkpoint(block, x, rope, **CHECKPOINT_OPTIONS) if checkpointing else block(x, rope, cache, -1 - index)
        return x

    def coda_and_head(self, state: Tensor, rope: Tensor, cache=None, last: Tensor | None = None) -> Tensor:
        """fp32 logits (batch, padded_vocab) of one position per row of the final states (batch, length, D):
        ln_f, the coda, then the position `last[row]` of each row (None: the last position), ln_f and the head."""
        x = self.coda(self.transformer.ln_f(state), rope, cache)
        x = x[:, -1] if last is None else x[torch.arange(len(last)), last]
        return self.lm_head(self.transformer.ln_f(x)).float()

    # ---- a sequence split over ranks (context parallelism) ----------------------------------------------------
    sequence_split: SequenceSplit | None = None
    """Set by `split_sequence`: the forward's tokens are the split's positions of the sequence."""

    def split_sequence(self, split: SequenceSplit | None) -> RecurrentGPT:
        """Train on a part of every sequence (context parallelism): the tokens a forward gets are those at
        `split.positions`, every attention call without a KV cache attends through `split.attend` (over the whole
        sequence), the RoPE angles are the positions', and `keyed_initial_state` draws each row's noise whole and
        keeps the positions'. None: whole sequences again. Returns the model."""
        self.sequence_split = split
        for block in self.blocks():
            block.attn.sequence_split = split
        return self

    def rope(self, position: int, length: int, split: bool = True) -> Tensor:
        """The RoPE table of `length` tokens from `position`, or (`split` and the model trains on a split
        sequence) of the split's positions."""
        if split and self.sequence_split is not None:
            positions = self.sequence_split.positions
            if len(positions) != length:
                raise ValueError(f"{length} tokens, but this rank's part of the split sequence holds {len(positions)}")
            return self.freqs_cis[:, positions]
        return self.freqs_cis[:, position : position + length]

    # ---- the initial latent state --------------------------------------------------------------------------
    def initial_state(self, embedded: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """The latent state the recurrence starts from: noise drawn from `generator` (None: torch's global one)."""
        if self.config.state_init == "zero":
            return torch.zeros_like(embedded)
        return self.noise_from_uniform(torch.empty_like(embedded).uniform_(*TRUNC_NORMAL_UNIFORM, generator=generator))

    def noise_from_uniform(self, uniform: Tensor) -> Tensor:
        """Initial states from draws on TRUNC_NORMAL_UNIFORM (overwritten): truncated normal noise, scaled. A batch
        whose rows draw from their own generators draws each row, then maps them all at once."""
        return trunc_normal_from_uniform_(uniform, self.config.init_std) * self.config.embedding_scale

    def keyed_initial_state(self, keys: Tensor, seq_len: int, seed: int, device: torch.device) -> Tensor:
        """The initial latent state of rows with these keys (training's row keys, huginn_ray.train.shard_reader),
        drawn like the forward's own but row i from a generator seeded with `row_seed(seed, keys[i])`: a row gets
        the same noise on whichever rank, in whichever micro-batch it is trained (the forward's own draw comes
        from the rank's global RNG). On a split sequence (`split_sequence`) `seq_len` is the whole row's: each row's
        noise is drawn whole (one row's transient) and the split's positions kept, the unsplit run's values."""
        positions = self.sequence_split.positions if self.sequence_split is not None else None
        local = seq_len if positions is None else len(positions)
        state = torch.empty(len(keys), local, self.config.n_embd, device=device)
        if self.config.state_init == "zero":
            return state.zero_()
        whole = None if positions is None else torch.empty(seq_len, self.config.n_embd, device=device)
        for row, key in enumerate(keys.tolist()):
            generator = torch.Generator(device=device).manual_seed(row_seed(seed, key))
            if whole is None:
                state[row].uniform_(*TRUNC_NORMAL_UNIFORM, generator=generator)
            else:
                state[row] = whole.uniform_(*TRUNC_NORMAL_UNIFORM, generator=generator)[positions]
        return self.noise_from_uniform(state)

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

    # ---- storage and initial weights -----------------------------------------------------------------------
    @torch.no_grad()
    def materialize(self, device: torch.device | str) -> "RecurrentGPT":
        """Allocate a model built on the meta device on `device` and initialise it there (`initialise`): bitwise
        the model constructed on `device`, without a CPU copy first."""
        return self.allocate(device).initialise()

    def allocate(self, device: torch.device | str) -> "RecurrentGPT":
        """Give a model built on the meta device (possibly sharded by a wrapper: each rank its shards)
        uninitialised storage on `device`, the tied head re-tied (`to_empty` gives every module a tensor of its
        own) and the RoPE table computed; the weights are then initialised or loaded."""
        self.to_empty(device=device)
        if self.config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.freqs_cis = rope_table(self.config.head_dim, self.config.block_size, self.config.rope_base).to(device)
        return self

    @torch.no_grad()
    def initialise(self, draw=None) -> "RecurrentGPT":
        """Draw the initial weights into allocated storage from torch's global RNG: exactly the random numbers, in
        the order, that a model constructed on the device draws (the default inits of nn.Linear / nn.Embedding in
        construction order, which `reset_parameters` then overwrites, then `reset_parameters`), so the values are
        bitwise those of the constructed model. The default inits are still drawn because their random numbers
        decide where `reset_parameters`' draws start. `draw(parameter, init)` applies `init` to the parameter's
        whole tensor (default: the parameter itself); a sharded model's caller passes one that draws each
        parameter whole and keeps its own part (huginn_ray.train.sharded_init)."""
        draw = draw or (lambda param, init: init(param))
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
        """`draw(parameter, init)` applies `init` to the parameter's whole tensor: by default the parameter itself
        (`initialise` passes its caller's)."""
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


# ---------------------------------------------------------------------------------------------------------
# Depth sampling (training)
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
