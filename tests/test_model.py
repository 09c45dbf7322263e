"""The recurrent-depth model against the facts of the reference sheet (§1, §2) and hand computations."""

import json
import math
import statistics

import pytest
import torch
from safetensors import safe_open
from torch.utils.flop_counter import FlopCounterMode

from huginn_ray.model import (
    KVCache,
    ModelConfig,
    RecurrentGPT,
    load_pretrained,
    sample_recurrence,
    save_pretrained,
    training_flops_per_token,
)
from huginn_ray.generation.generate import generate
from huginn_ray.model.attention import rope_table, rotate
from huginn_ray.model.blocks import RMSNorm


def tiny(**overrides) -> ModelConfig:
    return ModelConfig.from_name("raven-tiny", **overrides)


def build(config: ModelConfig, seed: int = 0) -> RecurrentGPT:
    torch.manual_seed(seed)
    return RecurrentGPT(config)


# ---- architecture and parameter layout -------------------------------------------------------------------
def test_nebel_raven_parameter_count_on_meta():
    config = ModelConfig.from_name("nebel-raven-3.5b")
    with torch.device("meta"):
        model = RecurrentGPT(config)
    assert sum(p.numel() for p in model.parameters()) == 3_564_976_800
    assert sum(p.numel() for p in model.transformer.core_block[0].parameters()) == 395_398_080
    assert model.transformer.adapter.weight.shape == (5280, 10560)
    assert model.freqs_cis.shape == (1, 4096, 1, 48, 2)
    assert model.transformer.prelude[0].attn.qk_bias.shape == (2, 1, 55, 96)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_state_dict_keys_are_the_hugging_face_layout():
    model = build(tiny(n_layers_in_prelude=2, n_layers_in_recurrent_block=4, n_layers_in_coda=2))
    per_block = ["norm_1.weight", "attn.Wqkv.weight", "attn.qk_bias", "attn.proj.weight", "norm_2.weight",
                 "norm_3.weight", "mlp.fc.weight", "mlp.proj.weight", "norm_4.weight"]
    expected = {"freqs_cis", "transformer.wte.weight", "transformer.adapter.weight", "transformer.ln_f.weight",
                "lm_head.weight"}
    for part, count in (("prelude", 2), ("core_block", 4), ("coda", 2)):
        expected |= {f"transformer.{part}.{i}.{name}" for i in range(count) for name in per_block}
    assert set(model.state_dict()) == expected


def test_every_sharding_unit_is_a_module_with_a_forward_not_a_container():
    # torch 2.11's fully_shard (the lent H100 image) raises on any nn.ModuleList or nn.ModuleDict, even one with
    # its own forward: the core block was a ModuleList subclass, and HSDP failed there at its first shard call
    model = build(tiny(n_layers_in_prelude=2, n_layers_in_recurrent_block=3, n_layers_in_coda=2))
    core = model.transformer.core_block
    for unit in [*model.transformer.prelude, *model.transformer.coda, core, model]:
        assert not isinstance(unit, (torch.nn.ModuleList, torch.nn.ModuleDict))
        assert type(unit).forward is not torch.nn.Module.forward
    assert len(core) == 3 and list(core) == [core[0], core[1], core[2]] and core[-1] is core[2]


def test_takase_init_stds():
    config = ModelConfig.from_name("raven-small")
    model = build(config)
    std, out_std = math.sqrt(2 / (5 * 384)), math.sqrt(2 / (5 * 384)) / math.sqrt(2 * (2 + 2 + 4 * 8))
    block = model.transformer.core_block[1]
    # trunc-normal at +-3 sigma has std 0.9866 sigma
    for tensor, sigma in [(model.transformer.wte.weight, std), (block.attn.Wqkv.weight, std),
                          (block.mlp.fc.weight[1024:], std), (block.mlp.fc.weight[:1024], std),
                          (model.transformer.adapter.weight, std), (block.attn.proj.weight, out_std),
                          (block.mlp.proj.weight, out_std)]:
        assert tensor.std().item() == pytest.approx(0.9866 * sigma, rel=0.03)
        assert tensor.abs().max().item() <= 3 * sigma + 1e-9
    assert torch.all(block.attn.qk_bias == 0) and torch.all(block.norm_3.weight == 1)


