"""`python bench/gpu_check.py --device cpu --quick`: every part of the GPU check runs on every change, at tiny
shapes on the CPU (a GPU session runs `make gpu-check`, the same code at full size; BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from huginn_ray.model import ModelConfig, RecurrentGPT
from huginn_ray.generation.exits import DEFAULT_THRESHOLDS

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "bench"))  # appended: bench/ must not shadow any module
from gpu_check import TINY  # noqa: E402


def test_the_quick_cpu_run_covers_every_section_and_trains_resumes_and_generates(tmp_path):
    out = tmp_path / "gpu_check.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--device", "cpu", "--quick",
                          "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report) == ["device", "peak", "model_step", "memory", "training", "generation", "engine",
                            "decode_calls", "optimizer", "bf16_gather", "seconds"]
    assert (report["device"]["type"], report["device"]["quick"]) == ("cpu", True)
    assert report["peak"]["matmul_flops"] > 0 and report["peak"]["copy_bytes_per_s"] > 0

    steps = report["model_step"]
    assert [row["shape"] for row in steps] == ["anchor", "raven-small", "raven-medium",
                                               "nebel-width 2/4/2 layers, activation checkpointing"]
    for row in steps:  # this CPU: torch's flash kernel takes the shapes, there is no memory-efficient one
        assert row["attention_backend"] == "flash" and row["attention_probe"]["flash"] is None
        assert row["attention_probe"]["efficient"].startswith("No viable backend")
        assert row["eager"]["tokens_per_s"] > 0 and row["compiled"]["tokens_per_s"] > 0

    memory = report["memory"]
    assert [item["item"] for item in memory["items"]] == [
        "parameters + buffers + optimizer state + exchange buffers", "gradients",
        "activations saved for backward (end of forward, outside autocast)",
        "forward peak (activations, casts, the loss's head copy and chunk)",
        "backward peak (gradients, activations, transients)",
        "optimizer step of a log step (scratch, module norms' copies)",
        "total: the peak of a whole train_step"]
    fixed, grads = memory["items"][0]["planned_bytes"], memory["items"][1]["planned_bytes"]
    with torch.device("meta"):
        model = RecurrentGPT(ModelConfig(name="nebel-width", **{**TINY, "n_layers_in_prelude": 2,
                                                                "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2}))
    tensors = len(list(model.parameters()))
    # fp32 parameters + the RoPE table (seq_len 32 x head_dim 16), two fp32 moments and an int64 step per tensor,
    # and chunk_stream's one 64 MiB chunk
    assert fixed == grads + 32 * 16 * 4 + 2 * grads + 8 * tensors + 64 * 2**20
    assert all(item["measured_bytes"] is None for item in memory["items"])  # the allocator's counts are CUDA's
    assert memory["plan"][-1].startswith("total per rank: ")

    training = report["training"]
    assert training["loss_falls"] and training["losses"][-1] < training["losses"][0]
    assert training["resume"] == {"saved_after_step": 4, "losses": training["losses"],
                                  "max_abs_loss_difference": 0.0, "bitwise": True,  # fp32, one thread: exact
                                  "device_reads_per_step": 0.0}
    reads = training["host_reads_per_step"]
    assert reads["loop.py:train_step:tolist"] == 1.0  # the step's one read of the agreed vector
    assert reads["model.py:sample_recurrence:item"] == 1.0  # the depth, drawn on the CPU
    assert training["device_reads_per_step"] == 0.0

    generation = report["generation"]
    assert generation["fixed depth"]["mean_steps_per_token"] == 4.0
    assert generation["adaptive (kl)"]["threshold"] == DEFAULT_THRESHOLDS["kl"]
    assert 1.0 <= generation["adaptive (kl)"]["mean_steps_per_token"] <= 4.0
    engine = report["engine"]
    assert (engine["batch"], engine["requests"], engine["fixed depth"]["mean_iterations"]) == (4, 8, 4.0)
    assert 1.0 <= engine["adaptive (latent-diff)"]["mean_iterations"] < 4.0  # rows exit early
    assert engine["runs"] == ["fixed depth", "adaptive (latent-diff)"]  # --quick: the eager step only
    # fp32, one thread: each request equals its batch-1 output
    assert engine["tokens_equal_fraction"] == {"adaptive (latent-diff)": 1.0}
    decode = report["decode_calls"]  # one iteration of the tiny core (1 block): the ATen ops a GPU launches per call
    assert (decode["blocks"], list(decode["rows"])) == (1, ["1", "4"])
    assert [row["aten_ops"] for row in decode["rows"].values()] == [76, 76]  # the same ops at any row count
    assert all(row["graph_ms"] is None and row["eager_ms"] > 0 for row in decode["rows"].values())  # no CUDA graph
    optimizer = report["optimizer"]  # fused AdamW exists on the CPU too; the training takes single-tensor here
    with torch.device("meta"):
        one_layer_each = RecurrentGPT(ModelConfig(name="nebel-width", **{**TINY, "n_layers_in_prelude": 1,
                                                                         "n_layers_in_recurrent_block": 1,
                                                                         "n_layers_in_coda": 1}))
    assert (optimizer["params"], optimizer["steps"]) == (sum(p.numel() for p in one_layer_each.parameters()), 3)
    assert optimizer["training_takes_fused"] is False and "error" not in optimizer
    assert 0 < optimizer["max_abs_weight_difference"] <= optimizer["tolerance"] == 1e-6  # rounded differently
    assert optimizer["fused_seconds"] > 0 and optimizer["foreach_seconds"] > 0
    # ELLISAdam's eager step against its reference formula (--quick does not compile)
    assert list(optimizer["ellis_seconds"]) == ["reference", "eager"] and min(optimizer["ellis_seconds"].values()) > 0
    assert 0 <= optimizer["ellis_max_abs_weight_difference"]["eager"] <= 1e-6
    gathers = report["bf16_gather"]
    assert "error" not in gathers and gathers["norms_and_qk_bias_fp32"]
    with torch.device("meta"):
        tiny = RecurrentGPT(ModelConfig(name="anchor", **TINY))
    t = tiny.transformer
    numel = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    blocks = numel(t.prelude) + numel(t.coda)
    root = numel(tiny) - blocks - numel(t.core_block)
    # prelude and coda gathered for forward and backward, the core and the root once
    assert gathers["float32"]["gathered_bytes"] == {"float32": 4 * (2 * blocks + numel(t.core_block) + root)}
    # the norm weights and qk_bias are left whole (not gathered), the root unit gathers in fp32
    matmul = lambda module: sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))  # noqa
    assert gathers["bfloat16"]["gathered_bytes"] == {
        "float32": 4 * root, "bfloat16": 2 * (2 * (matmul(t.prelude) + matmul(t.coda)) + matmul(t.core_block))}
    assert gathers["gathered_ratio"] <= 0.6
    # autocast casts the fp32-gathered weights to the bf16 values the bf16 gathers bring: the same first loss
    assert gathers["loss_relative_difference"] == 0.0
    assert "total per rank" not in run.stdout and "JSON: " + str(out) in run.stdout
