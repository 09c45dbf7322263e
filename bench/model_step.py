"""Forward+backward throughput of the recurrent-depth model: tokens/s, achieved FLOP/s and MFU.

MFU is model FLOPs per second (huginn_ray.model.training_flops_per_token) over the matrix-multiply FLOP/s
this script measures on the same device in the same run, so the ratio does not depend on a datasheet and
is robust to a noisy machine. On CPU the step runs in fp32; on a GPU under bf16 autocast, and the peak is
measured with bf16 matmuls.

    python bench/model_step.py                 # CPU, all shapes
    python bench/model_step.py --device cuda   # a GPU, if present
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from huginn_ray.model import ModelConfig, RecurrentGPT, training_flops_per_token  # noqa: E402

# (registry name, overrides, batch, seq_len, (n, k))
SHAPES = [
    ("raven-small", {}, 8, 256, (4, 4)),
    ("raven-small", {"activation_checkpointing": True}, 8, 256, (4, 4)),
    ("raven-medium", {}, 2, 512, (2, 2)),
]
CUSTOM = {  # a wider shape than the registry's CPU models, closer to where matmuls dominate
    "raven-medium": dict(n_embd=768, num_attention_heads=12, intermediate_size=2048, block_size=1024,
                         vocab_size=4096, padding_multiple=64, mean_recurrence=8, mean_backprop_depth=4),
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops_per_second(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def step_seconds(model: RecurrentGPT, batch: int, seq_len: int, num_steps, device, autocast, steps: int) -> float:
    x = torch.randint(0, model.config.vocab_size, (batch, seq_len), device=device)
    times = []
    for i in range(steps + 2):  # two warm-up steps
        synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, labels=x, num_steps=num_steps).loss
        loss.backward()
        synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2]  # median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32

    name = torch.cuda.get_device_name(device) if on_gpu else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"device: {device} ({name}), torch {torch.__version__}, step dtype {'bf16 autocast' if on_gpu else 'fp32'}")
    peak = matmul_flops_per_second(device, dtype, 8192 if on_gpu else 2048, repeats=10 if on_gpu else 5)
    print(f"measured matmul peak: {peak / 1e12:.3f} TFLOP/s ({dtype})")
    print(f"{'shape':40s} {'params':>8s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s}")
    for registry_name, overrides, batch, seq_len, num_steps in SHAPES:
        if registry_name in CUSTOM:
            config = ModelConfig(name=registry_name, **CUSTOM[registry_name], **overrides)
        else:
            config = ModelConfig.from_name(registry_name, **overrides)
        if on_gpu:
            batch *= 4
        torch.manual_seed(0)
        model = RecurrentGPT(config).to(device)
        seconds = step_seconds(model, batch, seq_len, num_steps, device, autocast=on_gpu, steps=args.steps)
        tokens_per_second = batch * seq_len / seconds
        achieved = training_flops_per_token(config, num_steps, seq_len) * tokens_per_second
        label = f"{registry_name}{' +ckpt' if overrides.get('activation_checkpointing') else ''} B={batch} T={seq_len} {num_steps}"
        params = sum(p.numel() for p in model.parameters())
        print(f"{label:40s} {params / 1e6:7.1f}M {tokens_per_second:10.0f} {achieved / 1e12:8.3f} {achieved / peak:6.1%}")


if __name__ == "__main__":
    main()