# ---- config ------------------------------------------------------------------------------------------------
def test_released_config_json_loads_as_it_is(tmp_path):
    released = {  # the fields of tomg-group-umd/huginn-0125 config.json
        "architectures": ["RavenForCausalLM"], "model_type": "huginn_raven", "torch_dtype": "float32",
        "bias": False, "block_class_name": "SandwichBlock", "block_size": 4096, "effective_expected_depth": 132,
        "head_dim": 96, "init_orthogonal": False, "init_strategy": "takase",
        "init_values": {"embed_scale": 72.6636084983398, "embedding": 0.008703882797784892,
                        "out_proj": 0.0005356869554443541, "std": 0.008703882797784892},
        "injection_type": "linear", "intermediate_size": 17920, "mean_backprop_depth": 8, "mean_recurrence": 32,
        "mlp_class_name": "GatedMLP", "n_embd": 5280, "n_heads": 55, "n_layers": 8, "n_layers_in_coda": 2,
        "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4, "nonlin_name": "SiLU",
        "norm_class_name": "RMSNorm_llama", "norm_eps": 1e-06, "num_key_value_heads": 55, "padded_vocab_size": 65536,
        "padding_multiple": 4096, "qk_bias": True, "rope_base": 50000, "sampling_scheme": "poisson-lognormal-filling",
        "state_init": "like-init", "test_time_noise": 0, "test_time_noise_type": "fixed", "tie_embeddings": True,
        "vocab_size": 65536, "bos_token_id": 65504, "eos_token_id": 65505, "pad_token_id": 65509,
        "architecture_class_name": "RecurrentGPT", "activation_checkpoint_impl": "per-iteration",
        "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig",
                     "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"},
        "transformers_version": "4.44.2", "hf_config": {"name": "huginn-0125", "org": "tomg-group-umd"},
        "use_cache": True, "tie_word_embeddings": True,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(released))
    config = ModelConfig.from_json(path)
    reference = ModelConfig.from_name("nebel-raven-3.5b")
    assert config.replace(name="nebel-raven-3.5b", activation_checkpointing=True) == reference
    assert config.init_std == pytest.approx(0.008703882797784892, rel=1e-12)
    assert config.init_std_out_proj == pytest.approx(0.0005356869554443541, rel=1e-12)
    assert config.embedding_scale == pytest.approx(72.6636084983398, rel=1e-12)
    path.write_text(json.dumps({**released, "injection_type": "add"}))
    with pytest.raises(ValueError, match="injection_type"):
        ModelConfig.from_json(path)
    for key, value in (("architecture_class_name", "GPT"), ("block_class_name", "TransformerPreNormBlock"),
                       ("mlp_class_name", "BaseMLP"), ("bias", True)):
        path.write_text(json.dumps({**released, key: value}))
        with pytest.raises(ValueError, match=key):
            ModelConfig.from_json(path)
    path.write_text(json.dumps({**released, "n_experts": 8}))
    with pytest.raises(ValueError, match="unknown ModelConfig field 'n_experts'"):
        ModelConfig.from_json(path)
    path.write_text(json.dumps({**released, "padded_vocab_size": 65600}))
    with pytest.raises(ValueError, match="padded_vocab_size"):
        ModelConfig.from_json(path)


@pytest.mark.parametrize("overrides, field", [
    (dict(n_embd=65), "n_embd"),
    (dict(num_attention_heads=0), "num_attention_heads"),
    (dict(vocab_size=-3), "vocab_size"),
    (dict(block_size=0), "block_size"),
    (dict(hidden_width=3), "hidden_width"),
    (dict(state_init="normal"), "state_init"),
])
def test_invalid_configs_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny(**overrides)


def test_unknown_model_name():
    with pytest.raises(ValueError, match="raven-huge.*known: nebel-raven-3.5b"):
        ModelConfig.from_name("raven-huge")


# ---- numerics of the building blocks --------------------------------------------------------------------
def test_rmsnorm_against_hand_computation():
    norm = RMSNorm(4, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 0.5, -1.0]))
    x = torch.tensor([[1.0, -2.0, 3.0, 4.0]])
    rms = math.sqrt((1 + 4 + 9 + 16) / 4 + 1e-6)
    expected = torch.tensor([[1 / rms, -4 / rms, 1.5 / rms, -4 / rms]])
    assert torch.allclose(norm(x), expected, atol=1e-6)
    # bf16 input: normalised in fp32, cast to bf16, then multiplied by the fp32 weight -> fp32 output
    out = norm(x.bfloat16())
    assert out.dtype == torch.float32
    assert torch.equal(out, (x / rms).bfloat16().float() * norm.weight)


