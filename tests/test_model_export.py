"""The Hugging Face export: loads with only torch + transformers, same logits as RecurrentGPT, num_steps reaches
forward and generate; load_pretrained reads the released layout (config.json keys, shards + index)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from huginn_ray.data.chat import render
from huginn_ray.data.tokenizer import train_tokenizer
from huginn_ray.generation.generate import generate
from huginn_ray.model import ModelConfig, RecurrentGPT, load_pretrained
from huginn_ray.model.export import export
from test_train_init_from import released_config

# Run in a python where huginn_ray cannot be imported: -I drops the cwd and PYTHONPATH, and the editable
# install's import hook is removed before anything else runs.
ISOLATE = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "") + repr(f)]
sys.path[:] = [p for p in sys.path if "huginn" not in p]
try:
    import huginn_ray
except ImportError:
    pass
else:
    raise SystemExit("huginn_ray is importable: " + huginn_ray.__file__)
"""


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"},
        {"role": "assistant", "content": "    return x\n"}]


def run_isolated(script: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(HF_HOME=str(cwd / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-I", "-c", ISOLATE + textwrap.dedent(script)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tokenizer = train_tokenizer([p.read_text() for p in sorted((stdlib / "json").glob("*.py"))], 4096,
                                root / "tokenizer")
    torch.manual_seed(0)
    model = RecurrentGPT(ModelConfig.from_name("raven-tiny", state_init="zero")).eval()
    out = export(model, root / "hf", tokenizer)
    return root, model, out


def test_export_loads_without_huginn_ray_and_matches_logits(exported):
    root, model, out = exported
    torch.manual_seed(1)
    ids = torch.randint(0, 4000, (2, 10))
    states = torch.randn(2, 10, model.config.n_embd)
    reference = {d: model(ids, num_steps=(d, 0), input_states=states).logits for d in (1, 4, 32)}
    prompt = ids[:1, :4]
    greedy = {d: generate(model, prompt, 6, num_steps=d).tokens[0, 4:].tolist() for d in (1, 3)}
    assert greedy[1] != greedy[3]  # so that matching below shows num_steps reached the model
    # the initial noise of one seed, as the model draws it with state_init like-init
    noisy = RecurrentGPT(ModelConfig.from_name("raven-tiny"))
    torch.manual_seed(7)
    noise = noisy.initial_state(torch.zeros(1, 3, model.config.n_embd))
    torch.save({"ids": ids, "states": states, "reference": reference, "prompt": prompt, "noise": noise},
               root / "reference.pt")

    result = run_isolated(f"""
        import json, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        data = torch.load("reference.pt")
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        tokenizer = AutoTokenizer.from_pretrained({str(out)!r})
        errors = {{}}
        with torch.no_grad():
            for depth, ref in data["reference"].items():
                got = model(data["ids"], num_steps=depth, input_states=data["states"]).logits
                errors[depth] = float((got - ref).norm() / ref.norm())
            generated = {{d: model.generate(data["prompt"], max_new_tokens=6, num_steps=d, do_sample=False)[0, 4:].tolist()
                         for d in (1, 3)}}
            model.config.state_init = "like-init"
            torch.manual_seed(7)
            noise_equal = torch.equal(model._initial_state(torch.zeros(1, 3, model.config.n_embd)), data["noise"])
        print("RESULT " + json.dumps({{"errors": errors, "generated": generated, "noise_equal": noise_equal, "modules": sorted(
            m for m in __import__("sys").modules if m.split(".")[0] == "huginn_ray"),
            "encoded": tokenizer("def f(x): return x")["input_ids"],
            "chat": dict(tokenizer.apply_chat_template({CHAT!r}, return_dict=True, return_assistant_tokens_mask=True)),
            "eos": model.generation_config.eos_token_id}}))
    """, root)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("RESULT ", 1)[1])
    assert report["modules"] == []
    assert all(error < 1e-5 for error in report["errors"].values()), report["errors"]
    assert report["generated"] == {str(d): tokens for d, tokens in greedy.items()}
    assert report["noise_equal"]  # one seed, one initial state, in huginn_ray and in the export
    assert len(report["encoded"]) > 3
    # the exported tokenizer carries the chat template: the ids and assistant mask of huginn_ray.data.chat
    from tokenizers import Tokenizer
    ids, mask = render(CHAT, Tokenizer.from_file(str(root / "tokenizer" / "tokenizer.json")))
    assert (report["chat"]["input_ids"], report["chat"]["assistant_masks"]) == (ids, mask)
    assert report["eos"] == [4065, 4068]  # <|end_text|> and <|end_turn|>: a chat reply stops at its turn's end


def test_export_directory_contents(exported):
    _, model, out = exported
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "configuration_huginn_ray.py", "modeling_huginn_ray.py"} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "huginn_raven" and config["architectures"] == ["RavenForCausalLM"]
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM"}
    assert config["num_hidden_layers"] == 1 + 1 + 2 * 4
    for code in ("configuration_huginn_ray.py", "modeling_huginn_ray.py"):
        imports = [line for line in (out / code).read_text().splitlines() if line.startswith(("import", "from"))]
        assert all(line.split()[1].split(".")[0] in ("math", "torch", "transformers", "") for line in imports), imports
    # and it reads back into RecurrentGPT unchanged
    again = load_pretrained(out)
    for key, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], tensor), key


def test_load_pretrained_reads_the_released_layout(tmp_path):
    torch.manual_seed(2)
    model = RecurrentGPT(ModelConfig.from_name("raven-tiny")).eval()
    cfg = model.config
    config = released_config(cfg)  # the released config.json's keys, with tiny shapes
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {k: v.to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2 :]}
    for name, shard_keys in shards.items():
        save_file({k: tensors[k] for k in shard_keys}, tmp_path / name)
    weight_map = {k: name for name, shard_keys in shards.items() for k in shard_keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    loaded = load_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    for key, tensor in model.state_dict().items():
        expected = tensor if key == "freqs_cis" else tensor.to(torch.bfloat16).float()
        assert torch.equal(loaded.state_dict()[key], expected), key
