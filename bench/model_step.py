"""Forward+backward throughput of the recurrent-depth model: tokens/s, achieved FLOP/s and MFU.

MFU is model FLOPs per second (huginn_ray.model.training_flops_per_token) over the matrix-multiply FLOP/s
this script measures on the same device in the same run, so the ratio does not depend on a datasheet and
is robust to a noisy machine. On CPU the step runs in fp32; on a GPU under bf16 autocast, and the peak is
measured with bf16 matmuls.

    python bench/model_step.py                 # CPU, all shapes
    python bench/model_step.py --compile       # eager and compiled blocks side by side, in one run
    python bench/model_step.py --device cuda   # a GPU, if present

With --compile every shape is built twice with the same weights, one copy with compile_blocks, and the
timed steps alternate between the two (eager, compiled, eager, ...) so that load from other processes on a
shared machine falls on both alike; the figure per variant is the median step. It also profiles one eager
step and prints the share of its time spent in matmul and attention kernels: compilation fuses the rest
(norms, RoPE, SiLU*up, residual adds) but does not make those kernels faster, so 1 / share is the most any
fusion can gain at that shape on that device.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from huginn_ray.model import ModelConfig, RecurrentGPT, training_flops_per_token  # noqa: E402
from huginn_ray.train.parallelize import compile_blocks  # noqa: E402

# (registry name, overrides, batch, seq_len, (n, k))
SHAPES = [
    ("anchor", {}, 2, 256, (4, 4)),
    ("raven-small", {}, 8, 256, (4, 4)),
    ("raven-small", {"activation_checkpointing": True}, 8, 256, (4, 4)),
    ("raven-medium", {}, 2, 512, (2, 2)),
]
CUSTOM = {  # a wider shape than the registry's CPU models, closer to where matmuls dominate
    # the shape issue 12 compares eager and compiled at (D=512, 8 heads, I=1536, V=8192, 2/4/2 layers)
    "anchor": dict(n_embd=512, num_attention_heads=8, intermediate_size=1536, block_size=256, vocab_size=8192,
                   padding_multiple=64, mean_recurrence=8, mean_backprop_depth=4),
    "raven-medium": dict(n_embd=768, num_attention_heads=12, intermediate_size=2048, block_size=1024,
                         vocab_size=4096, padding_multiple=64, mean_recurrence=8, mean_backprop_depth=4),
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops_per_second(device: torch.device, dtype: torch.dtype, shapes, repeats: int) -> tuple[float, tuple]:
    """The best FLOP/s of single matmuls over `shapes` (m, k, n), and the shape that gave it. Several shapes,
    some of them the model's own, because a CPU BLAS can run a 512x1536x512 product faster than a square one:
    a peak from one square shape would put MFU above 100%."""
    best, best_shape = 0.0, None
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        fastest = float("inf")
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            a @ b
            synchronize(device)
            fastest = min(fastest, time.perf_counter() - start)
        if 2 * m * k * n / fastest > best:
            best, best_shape = 2 * m * k * n / fastest, (m, k, n)
    return best, best_shape


def step_seconds(models: dict, batch: int, seq_len: int, num_steps, device, autocast, steps: int,
                 loss_chunk_tokens: int = 0) -> dict:
    """Median fwd+bwd seconds of every model in `models`, their steps interleaved (the loss over chunks of
    `loss_chunk_tokens` tokens when > 0, as training computes it)."""
    vocab = next(iter(models.values())).config.vocab_size
    x = torch.randint(0, vocab, (batch, seq_len), device=device)
    times = {name: [] for name in models}
    for i in range(steps + 2):  # two warm-up steps (the first one compiles)
        for name, model in models.items():
            synchronize(device)
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(x, labels=x, num_steps=num_steps, loss_chunk_tokens=loss_chunk_tokens).loss
            loss.backward()
            synchronize(device)
            if i >= 2:
                times[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}  # median


MATMUL_AND_ATTENTION = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_scaled_dot_product")


def matmul_and_attention_share(model, batch: int, seq_len: int, num_steps, device, autocast: bool) -> float:
    """Fraction of one profiled eager fwd+bwd step's kernel time spent in matmul and attention kernels."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randint(0, model.config.vocab_size, (batch, seq_len), device=device)
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as profiler:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, labels=x, num_steps=num_steps).loss
        loss.backward()
        synchronize(device)
    model.zero_grad(set_to_none=True)
    own_time = (lambda e: e.self_device_time_total) if device.type == "cuda" else (lambda e: e.self_cpu_time_total)
    events = profiler.key_averages()
    total = sum(own_time(e) for e in events)
    heavy = sum(own_time(e) for e in events if e.key.startswith(MATMUL_AND_ATTENTION))
    return heavy / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also time compile_blocks (side by side)")
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. max-autotune-no-cudagraphs (training's GPU default)")
    parser.add_argument("--loss-chunk-tokens", type=int, default=0, help="chunked cross-entropy (0: full logits)")
    parser.add_argument("--shapes", default=None, help="comma-separated indices into SHAPES (default: all)")
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32

    name = torch.cuda.get_device_name(device) if on_gpu else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"device: {device} ({name}), torch {torch.__version__}, step dtype {'bf16 autocast' if on_gpu else 'fp32'}")
    shapes = [(8192, 8192, 8192), (4096, 4096, 4096)] if on_gpu else \
        [(2048, 2048, 2048), (512, 1536, 512), (512, 512, 3072), (1024, 1024, 1024)]
    peak, peak_shape = matmul_flops_per_second(device, dtype, shapes, repeats=10 if on_gpu else 5)
    print(f"measured matmul peak: {peak / 1e12:.3f} TFLOP/s ({dtype}, best of {len(shapes)} shapes: "
          f"{'x'.join(map(str, peak_shape))})")
    if os.path.exists("/proc/loadavg"):
        print(f"load average at start: {open('/proc/loadavg').read().split()[:3]}")
    print(f"{'shape':40s} {'variant':>9s} {'params':>8s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s}")
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    for registry_name, overrides, batch, seq_len, num_steps in shapes:
        if registry_name in CUSTOM:
            config = ModelConfig(name=registry_name, **CUSTOM[registry_name], **overrides)
        else:
            config = ModelConfig.from_name(registry_name, **overrides)
        if on_gpu:
            batch *= 4
        torch.manual_seed(0)
        models = {"eager": RecurrentGPT(config).to(device)}
        if args.compile:
            models["compiled"] = RecurrentGPT(config).to(device)
            models["compiled"].load_state_dict(models["eager"].state_dict())
            compile_blocks(models["compiled"], **({"mode": args.compile_mode} if args.compile_mode else {}))
        seconds = step_seconds(models, batch, seq_len, num_steps, device, autocast=on_gpu, steps=args.steps,
                               loss_chunk_tokens=args.loss_chunk_tokens)
        label = f"{registry_name}{' +ckpt' if overrides.get('activation_checkpointing') else ''} B={batch} T={seq_len} {num_steps}"
        params = sum(p.numel() for p in models["eager"].parameters())
        for variant, median in seconds.items():
            tokens_per_second = batch * seq_len / median
            achieved = training_flops_per_token(config, num_steps, seq_len) * tokens_per_second
            print(f"{label:40s} {variant:>9s} {params / 1e6:7.1f}M {tokens_per_second:10.0f} {achieved / 1e12:8.3f} "
                  f"{achieved / peak:6.1%}")
        if args.compile:
            share = matmul_and_attention_share(models["eager"], batch, seq_len, num_steps, device, autocast=on_gpu)
            print(f"{'':40s} compiled / eager = {seconds['eager'] / seconds['compiled']:.2f}x; eager step "
                  f"{share:.0%} in matmul+attention kernels, so fusion can give at most {1 / share:.2f}x")


if __name__ == "__main__":
    main()