def test_rope_pairs_adjacent_elements_with_base_50000():
    head_dim, base = 8, 50000.0
    table = rope_table(head_dim, 16, base)
    q = torch.randn(1, 16, 2, head_dim)
    k = torch.randn(1, 16, 2, head_dim)
    q_rot, k_rot = rotate(q, table), rotate(k, table)
    for t in (0, 1, 7, 15):
        for j in range(head_dim // 2):
            angle = t / base ** (2 * j / head_dim)
            c, s = math.cos(angle), math.sin(angle)
            for x, rotated in ((q, q_rot), (k, k_rot)):
                a, b = x[0, t, :, 2 * j], x[0, t, :, 2 * j + 1]
                assert torch.allclose(rotated[0, t, :, 2 * j], a * c - b * s, atol=1e-5)
                assert torch.allclose(rotated[0, t, :, 2 * j + 1], b * c + a * s, atol=1e-5)


def test_autocast_bf16_keeps_fp32_logits_and_state():
    model = build(tiny())
    x = torch.randint(0, 4096, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, labels=x, num_steps=(1, 1))
    assert out.logits.dtype == torch.float32 and out.loss.dtype == torch.float32
    assert torch.isfinite(out.loss)


# ---- depth sampler (§2.1) ---------------------------------------------------------------------------------
def test_sampler_reproduces_reference_vectors():
    expected = {1: (21, 8), 2: (21, 8), 3: (25, 8), 4: (44, 8), 5: (32, 8),
                6: (8, 8), 7: (27, 8), 8: (21, 8), 9: (9, 8), 10: (9, 8)}
    assert {step: sample_recurrence(step, 32, 8) for step in expected} == expected


def test_sampler_statistics_over_20000_steps():
    draws = [sample_recurrence(step, 32, 8) for step in range(1, 20001)]
    totals = [n + k for n, k in draws]
    assert statistics.mean(totals) == pytest.approx(32.92, abs=0.15)
    assert statistics.median(totals) == 29
    assert statistics.mean(k for _, k in draws) == pytest.approx(7.98, abs=0.02)
    assert sum(t < 8 for t in totals) / len(totals) == pytest.approx(0.0086, abs=0.003)
    assert all(k == min(8, n + k) for n, k in draws)


# ---- truncated backprop ---------------------------------------------------------------------------------------
def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_truncated_backprop_equals_detached_state_run():
    model = build(tiny())
    x = torch.randint(0, 4096, (2, 24))
    start = torch.randn(2, 24, 64)

    model(x, labels=x, num_steps=(5, 2), input_states=start).loss.backward()
    truncated = _grads(model)
    model.zero_grad()

    with torch.no_grad():  # the state after 5 iterations, computed by the model itself at depth (5, 0)
        captured = {}
        handle = model.transformer.ln_f.register_forward_hook(
            lambda module, args, out: captured.setdefault("state", args[0].clone()))
        model(x, num_steps=(5, 0), input_states=start)
        handle.remove()
    model(x, labels=x, num_steps=(0, 2), input_states=captured["state"]).loss.backward()
    detached = _grads(model)

    assert truncated.keys() == detached.keys()
    assert any(k.startswith("transformer.core_block") for k in truncated)
    for name in truncated:
        assert torch.allclose(truncated[name], detached[name], rtol=1e-5, atol=1e-7), name
    # and the test can tell: gradients through all 7 iterations differ
    model.zero_grad()
    model(x, labels=x, num_steps=(0, 7), input_states=start).loss.backward()
    full = _grads(model)
    core = "transformer.core_block.0.attn.Wqkv.weight"
    assert not torch.allclose(full[core], truncated[core], rtol=1e-3)


def test_no_grad_iterations_keep_no_activations_for_backward():
    model = build(tiny())
    x = torch.randint(0, 4096, (2, 64))

    def saved_bytes(num_steps):
        total = 0

        def pack(tensor):
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x, labels=x, num_steps=num_steps).loss.backward()
        model.zero_grad()
        return total

    shallow, deep = saved_bytes((0, 8)), saved_bytes((24, 8))
    assert deep == pytest.approx(shallow, rel=0.10)
    assert saved_bytes((0, 16)) > 1.5 * shallow  # grad iterations do cost memory


def test_activation_checkpointing_gives_the_same_gradients():
    x = torch.randint(0, 4096, (2, 32))
    start = torch.randn(2, 32, 64)
    grads = []
    for checkpointing in (False, True):
        model = build(tiny(activation_checkpointing=checkpointing))
        model(x, labels=x, num_steps=(2, 3), input_states=start).loss.backward()
        grads.append(_grads(model))
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


