"""Generation benchmark: what adaptive exits buy in throughput under continuous depth batching.

    python bench/generate.py [--checkpoint DIR] [--data-dir SHARDS] [--batch 32] [--requests 64]
        [--num-steps 16] [--new-tokens 24] [--criterion latent-diff --threshold 0.03] [--exit-wait 3]
        [--admit-rows BATCH/4] [--[no-]compile] [--threads 1] [--json]

On the same prompts and model (raven-tiny at random init without --checkpoint), greedy decoding:
(a) the engine (huginn_ray.generation.engine) with `--batch` rows, an adaptive exit criterion,
    `EngineConfig.exit_wait_steps=--exit-wait`, `admit_rows=--admit-rows` and `compile` (default on: each kind of
    decode step compiled by torch.compile; its compilation happens in an untimed warm-up run of each engine, and
    `compile_s` says how long those two runs took);
(b) the engine at the fixed depth `--num-steps` (the same EngineConfig);
(c) the model's own KV cache at that fixed depth (`kv_cache_greedy`: one forward per token), `--batch` prompts
    per call.
Prints tokens/s (wall clock) and tokens per CPU second of this process (steadier on a shared machine), each
the best of --repeats rounds (one run of each of (a), (b), (c) in turn), mean and maximum core iterations per
token, and the fraction of requests whose adaptive engine output equals `generate` at batch size 1 (token for
token); --json prints one JSON object.
Prompts: the first 16 tokens of rows of --data-dir shards (val/*.parquet, then train/*.parquet) when given, else a
built-in set (seeded random token ids).

The counters (one more run of each engine, eager, under huginn_ray.generation.counting.OpCounter):
`host_syncs_per_step` (reads of the device by the host inside a decode step, StepRunner.run), `ops_per_token_adaptive` and
`ops_per_token_fixed` (ATen ops of every engine step, admission and prefill included, per token), and
`graph_breaks` (torch._dynamo.explain of a finishing decode step). `goals` says which of the targets hold:
no host read, ops ratio <= 1.8 x mean / max iterations, every output equal to batch 1's, adaptive >= 1.5 x the
engine's fixed depth and >= 1.3 x kv_cache_greedy's tokens/s.
With --checkpoint and --data-dir it also prints, at batch size 1 teacher-forced on validation rows (prompt 16
tokens, then 48 forced), the mean core iterations per token and the next-token loss of each exit criterion at
its default threshold against the fixed depth (--criteria-table).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from huginn_ray.generation.counting import OpCounter
from huginn_ray.generation.decode_step import decode_step
from huginn_ray.generation.engine import Engine, EngineConfig
from huginn_ray.generation.exits import DEFAULT_THRESHOLDS
from huginn_ray.generation.generate import generate
from huginn_ray.generation.requests import Request
from huginn_ray.model import KVCache, ModelConfig, RecurrentGPT
from huginn_ray.model.pretrained import load_pretrained, resolve_model_dir

PROMPT_TOKENS = 16


def prompts(args: argparse.Namespace, vocab_size: int) -> list[tuple[int, ...]]:
    if args.data_dir:
        from huginn_ray.eval.validation_rows import read_val_rows

        rows = []
        shards = [*sorted((Path(args.data_dir) / "val").glob("*.parquet")),
                  *sorted((Path(args.data_dir) / "train").glob("*.parquet"))]
        for shard in shards:
            rows += [tuple(row[:PROMPT_TOKENS].tolist()) for row in read_val_rows(shard, args.requests - len(rows))]
            if len(rows) == args.requests:
                return rows
        raise SystemExit(f"--data-dir {args.data_dir}: {len(rows)} rows, --requests {args.requests} asked")
    generator = torch.Generator().manual_seed(0)
    return [tuple(torch.randint(0, vocab_size, (PROMPT_TOKENS,), generator=generator).tolist())
            for _ in range(args.requests)]


def timed_rounds(runs: dict, repeats: int) -> dict:
    """name -> (best wall seconds, best process CPU seconds, the last run's result) of each of `runs`, run in
    `repeats` rounds of one run each, in turn: a machine whose speed drifts slows every contender alike. On a
    shared machine the CPU seconds are the steadier figure."""
    walls, cpus, out = {name: [] for name in runs}, {name: [] for name in runs}, {}
    for _ in range(repeats):
        for name, run in runs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            out[name] = run()
            walls[name].append(time.perf_counter() - wall)
            cpus[name].append(time.process_time() - cpu)
    return {name: (min(walls[name]), min(cpus[name]), out[name]) for name in runs}


def outputs(engine: Engine, requests: list[Request]) -> list[tuple[list[int], list[int]]]:
    """(tokens, core iterations of each token) of every request, in order, driving `engine` alone until idle."""
    request_ids = [engine.submit(request) for request in requests]
    tokens, iterations = {i: [] for i in request_ids}, {i: [] for i in request_ids}
    while engine.busy:
        for event in engine.step():
            tokens[event.request_id].append(event.token_id)
            iterations[event.request_id].append(event.core_iterations)
    return [(tokens[i], iterations[i]) for i in request_ids]


@torch.no_grad()
def kv_cache_greedy(model: RecurrentGPT, prompts: torch.Tensor, new_tokens: int, depth: int) -> torch.Tensor:
    """Greedy decoding of a batch at a fixed depth through the model's own KVCache (each token's forward over its
    one new position; every position keeps every iteration): the plain reference of the engines."""
    cache, tokens, step = KVCache(), prompts, prompts
    for _ in range(new_tokens):
        logits = model(step, num_steps=(depth, 0), cache=cache).logits[:, -1, : model.config.vocab_size]
        step = logits.argmax(dim=-1)[:, None]
        tokens = torch.cat([tokens, step], dim=1)
    return tokens


def throughput(model: RecurrentGPT, args: argparse.Namespace) -> dict:
    cfg, depth = model.config, args.num_steps
    texts = prompts(args, cfg.vocab_size)
    threshold = DEFAULT_THRESHOLDS[args.criterion] if args.threshold is None else args.threshold
    adaptive = [Request(p, args.new_tokens, depth, args.criterion, threshold) for p in texts]
    fixed = [Request(p, args.new_tokens, depth) for p in texts]

    def engine(requests):
        config = EngineConfig(args.batch, 2**62, args.exit_wait, args.admit_rows, compile=args.compile)
        return lambda: outputs(Engine(model, config), requests)

    def plain():
        for first in range(0, len(texts), args.batch):
            kv_cache_greedy(model, torch.tensor(texts[first : first + args.batch]), args.new_tokens, depth)

    warm_up = time.perf_counter()
    engine(adaptive)()  # with compile: every kind the timed runs meet is compiled here
    engine(fixed)()
    compile_s = time.perf_counter() - warm_up
    timed = timed_rounds({"adaptive": engine(adaptive), "fixed": engine(fixed), "plain": plain}, args.repeats)
    (adaptive_s, adaptive_cpu, adaptive_out), (fixed_s, fixed_cpu, fixed_out), (plain_s, plain_cpu, _) = (
        timed["adaptive"], timed["fixed"], timed["plain"])
    tokens = len(texts) * args.new_tokens
    iterations = [i for _, token_iterations in adaptive_out for i in token_iterations]
    equal = sum(generate(model, torch.tensor([request.prompt]), args.new_tokens, depth, args.criterion, threshold,
                         generator=torch.Generator().manual_seed(request.seed))
                .tokens[0, PROMPT_TOKENS:].tolist() == tokens
                for request, (tokens, _) in zip(adaptive, adaptive_out))
    assert all(i == depth for _, token_iterations in fixed_out for i in token_iterations)
    mean = sum(iterations) / len(iterations)
    report = {
        "model": cfg.name, "checkpoint": args.checkpoint, "prompts": "data" if args.data_dir else "built-in",
        "requests": len(texts), "batch": args.batch, "new_tokens": args.new_tokens, "num_steps": depth,
        "criterion": args.criterion, "threshold": threshold, "exit_wait_steps": args.exit_wait, "admit_rows": args.admit_rows,
        "threads": torch.get_num_threads(), "engine_step": "compiled" if args.compile else "eager",
        "compile_s": compile_s if args.compile else 0.0,
        "adaptive_tokens_per_s": tokens / adaptive_s, "fixed_tokens_per_s": tokens / fixed_s,
        "generate_fixed_tokens_per_s": tokens / plain_s,
        "adaptive_tokens_per_cpu_s": tokens / adaptive_cpu, "fixed_tokens_per_cpu_s": tokens / fixed_cpu,
        "generate_fixed_tokens_per_cpu_s": tokens / plain_cpu,
        "mean_iterations": mean, "max_iterations": max(iterations),
        "tokens_equal_fraction": equal / len(texts),
    }
    config = EngineConfig(args.batch, 2**62, args.exit_wait, args.admit_rows)
    counted_adaptive, counted_fixed = counted_run(model, config, adaptive), counted_run(model, config, fixed)
    report["host_syncs_per_step"] = max(counted_adaptive["host_syncs_per_step"], counted_fixed["host_syncs_per_step"])
    report["ops_per_token_adaptive"] = counted_adaptive["ops_per_token"]
    report["ops_per_token_fixed"] = counted_fixed["ops_per_token"]
    report["graph_breaks"] = graph_breaks(model, config, adaptive[: args.batch])
    report["speedup"] = report["adaptive_tokens_per_s"] / report["fixed_tokens_per_s"]
    report["speedup_cpu"] = report["adaptive_tokens_per_cpu_s"] / report["fixed_tokens_per_cpu_s"]
    report["iteration_ratio"] = depth / mean
    report["speedup_over_generate_fixed"] = report["adaptive_tokens_per_s"] / report["generate_fixed_tokens_per_s"]
    report["ops_ratio_bound"] = 1.8 * mean / max(iterations)
    report["goals"] = {
        "host_syncs_per_step == 0": report["host_syncs_per_step"] == 0,
        "ops_per_token_adaptive / fixed <= 1.8 x mean / max iterations":
            report["ops_per_token_adaptive"] / report["ops_per_token_fixed"] <= report["ops_ratio_bound"],
        "tokens_equal_fraction == 1": report["tokens_equal_fraction"] == 1.0,
        "adaptive >= 1.5 x engine fixed": report["speedup"] >= 1.5,
        "adaptive >= 1.3 x generate_fixed": report["speedup_over_generate_fixed"] >= 1.3}
    return report


def counted_run(model: RecurrentGPT, config: EngineConfig, requests: list[Request]) -> dict:
    """One more engine run on `requests` under an OpCounter: ATen ops of every `step()` (admission and prefill
    included) per token emitted, and the host reads within the decode steps (StepRunner.run) per step."""
    engine = Engine(model, config)
    counter = OpCounter()
    counter.counting = False
    run, steps = engine.runner.run, []

    def counted_step(kind):
        read_before = counter.host_reads
        counter.counting = True
        try:
            run(kind)
        finally:
            counter.counting = False
        steps.append(counter.host_reads - read_before)

    engine.runner.run = counted_step
    ops, tokens = 0, 0
    with counter:
        request_ids = [engine.submit(request) for request in requests]
        while engine.busy:
            before = counter.ops
            counter.counting = True
            tokens += len(engine.step())
            counter.counting = False
            ops += counter.ops - before
    assert request_ids and tokens == sum(request.max_new_tokens for request in requests)
    return {"ops_per_token": ops / tokens, "host_syncs_per_step": sum(steps) / len(steps), "steps": len(steps)}


def graph_breaks(model: RecurrentGPT, config: EngineConfig, requests: list[Request]) -> int:
    """Graph breaks of the decode step (a finishing one, with the requests' criteria) under TorchDynamo, traced
    by torch._dynamo.explain on an engine a few steps into `requests`."""
    engine = Engine(model, config)
    for request in requests:
        engine.submit(request)
    for _ in range(3):
        engine.step()
    kind = dataclasses.replace(engine.kind(), finish=True)
    return torch._dynamo.explain(decode_step)(model, engine.slots, kind).graph_break_count


def criteria_table(model: RecurrentGPT, args: argparse.Namespace) -> None:
    from huginn_ray.eval.validation_rows import read_val_rows

    shard = sorted((Path(args.data_dir) / "val").glob("*.parquet"))[0]
    rows = torch.from_numpy(read_val_rows(shard, args.rows))
    print(f"\nteacher-forced on {args.rows} validation rows of {shard.name} (16 prompt + 48 forced tokens), batch 1")
    print("| criterion | threshold | mean iterations/token | loss | loss change vs fixed | FLOPs/token |")
    print("|---|---|---|---|---|---|")
    fixed_loss = None
    for name in ["none", *DEFAULT_THRESHOLDS]:
        losses, steps, flops = [], [], []
        for row in rows:
            r = generate(model, row[None, :16], 48, args.num_steps, exit_criterion=name, force_tokens=row[None, 16:64],
                         generator=torch.Generator().manual_seed(0))
            losses.append(-r.logprobs.mean())
            steps.append(r.steps[:, 1:].float().mean())
            flops.append(r.flops_per_token)
        loss = float(torch.stack(losses).mean())
        fixed_loss = loss if fixed_loss is None else fixed_loss
        threshold = "-" if name == "none" else DEFAULT_THRESHOLDS[name]
        print(f"| {name if name != 'none' else 'fixed depth'} | {threshold} | {float(torch.stack(steps).mean()):.2f} | "
              f"{loss:.4f} | {loss - fixed_loss:+.4f} | {sum(flops) / len(flops):.3g} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint")
    parser.add_argument("--data-dir")
    parser.add_argument("--batch", type=int, default=32, help="engine rows; kv_cache_greedy's batch")
    parser.add_argument("--requests", type=int, default=None, help="prompts (default: 2 x batch)")
    parser.add_argument("--num-steps", type=int, default=16, help="fixed depth, and the adaptive maximum")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--criterion", default="latent-diff", choices=list(DEFAULT_THRESHOLDS))
    parser.add_argument("--threshold", type=float, default=None, help="default: the criterion's")
    parser.add_argument("--exit-wait", type=int, default=3, help="the engines' EngineConfig.exit_wait_steps")
    parser.add_argument("--admit-rows", type=int, default=None,
                        help="the engines' EngineConfig.admit_rows (default: a quarter of --batch, at least 1)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="the engines' EngineConfig.compile (default: on)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of one timed run of each (in turn); the best of each counts")
    parser.add_argument("--rows", type=int, default=2, help="validation rows of the criteria table")
    parser.add_argument("--criteria-table", action="store_true", help="needs --checkpoint and --data-dir")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.requests = args.requests or 2 * args.batch
    args.admit_rows = args.admit_rows or max(1, args.batch // 4)
    if args.criteria_table and not (args.checkpoint and args.data_dir):
        parser.error("--criteria-table needs --checkpoint and --data-dir")
    torch.set_num_threads(args.threads)
    if args.checkpoint:
        model = load_pretrained(resolve_model_dir(args.checkpoint)).eval()
    else:
        torch.manual_seed(0)
        model = RecurrentGPT(ModelConfig.from_name("raven-tiny")).eval()
    report = throughput(model, args)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"model {report['model']} ({args.checkpoint or 'random init'}), {report['requests']} {report['prompts']} "
              f"prompts of {PROMPT_TOKENS} tokens, {args.new_tokens} new tokens each, greedy, batch {args.batch}, "
              f"{report['threads']} threads")
        print("| decoding | tokens/s | tokens per CPU s | mean iterations/token | max |\n|---|---|---|---|---|")
        adaptive = (f"engine, {args.criterion} < {report['threshold']}, exit_wait_steps {args.exit_wait}, "
                    f"admit_rows {args.admit_rows}")
        rows = [(adaptive, "adaptive", f"{report['mean_iterations']:.2f}", report["max_iterations"]),
                ("engine, fixed depth", "fixed", depth := args.num_steps, depth),
                ("model's KV cache (kv_cache_greedy), fixed depth", "generate_fixed", depth, depth)]
        for label, key, mean, most in rows:
            print(f"| {label} | {report[key + '_tokens_per_s']:.1f} | {report[key + '_tokens_per_cpu_s']:.1f} | "
                  f"{mean} | {most} |")
        print(f"adaptive / fixed: {report['speedup']:.2f}x (per CPU second {report['speedup_cpu']:.2f}x); "
              f"num_steps / mean iterations: {report['iteration_ratio']:.2f}; adaptive / kv_cache_greedy "
              f"{report['speedup_over_generate_fixed']:.2f}x; adaptive engine tokens equal to batch-1 generate: "
              f"{report['tokens_equal_fraction']:.3f}")
        print(f"host reads per decode step {report['host_syncs_per_step']}, ATen ops per token adaptive "
              f"{report['ops_per_token_adaptive']:.0f} / fixed {report['ops_per_token_fixed']:.0f}, graph breaks "
              f"{report['graph_breaks']}; goals: {report['goals']}")
    if args.criteria_table:
        criteria_table(model, args)


if __name__ == "__main__":
    main()
