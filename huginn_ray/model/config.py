"""ModelConfig: the shape of a recurrent-depth model, with the field names of the released config.json.

`ModelConfig.from_json("config.json")` reads the released Huginn-0125 `config.json` as it is; the registry
holds `nebel-raven-3.5b` (the trained model) and small shapes for tests and CPU demos:

    cfg = ModelConfig.from_name("raven-tiny", vocab_size=4096)
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

# Architecture choices of the released model that this implementation does not vary. config.json files carry
# them; loading one with another value is refused instead of silently building a different model.
FIXED_ARCHITECTURE = {
    "architecture_class_name": "RecurrentGPT",
    "bias": False,
    "block_class_name": "SandwichBlock",
    "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU",
    "norm_class_name": "RMSNorm_llama",
    "injection_type": "linear",
    "init_strategy": "takase",
    "init_orthogonal": False,
    "sampling_scheme": "poisson-lognormal-filling",
    "test_time_noise": 0,
}
# Keys of a Hugging Face config.json that describe packaging or inference defaults, not the architecture.
HF_METADATA_KEYS = {
    "architectures", "auto_map", "model_type", "torch_dtype", "dtype", "transformers_version", "bos_token_id",
    "eos_token_id", "pad_token_id", "tie_word_embeddings", "use_cache", "test_time_noise_type",
    "activation_checkpoint_impl", "hf_config", "num_hidden_layers",
}
# Keys that follow from the other fields; a file that carries them must agree.
DERIVED_KEYS = {"n_heads", "num_key_value_heads", "head_dim", "n_layers", "padded_vocab_size", "effective_expected_depth", "init_values"}


@dataclass(frozen=True)
class ModelConfig:
    name: str = "custom"
    """Registry name, or 'custom'."""
    block_size: int = 4096
    """Longest sequence the model accepts; also the length of the RoPE table."""
    vocab_size: int = 65536
    """Tokenizer vocabulary size; token ids must be below it."""
    padding_multiple: int = 4096
    """The embedding and head have vocab_size rounded up to a multiple of this."""
    n_embd: int = 5280
    """Width D of the residual stream and of the latent state."""
    num_attention_heads: int = 55
    """Attention heads (plain multi-head attention; head_dim = n_embd / heads)."""
    intermediate_size: int = 17920
    """Hidden width of the gated MLP (its first Linear outputs twice this)."""
    n_layers_in_prelude: int = 2
    """Sandwich blocks applied once to the embedded tokens, giving e."""
    n_layers_in_recurrent_block: int = 4
    """Sandwich blocks of the core, applied once per recurrent iteration."""
    n_layers_in_coda: int = 2
    """Sandwich blocks applied once after the recurrence."""
    mean_recurrence: int = 32
    """Mean number of core iterations during training, and the default depth at evaluation."""
    mean_backprop_depth: int = 8
    """The last min(depth, this) iterations get gradients (truncated backprop)."""
    state_init: Literal["like-init", "zero"] = "like-init"
    """Initial latent state: 'like-init' draws trunc-normal noise every forward (as trained); 'zero' is deterministic."""
    rope_base: float = 50000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    qk_bias: bool = True
    """Learned additive bias on queries and keys, added before RoPE."""
    tie_embeddings: bool = True
    """lm_head shares the embedding matrix."""
    activation_checkpointing: bool = False
    """Recompute every sandwich block in backward instead of storing its activations: each prelude and coda block,
    and each block of every gradient-carrying core iteration; only each block's input is kept."""

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "padding_multiple", "n_embd", "num_attention_heads",
                     "intermediate_size", "n_layers_in_recurrent_block", "mean_recurrence", "mean_backprop_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        for name in ("n_layers_in_prelude", "n_layers_in_coda"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ModelConfig.{name} must be a non-negative integer, got {value!r}")
        for name in ("rope_base", "norm_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)!r}")
        if self.n_embd % self.num_attention_heads:
            raise ValueError(
                f"ModelConfig.n_embd={self.n_embd} is not divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.num_attention_heads: head_dim {self.head_dim} must be even for RoPE")
        if self.state_init not in ("like-init", "zero"):
            raise ValueError(f"ModelConfig.state_init must be 'like-init' or 'zero', got {self.state_init!r}")

    # ---- derived quantities -------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.n_embd // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / self.padding_multiple) * self.padding_multiple

    @property
    def effective_expected_depth(self) -> int:
        """Prelude + coda + core x mean recurrence: the depth the takase output-projection init is scaled for."""
        return self.n_layers_in_prelude + self.n_layers_in_coda + self.n_layers_in_recurrent_block * self.mean_recurrence

    @property
    def init_std(self) -> float:
        return math.sqrt(2 / (5 * self.n_embd))

    @property
    def init_std_out_proj(self) -> float:
        return self.init_std / math.sqrt(2 * self.effective_expected_depth)

    @property
    def embedding_scale(self) -> float:
        return math.sqrt(self.n_embd)

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "ModelConfig":
        if name not in MODEL_REGISTRY:
            raise ValueError(f"unknown model name {name!r}; known: {', '.join(sorted(MODEL_REGISTRY))}")
        return cls._build({**MODEL_REGISTRY[name], "name": name, **overrides})

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"model config not found: {path}") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
        try:
            return cls.from_hf_dict(data)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None

    @classmethod
    def from_hf_dict(cls, data: dict) -> "ModelConfig":
        data = dict(data)
        if "n_heads" in data and "num_attention_heads" not in data:
            data["num_attention_heads"] = data["n_heads"]
        if isinstance(data.get("rope_settings"), dict):  # training-code layout
            data.setdefault("rope_base", data.pop("rope_settings").get("rope_base", 50000.0))
        for key, expected in FIXED_ARCHITECTURE.items():
            if key in data and data.pop(key) != expected:
                raise ValueError(f"config field {key!r} must be {expected!r}; other architectures are not implemented")
        derived = {k: data.pop(k) for k in list(data) if k in DERIVED_KEYS}
        for key in HF_METADATA_KEYS:
            data.pop(key, None)
        config = cls._build(data)
        config._check_derived(derived)
        return config

    @classmethod
    def _build(cls, values: dict) -> "ModelConfig":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(f"unknown ModelConfig field {unknown[0]!r}; known fields: {', '.join(sorted(fields))}")
        if isinstance(values.get("rope_base"), int):
            values["rope_base"] = float(values["rope_base"])
        return cls(**values)

    def derived_fields(self) -> dict:
        """The HF file's keys that follow from the fields (written by to_hf_dict, checked on load)."""
        return {
            "n_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "head_dim": self.head_dim,
            "n_layers": self.n_layers_in_prelude + self.n_layers_in_recurrent_block + self.n_layers_in_coda,
            "padded_vocab_size": self.padded_vocab_size,
            "effective_expected_depth": self.effective_expected_depth,
        }

    def _check_derived(self, derived: dict) -> None:
        expected = self.derived_fields()
        for key, value in derived.items():
            if key == "init_values":
                continue  # follows from n_embd and depth; informational in the HF file
            if value != expected[key]:
                raise ValueError(f"config field {key!r} is {value!r}, but the other fields imply {expected[key]!r}")

    def replace(self, **changes: Any) -> "ModelConfig":
        return type(self)._build({**dataclasses.asdict(self), **changes})

    def to_hf_dict(self) -> dict:
        """The config.json of a saved model: our fields plus the HF file's derived and fixed keys."""
        return {
            **dataclasses.asdict(self),
            **FIXED_ARCHITECTURE,
            **self.derived_fields(),
            "init_values": {
                "std": self.init_std,
                "out_proj": self.init_std_out_proj,
                "embedding": self.init_std,
                "embed_scale": self.embedding_scale,
            },
        }

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")