def test_latent_state_is_random_unless_given():
    model = build(tiny()).eval()
    x = torch.randint(0, 4096, (1, 8))
    a, b = model(x, num_steps=4).logits, model(x, num_steps=4).logits
    assert not torch.equal(a, b)
    start = torch.zeros(1, 8, 64)
    assert torch.equal(model(x, num_steps=4, input_states=start).logits, model(x, num_steps=4, input_states=start).logits)


# ---- save / load --------------------------------------------------------------------------------------------
def test_safetensors_round_trip(tmp_path):
    model = build(tiny())
    save_pretrained(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert "transformer.wte.weight" in f.keys() and "lm_head.weight" not in f.keys()
    loaded = load_pretrained(tmp_path)
    assert loaded.config == model.config
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    x = torch.randint(0, 4096, (1, 12))
    start = torch.randn(1, 12, 64)
    assert torch.equal(model.eval()(x, num_steps=3, input_states=start).logits,
                       loaded.eval()(x, num_steps=3, input_states=start).logits)


def test_state_dict_from_another_shape_names_the_key():
    small, other = build(tiny()), build(tiny(intermediate_size=96))
    with pytest.raises(ValueError, match="transformer.prelude.0.mlp.fc.weight"):
        small.load_state_dict(other.state_dict())
    state = small.state_dict()
    del state["transformer.adapter.weight"]
    with pytest.raises(ValueError, match="missing key 'transformer.adapter.weight'"):
        small.load_state_dict(state)


def test_corrupt_weights_file_is_refused(tmp_path):
    save_pretrained(build(tiny()), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_pretrained(tmp_path)


# ---- bad input ------------------------------------------------------------------------------------------------
def test_token_ids_outside_the_vocabulary():
    model = build(tiny(vocab_size=1000))  # padded to 1024 rows, but ids >= 1000 are not tokens
    x = torch.randint(0, 1000, (2, 8))
    x[1, 5] = 1000
    with pytest.raises(ValueError, match=r"token id 1000 at \(batch 1, position 5\)"):
        model(x)
    with pytest.raises(ValueError, match="token id -1"):
        model(torch.full((1, 4), -1))


def test_sequence_longer_than_block_size():
    model = build(tiny(block_size=32))
    with pytest.raises(ValueError, match="sequence length 33 exceeds block_size=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="prompt length 30 \\+ max_new_tokens 3 exceeds block_size=32"):
        generate(model, torch.zeros(1, 30, dtype=torch.long), max_new_tokens=3)


# ---- generation --------------------------------------------------------------------------------------------------
def test_cached_generation_equals_uncached():
    model = build(tiny(state_init="zero"), seed=3)
    prompt = torch.randint(0, 4096, (2, 7))
    cached = generate(model, prompt, max_new_tokens=12, num_steps=3).tokens  # no exit criterion: a fixed depth
    uncached = prompt
    for _ in range(12):  # greedy, every token from a forward over the whole sequence
        with torch.no_grad():
            logits = model(uncached, num_steps=(3, 0)).logits[:, -1, : model.config.vocab_size]
        uncached = torch.cat([uncached, logits.argmax(dim=-1)[:, None]], dim=1)
    assert cached.shape == (2, 19)
    assert torch.equal(cached[:, :7], prompt)
    assert torch.equal(cached, uncached)
    # the last step's logits agree too, not just their argmax
    cache_logits = model(cached[:, :-1], num_steps=3).logits[:, -1]
    cache = KVCache()
    model(cached[:, :-2], num_steps=3, cache=cache)
    stepped = model(cached[:, -2:-1], num_steps=3, cache=cache).logits[:, -1]
    assert torch.allclose(cache_logits, stepped, atol=1e-5)


# ---- FLOPs ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_steps", [(3, 2), (0, 4), (6, 1)])
def test_flops_match_flop_counter(num_steps):
    # Counted on the meta device, as the reference measured MFU: there SDPA decomposes into bmm's that the
    # counter sees (CPU's fused attention kernel has no FLOP formula registered and would count as 0).
    config = ModelConfig.from_name("raven-small", block_size=128)
    with torch.device("meta"):
        model = RecurrentGPT(config)
        x = torch.zeros(2, 128, dtype=torch.long)
        counter = FlopCounterMode(display=False)
        with counter:
            model(x, labels=x, num_steps=num_steps, input_states=torch.zeros(2, 128, 384)).loss.backward()
    counted = counter.get_total_flops() / x.numel()
    assert training_flops_per_token(config, num_steps, seq_len=128) == pytest.approx(counted, rel=0.05)
