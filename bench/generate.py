"""Generation benchmark: tokens/s with and without a KV cache, and adaptive exits against fixed depth.

    python bench/generate.py [--checkpoint DIR --data-dir SHARDS] [--num-steps 16] [--rows 4] [--threads 1]

Part 1 (any model; raven-tiny at random init without --checkpoint): greedy decoding tokens/s of
RecurrentGPT.generate without and with its cache, and of the adaptive generator at a fixed depth (full, latest
and ring caches). Part 2 (with --checkpoint and --data-dir: a trained demo checkpoint): at batch size 1, teacher-forced
on validation rows (prompt 16 tokens, then 48 forced), the mean core iterations per token and the mean
next-token loss for each exit criterion at its default threshold, against the fixed depth.
"""

from __future__ import annotations

import argparse
import time

import torch

from huginn_ray.model import ModelConfig, RecurrentGPT
from huginn_ray.model.generate import DEFAULT_THRESHOLDS, generate
from huginn_ray.model.pretrained import load_pretrained, resolve_model_dir


def timed(fn, tokens: int) -> float:
    start = time.perf_counter()
    fn()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint")
    parser.add_argument("--data-dir")
    parser.add_argument("--num-steps", type=int, default=16)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.checkpoint:
        model = load_pretrained(resolve_model_dir(args.checkpoint)).eval()
    else:
        torch.manual_seed(0)
        model = RecurrentGPT(ModelConfig.from_name("raven-tiny")).eval()
    cfg, depth, new = model.config, args.num_steps, args.new_tokens
    prompt = torch.randint(0, cfg.vocab_size - 64, (1, 16))
    print(f"model {cfg.name} D={cfg.n_embd}, depth {depth}, prompt 16, {new} new tokens, batch 1, "
          f"{torch.get_num_threads()} threads")
    print(f"| decoding | tokens/s |\n|---|---|")
    print(f"| RecurrentGPT.generate, no cache | {timed(lambda: model.generate(prompt, new, depth, use_cache=False), new):.1f} |")
    print(f"| RecurrentGPT.generate, full cache | {timed(lambda: model.generate(prompt, new, depth), new):.1f} |")
    for cache in ("full", "latest", "ring:4"):
        rate = timed(lambda: generate(model, prompt, new, depth, cache=cache), new)
        print(f"| adaptive generator at fixed depth, cache {cache} | {rate:.1f} |")
    if not (args.checkpoint and args.data_dir):
        return
    from pathlib import Path

    from huginn_ray.eval.depth_scaling import read_val_rows

    shard = sorted((Path(args.data_dir) / "val").glob("*.parquet"))[0]
    rows = torch.from_numpy(read_val_rows(shard, args.rows))
    print(f"\nteacher-forced on {args.rows} validation rows of {shard.name} (16 prompt + 48 forced tokens)")
    print("| criterion | threshold | mean iterations/token | loss | loss change vs fixed | FLOPs/token |")
    print("|---|---|---|---|---|---|")
    fixed_loss = None
    for name in ["none", *DEFAULT_THRESHOLDS]:
        losses, steps, flops = [], [], []
        for row in rows:
            torch.manual_seed(0)
            r = generate(model, row[None, :16], 48, depth, exit_criterion=name, force_tokens=row[None, 16:64])
            losses.append(-r.logprobs.mean())
            steps.append(r.steps[:, 1:].float().mean())
            flops.append(r.flops_per_token)
        loss = float(torch.stack(losses).mean())
        fixed_loss = loss if fixed_loss is None else fixed_loss
        threshold = "-" if name == "none" else DEFAULT_THRESHOLDS[name]
        print(f"| {name if name != 'none' else 'fixed depth'} | {threshold} | {float(torch.stack(steps).mean()):.2f} | "
              f"{loss:.4f} | {loss - fixed_loss:+.4f} | {sum(flops) / len(flops):.3g} |")


if __name__ == "__main__":
    main()
