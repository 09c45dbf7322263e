"""Configuration of the Huginn recurrent-depth model for `transformers` (written by huginn_ray's export).

Only torch and transformers are needed. The field names are those of the released Huginn-0125 config.json.
"""

import math

from transformers import PretrainedConfig


class RavenConfig(PretrainedConfig):
    model_type = "huginn_raven"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        n_embd: int = 5280,
        n_heads: int = 55,
        intermediate_size: int = 17920,
        n_layers_in_prelude: int = 2,
        n_layers_in_recurrent_block: int = 4,
        n_layers_in_coda: int = 2,
        vocab_size: int = 65536,
        padding_multiple: int = 4096,
        block_size: int = 4096,
        mean_recurrence: int = 32,
        mean_backprop_depth: int = 8,
        rope_base: float = 50000.0,
        norm_eps: float = 1e-6,
        qk_bias: bool = True,
        tie_embeddings: bool = True,
        state_init: str = "like-init",
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        self.n_embd = n_embd
        self.n_heads = n_heads
        self.num_key_value_heads = n_heads
        self.head_dim = n_embd // n_heads
        self.intermediate_size = intermediate_size
        self.n_layers_in_prelude = n_layers_in_prelude
        self.n_layers_in_recurrent_block = n_layers_in_recurrent_block
        self.n_layers_in_coda = n_layers_in_coda
        self.n_layers = n_layers_in_prelude + n_layers_in_recurrent_block + n_layers_in_coda
        self.vocab_size = vocab_size
        self.padding_multiple = padding_multiple
        self.padded_vocab_size = math.ceil(vocab_size / padding_multiple) * padding_multiple
        self.block_size = block_size
        self.mean_recurrence = mean_recurrence
        self.mean_backprop_depth = mean_backprop_depth
        self.rope_base = float(rope_base)
        self.norm_eps = norm_eps
        self.qk_bias = qk_bias
        self.tie_embeddings = tie_embeddings
        self.state_init = state_init
        # what generic transformers code (caches, pipelines, lm-eval) looks for
        self.hidden_size = n_embd
        self.num_attention_heads = n_heads
        self.max_position_embeddings = block_size
        self.num_hidden_layers = n_layers_in_prelude + n_layers_in_coda + n_layers_in_recurrent_block * mean_recurrence
        for key in ("hidden_size", "num_attention_heads", "max_position_embeddings", "num_hidden_layers",
                    "tie_word_embeddings"):
            kwargs.pop(key, None)
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         tie_word_embeddings=tie_embeddings, **kwargs)

    @property
    def init_std(self) -> float:
        return math.sqrt(2 / (5 * self.n_embd))
