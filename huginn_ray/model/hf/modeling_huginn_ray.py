"""The Huginn recurrent-depth transformer for `transformers` (written by huginn_ray's export).

Only torch and transformers are needed. Same math and parameter names as huginn_ray's RecurrentGPT and the
released Huginn-0125 checkpoint:

    tokens -> embedding * sqrt(D) -> prelude -> e
    s_0 ~ noise (or input_states);  s_{i+1} = core(adapter(concat[s_i, e]))  for num_steps iterations
    ln_f(s_r) -> coda -> ln_f -> tied head -> logits

forward(..., num_steps=r or [n, k], input_states=s_0); generate(..., num_steps=r) passes num_steps to every step.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_huginn_ray import RavenConfig


def _normal_cdf(x):
    return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0


_TRUNC_NORMAL_UNIFORM = (2 * _normal_cdf(-3.0) - 1, 2 * _normal_cdf(3.0) - 1)
"""The uniform range whose inverse-CDF image is N(0, 1) truncated to [-3, 3]."""


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_table(head_dim, length, base):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)[None, :, None]


def apply_rope(q, k, table):
    """Rotate adjacent pairs (2j, 2j+1) of every head vector, in fp32."""
    heads = q.shape[2]
    pairs = torch.cat([q, k], dim=2).float().unflatten(-1, (-1, 2))
    cos, sin = table[..., 0].float(), table[..., 1].float()
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
    return rotated.to(q.dtype).split(heads, dim=2)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads, self.head_dim = config.n_heads, config.n_embd // config.n_heads
        self.Wqkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        if config.qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.heads, self.head_dim))
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, rope, cache, layer_idx, mask):
        batch, length, width = x.shape
        q, k, v = self.Wqkv(x).view(batch, length, 3, self.heads, self.head_dim).unbind(dim=2)
        if hasattr(self, "qk_bias"):
            q = (q + self.qk_bias[0]).to(q.dtype)
            k = (k + self.qk_bias[1]).to(q.dtype)
        q, k = apply_rope(q, k, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (batch, heads, length, head_dim)
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class GatedMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 2 * config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x):
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class SandwichBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.norm_3 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = GatedMLP(config)
        self.norm_4 = RMSNorm(config.n_embd, config.norm_eps)

    def forward(self, x, rope, cache, layer_idx, mask):
        x = self.norm_2(self.attn(self.norm_1(x), rope, cache, layer_idx, mask) + x)
        return self.norm_4(self.mlp(self.norm_3(x)) + x)


class RavenPreTrainedModel(PreTrainedModel):
    config_class = RavenConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["SandwichBlock"]

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # forward makes its own DynamicCache, indexed by block and iteration

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.init_std
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, CausalSelfAttention) and hasattr(module, "qk_bias"):
            module.qk_bias.zero_()


class RavenForCausalLM(RavenPreTrainedModel, GenerationMixin):
    # transformers 5 names tied weights with a {target: source} dict, 4.x with a list of targets
    _tied_weights_keys = ({"lm_head.weight": "transformer.wte.weight"}
                          if int(__import__("transformers").__version__.split(".")[0]) >= 5 else ["lm_head.weight"])

    def __init__(self, config):
        super().__init__(config)
        c = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.padded_vocab_size, c.n_embd),
            prelude=nn.ModuleList(SandwichBlock(c) for _ in range(c.n_layers_in_prelude)),
            adapter=nn.Linear(2 * c.n_embd, c.n_embd, bias=False),
            core_block=nn.ModuleList(SandwichBlock(c) for _ in range(c.n_layers_in_recurrent_block)),
            coda=nn.ModuleList(SandwichBlock(c) for _ in range(c.n_layers_in_coda)),
            ln_f=RMSNorm(c.n_embd, c.norm_eps),
        ))
        self.lm_head = nn.Linear(c.n_embd, c.padded_vocab_size, bias=False)
        self.register_buffer("freqs_cis", rope_table(c.n_embd // c.n_heads, c.block_size, c.rope_base))
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.wte

    def set_input_embeddings(self, value):
        self.transformer.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def _layer_index(self, part, index, iteration=0):
        """Cache slot of a block: prelude 0..P-1, coda P..P+C-1, then core block j of iteration i."""
        c = self.config
        if part == "prelude":
            return index
        if part == "coda":
            return c.n_layers_in_prelude + index
        return c.n_layers_in_prelude + c.n_layers_in_coda + c.n_layers_in_recurrent_block * iteration + index

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, num_steps=None, input_states=None, use_cache=None,
                output_hidden_states=None, return_dict=None, cache_position=None, **kwargs):
        c = self.config
        if past_key_values is None and use_cache:
            past_key_values = DynamicCache()
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        length = input_ids.shape[1] if input_ids is not None else inputs_embeds.shape[1]
        rope = self.freqs_cis[:, past : past + length]
        mask = self._mask(attention_mask, past, length, input_ids if input_ids is not None else inputs_embeds)
        n, k = self._num_steps(num_steps)

        x = self.transformer.wte(input_ids) * math.sqrt(c.n_embd) if inputs_embeds is None else inputs_embeds
        for i, block in enumerate(self.transformer.prelude):
            x = block(x, rope, past_key_values, self._layer_index("prelude", i), mask)
        embedded = x
        state = self._initial_state(embedded) if input_states is None else input_states.to(embedded.dtype)
        for step in range(n + k):
            with torch.set_grad_enabled(torch.is_grad_enabled() and step >= n):
                x = self.transformer.adapter(torch.cat([state, embedded], dim=-1))
                for j, block in enumerate(self.transformer.core_block):
                    x = block(x, rope, past_key_values, self._layer_index("core", j, step), mask)
                state = x
        x = self.transformer.ln_f(state)
        for i, block in enumerate(self.transformer.coda):
            x = block(x, rope, past_key_values, self._layer_index("coda", i), mask)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x).float()

        loss = None
        if labels is not None:  # transformers convention: labels are the inputs, shifted here
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=past_key_values,
                                      hidden_states=(state,) if output_hidden_states else None)

    def _num_steps(self, num_steps):
        if num_steps is None:
            num_steps = self.config.mean_recurrence
        if torch.is_tensor(num_steps):
            num_steps = num_steps.tolist()
        if isinstance(num_steps, (list, tuple)):
            return int(num_steps[0]), int(num_steps[1])
        return int(num_steps), 0

    def _initial_state(self, embedded):
        if self.config.state_init == "zero":
            return torch.zeros_like(embedded)
        # N(0, std^2) truncated at 3 std by the inverse CDF of uniform draws, as huginn_ray's own model draws it, so
        # that one seed gives one state on both (torch's trunc_normal_ resamples since torch 2.6: other values)
        std = self.config.init_std
        state = torch.empty_like(embedded).uniform_(*_TRUNC_NORMAL_UNIFORM)
        state.erfinv_().mul_(std * math.sqrt(2.0)).clamp_(min=-3 * std, max=3 * std)
        return state * math.sqrt(self.config.n_embd)

    @staticmethod
    def _mask(attention_mask, past, length, like):
        """None (plain causal) unless there are cached positions or padding; else a boolean (B, 1, T, past+T)."""
        if (attention_mask is None or bool(attention_mask.all())) and past == 0:
            return None
        mask = torch.ones(length, past + length, dtype=torch.bool, device=like.device).tril(diagonal=past)[None, None]
        if attention_mask is not None and not bool(attention_mask.all()):
            keys = attention_mask[:, None, None, -(past + length):].bool()
            mask = mask & keys
            diagonal = torch.arange(length, device=like.device)[:, None] + past == torch.arange(past + length, device=like.device)
            mask = mask | diagonal[None, None]  # a padded query still attends to itself (no all-masked rows)
        return mask

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, **kwargs):
        if past_key_values is not None and past_key_values.get_seq_length() > 0:
            input_ids = input_ids[:, past_key_values.get_seq_length():]
        inputs = {"input_ids": input_ids, "past_key_values": past_key_values, "attention_mask": attention_mask,
                  "use_cache": kwargs.get("use_cache", True)}
        if kwargs.get("num_steps") is not None:
            inputs["num_steps"] = kwargs["num_steps"]
        return inputs
