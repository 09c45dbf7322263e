"""Test-time device and precision (huginn_ray.model.inference): names checked before loading, weights in the
asked dtype, training's attention-kernel policy, and the jobs that take them (generate, depth scaling)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend

from huginn_ray.eval.batch_inference import DepthLossReplica, Replicas
from huginn_ray.model import ModelConfig, RecurrentGPT
from huginn_ray.generation.generate import generate
from huginn_ray.model.inference import inference_placement, load_for_inference
from huginn_ray.model.pretrained import save_pretrained

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("inference") / "model"
    torch.manual_seed(0)
    save_pretrained(RecurrentGPT(ModelConfig.from_name("raven-tiny", vocab_size=4096)).eval(), directory)
    return directory


def test_placement_defaults_and_refusals_name_the_field(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # stands in for a machine without a GPU
    default = inference_placement()
    assert (default.device, default.dtype) == (torch.device("cpu"), torch.float32)
    assert inference_placement("cpu", "bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"device 'cuda': this torch sees no GPU"):
        inference_placement("cuda")
    assert inference_placement("cuda", check_present=False).dtype_name == "bfloat16"  # a GPU's default
    with pytest.raises(ValueError, match=r"device must be one of cpu, cuda .*got 'tpu'"):
        inference_placement("tpu")
    with pytest.raises(ValueError, match=r"dtype must be one of float32, bfloat16, got 'float16'"):
        inference_placement("cpu", "float16")


def test_load_for_inference_casts_the_weights_and_restricts_attention_to_the_fused_kernels(model_dir):
    model, backend = load_for_inference(model_dir, inference_placement("cpu", "bfloat16"))
    assert backend == "flash"  # torch's CPU flash kernel takes the model's shape
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert set(dtypes.values()) == {torch.bfloat16}
    assert model.freqs_cis.dtype == torch.float32  # the RoPE table stays fp32
    assert all(block.attn.sdpa_backends == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                            SDPBackend.CUDNN_ATTENTION]
               for block in model.blocks())


def test_generate_job_runs_in_bfloat16_and_gives_what_the_library_gives(model_dir, capsys):
    from tokenizers import Tokenizer

    from huginn_ray.data.tokenizer import train_tokenizer

    tokenizer_dir = model_dir.parent / "tokenizer"
    train_tokenizer(["def main(): return 1\n" * 50, "class A: pass\n" * 50], 4096, tokenizer_dir)
    spec = importlib.util.spec_from_file_location("generate_job", REPO / "jobs" / "generate.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    args = ["--checkpoint", str(model_dir), "--tokenizer", str(tokenizer_dir), "--prompt", "def main(",
            "--num-steps", "3", "--max-new-tokens", "5", "--exit-criterion", "kl", "--seed", "7"]
    assert job.main([*args, "--device", "cpu", "--dtype", "bfloat16"]) == 0
    printed = capsys.readouterr().out
    assert "cpu, bfloat16, flash attention)" in printed
    # the same generation through the library, on the weights cast to bf16
    model, _ = load_for_inference(model_dir, inference_placement("cpu", "bfloat16"))
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = [tokenizer.token_to_id("<|begin_text|>")] + tokenizer.encode("def main(", add_special_tokens=False).ids
    torch.manual_seed(7)
    result = generate(model, torch.tensor([ids]), 5, num_steps=3, exit_criterion="kl", eos_token_id=None)
    steps = " ".join(str(s) for s in result.steps[0].tolist())
    assert printed.startswith("def main(" + tokenizer.decode(result.tokens[0, len(ids):].tolist(),
                                                             skip_special_tokens=False) + "\n")
    assert f"(per token: {steps})" in printed
    assert job.main([*args, "--device", "tpu"]) == 2
    assert "device must be one of cpu, cuda" in capsys.readouterr().err
    # --top-p reaches the sampler: the same draws as the library's with top_p
    sampling = ["--temperature", "1.0", "--top-p", "0.3"]
    assert job.main([*args, *sampling, "--device", "cpu", "--dtype", "bfloat16"]) == 0
    torch.manual_seed(7)
    result = generate(model, torch.tensor([ids]), 5, num_steps=3, exit_criterion="kl", temperature=1.0, top_p=0.3)
    assert capsys.readouterr().out.startswith(
        "def main(" + tokenizer.decode(result.tokens[0, len(ids):].tolist(), skip_special_tokens=False) + "\n")
    assert job.main([*args, "--top-p", "0"]) == 2
    assert "top_p must be a number > 0 and <= 1, got 0.0" in capsys.readouterr().err


def test_depth_scaling_loss_in_bfloat16_is_near_but_not_the_fp32_loss(model_dir):
    import numpy as np

    batch = {"key": np.arange(3), "input_ids": np.random.default_rng(0).integers(2, 4000, size=(3, 33))}
    fp32, bf16 = (DepthLossReplica(str(model_dir), [2], Replicas(1, "cpu", dtype), 233, pad_id=0, eos_id=1)(batch)
                  for dtype in ("float32", "bfloat16"))
    assert fp32["tokens"].tolist() == bf16["tokens"].tolist() == [32, 32, 32]
    assert (bf16["loss_sums"] != fp32["loss_sums"]).all()
    assert bf16["loss_sums"] == pytest.approx(fp32["loss_sums"], rel=2e-2)