MODEL_REGISTRY: dict[str, dict[str, Any]] = {
    # Huginn-0125 as trained on Frontier (reference §1.1): 3,564,976,800 parameters.
    "nebel-raven-3.5b": dict(
        block_size=4096, vocab_size=65536, padding_multiple=4096, n_embd=5280, num_attention_heads=55,
        intermediate_size=17920, n_layers_in_prelude=2, n_layers_in_recurrent_block=4, n_layers_in_coda=2,
        mean_recurrence=32, mean_backprop_depth=8, activation_checkpointing=True,
    ),
    # ~0.35M parameters: unit tests and the 2-worker CPU training runs.
    "raven-tiny": dict(
        block_size=256, vocab_size=4096, padding_multiple=64, n_embd=64, num_attention_heads=4,
        intermediate_size=160, n_layers_in_prelude=1, n_layers_in_recurrent_block=2, n_layers_in_coda=1,
        mean_recurrence=4, mean_backprop_depth=2,
    ),
    # ~17M parameters: CPU demos and benchmarks with the full 2/4/2 layout.
    "raven-small": dict(
        block_size=1024, vocab_size=4096, padding_multiple=64, n_embd=384, num_attention_heads=6,
        intermediate_size=1024, n_layers_in_prelude=2, n_layers_in_recurrent_block=4, n_layers_in_coda=2,
        mean_recurrence=8, mean_backprop_depth=4,
    ),
}
