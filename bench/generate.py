"""Generation benchmark: what adaptive exits buy in throughput under continuous depth batching.

    python bench/generate.py [--checkpoint DIR] [--data-dir SHARDS] [--batch 32] [--requests 64]
        [--num-steps 16] [--new-tokens 24] [--criterion latent-diff --threshold 0.03] [--exit-wait 3]
        [--admit-rows BATCH/4] [--threads 1] [--json]

On the same prompts and model (raven-tiny at random init without --checkpoint), greedy decoding:
(a) the engine (huginn_ray.generation.engine) with `--batch` rows, an adaptive exit criterion,
    `EngineConfig.exit_wait_steps=--exit-wait` and `admit_rows=--admit-rows`;
(b) the engine at the fixed depth `--num-steps` (the same EngineConfig);
(c) the model's own KV cache at that fixed depth (`kv_cache_greedy`: one forward per token), `--batch` prompts
    per call.
Prints tokens/s (wall clock) and tokens per CPU second of this process (steadier on a shared machine), each
the best of --repeats runs, mean and maximum core iterations per token, and the fraction of requests whose
adaptive engine output equals `generate` at batch size 1 (token for token); --json prints one JSON object.
Prompts: the first 16 tokens of rows of --data-dir shards (val/*.parquet, then train/*.parquet) when given, else a
built-in set (seeded random token ids). The goal: adaptive tokens/s >= 0.7 x (num_steps / mean iterations) x
fixed-depth tokens/s, i.e. the iterations that exits save become throughput.

--profile adds, for each engine, its loop steps and calls and what a call costs by its rows (`step_profile`),
and the most adaptive / fixed that separate core and finish calls of these costs can give (`exit_bound`).
With --checkpoint and --data-dir it also prints, at batch size 1 teacher-forced on validation rows (prompt 16
tokens, then 48 forced), the mean core iterations per token and the next-token loss of each exit criterion at
its default threshold against the fixed depth (--criteria-table).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

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


def timed(run, repeats: int):
    """(best wall seconds, best process CPU seconds, the last run's result) over `repeats` runs: on a shared
    machine the CPU seconds are the steadier figure."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        out = run()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus), out


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
        config = EngineConfig(args.batch, 2**62, args.exit_wait, args.admit_rows)
        return lambda: outputs(Engine(model, config), requests)

    def plain():
        for first in range(0, len(texts), args.batch):
            kv_cache_greedy(model, torch.tensor(texts[first : first + args.batch]), args.new_tokens, depth)

    engine(adaptive[: args.batch])()  # warm-up
    adaptive_s, adaptive_cpu, adaptive_out = timed(engine(adaptive), args.repeats)
    fixed_s, fixed_cpu, fixed_out = timed(engine(fixed), args.repeats)
    plain_s, plain_cpu, _ = timed(plain, args.repeats)
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
        "threads": torch.get_num_threads(),
        "adaptive_tokens_per_s": tokens / adaptive_s, "fixed_tokens_per_s": tokens / fixed_s,
        "generate_fixed_tokens_per_s": tokens / plain_s,
        "adaptive_tokens_per_cpu_s": tokens / adaptive_cpu, "fixed_tokens_per_cpu_s": tokens / fixed_cpu,
        "generate_fixed_tokens_per_cpu_s": tokens / plain_cpu,
        "mean_iterations": mean, "max_iterations": max(iterations),
        "tokens_equal_fraction": equal / len(texts),
    }
    report["speedup"] = report["adaptive_tokens_per_s"] / report["fixed_tokens_per_s"]
    report["speedup_cpu"] = report["adaptive_tokens_per_cpu_s"] / report["fixed_tokens_per_cpu_s"]
    report["iteration_ratio"] = depth / mean
    report["goal_met"] = report["speedup"] >= 0.7 * report["iteration_ratio"]
    return report


def step_profile(model: RecurrentGPT, args: argparse.Namespace) -> dict:
    """One more run of each engine on the same requests with the calls of its loop steps timed
    (time.perf_counter around huginn_ray.generation.stepping's `iterate` and `coda_head` and the engine's `finish`):
    loop steps, tokens per step, core calls and their rows, `finish` calls and their rows, and the median
    milliseconds of a decoding core call and of a decoding coda + head call by their number of rows (what a
    call's cost does with its rows)."""
    import huginn_ray.generation.engine as engine_module
    import huginn_ray.generation.stepping as stepping

    calls: dict[str, list[tuple[int, bool, float]]] = {}
    patched = [(stepping, "iterate", "core"), (stepping, "coda_head", "coda_head"), (engine_module, "finish", "finish")]
    originals = [getattr(module, name) for module, name, _ in patched]

    def timed_call(function, key):
        def call(model, sequences, *rest):
            began = time.perf_counter()
            out = function(model, sequences, *rest)
            decoding = all(sequence.length == 1 for sequence in sequences)
            calls.setdefault(key, []).append((len(sequences), decoding, time.perf_counter() - began))
            return out
        return call

    def median_ms(key: str) -> dict[int, float]:
        by_rows: dict[int, list[float]] = {}
        for rows, decoding, seconds in calls.get(key, []):
            if decoding:
                by_rows.setdefault(rows, []).append(seconds)
        return {rows: round(1000 * sorted(t)[len(t) // 2], 3) for rows, t in sorted(by_rows.items())}

    texts = prompts(args, model.config.vocab_size)
    threshold = DEFAULT_THRESHOLDS[args.criterion] if args.threshold is None else args.threshold
    report = {}
    for label, criterion in (("adaptive", args.criterion), ("fixed", None)):
        calls.clear()
        engine = Engine(model, EngineConfig(args.batch, 2**62, args.exit_wait, args.admit_rows))
        for (module, name, key), function in zip(patched, originals):
            setattr(module, name, timed_call(function, key))
        try:
            outputs(engine, [Request(p, args.new_tokens, args.num_steps, criterion, threshold) for p in texts])
        finally:
            for (module, name, _), function in zip(patched, originals):
                setattr(module, name, function)
        steps = engine.loop_step
        report[label] = {
            "loop_steps": steps, "tokens_per_step": len(texts) * args.new_tokens / steps,
            "core_calls_per_step": len(calls["core"]) / steps,
            "rows_per_core_call": sum(rows for rows, _, _ in calls["core"]) / len(calls["core"]),
            "rows_per_decoding_core_call": sum(rows for rows, decoding, _ in calls["core"] if decoding)
            / max(1, sum(decoding for _, decoding, _ in calls["core"])),
            "finish_calls_per_step": len(calls["finish"]) / steps,
            "rows_per_finish_call": sum(rows for rows, _, _ in calls["finish"]) / len(calls["finish"]),
            "core_ms_by_rows": median_ms("core"), "coda_head_ms_by_rows": median_ms("coda_head"),
            "finish_ms": round(1000 * sorted(t for _, _, t in calls["finish"])[len(calls["finish"]) // 2], 3)}
    return report


def exit_bound(core_ms: float, finish_ms: float, mean: float, depth: int, wait: int) -> float:
    """The most adaptive / fixed tokens/s that separate core and finish calls can give where a call costs the
    same whatever its rows (per-call overhead, or reading the weights): R rows always iterating, none draining,
    admitted or in prefill. A token then takes `mean` core iterations plus, with exit_wait_steps `wait`, about
    wait / 2 steps waiting for its finish (coda, head, next prelude), and one finish call serves the rows of
    wait + 1 steps; the fixed depth runs `depth` steps per token and one finish per forward:
        adaptive / fixed <= depth / (mean + wait / 2) * (c + f / depth) / (c + f / (wait + 1))
    with c a core call's cost and f a finish call's."""
    c, f = core_ms, finish_ms
    return depth / (mean + wait / 2) * (c + f / depth) / (c + f / (wait + 1))


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
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each; the best counts")
    parser.add_argument("--rows", type=int, default=2, help="validation rows of the criteria table")
    parser.add_argument("--criteria-table", action="store_true", help="needs --checkpoint and --data-dir")
    parser.add_argument("--profile", action="store_true",
                        help="also time each engine's calls by their rows (step_profile; JSON key 'profile')")
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
    if args.profile:
        profile = report["profile"] = step_profile(model, args)
        # the bound with this run's figures: the fixed engine's core call over its full batch, the adaptive
        # engine's median finish call, the adaptive mean iterations; at this exit_wait_steps and the best of 0-8
        core_ms = profile["fixed"]["core_ms_by_rows"][max(profile["fixed"]["core_ms_by_rows"])]
        finish_ms = profile["adaptive"]["finish_ms"]

        def bound_at(wait: int) -> float:
            return exit_bound(core_ms, finish_ms, report["mean_iterations"], args.num_steps, wait)

        bounds = {wait: bound_at(wait) for wait in range(9)}
        best = max(bounds, key=bounds.get)
        profile["bound"] = {"core_ms": core_ms, "finish_ms": finish_ms, "at_exit_wait": bound_at(args.exit_wait),
                            "best": bounds[best], "best_exit_wait": best}
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
              f"num_steps / mean iterations: {report['iteration_ratio']:.2f}; goal (>= 0.7 x that) "
              f"{'met' if report['goal_met'] else 'not met'}; adaptive engine tokens equal to batch-1 generate: "
              f"{report['tokens_equal_fraction']:.3f}")
        for label in ("adaptive", "fixed") if "profile" in report else ():
            profile = report["profile"][label]
            print(f"{label} engine: {profile['loop_steps']} loop steps, {profile['tokens_per_step']:.2f} tokens, "
                  f"{profile['core_calls_per_step']:.2f} core calls of {profile['rows_per_core_call']:.1f} rows (decoding "
                  f"calls {profile['rows_per_decoding_core_call']:.1f}) and "
                  f"{profile['finish_calls_per_step']:.2f} finish calls of {profile['rows_per_finish_call']:.1f} rows a "
                  f"step; median ms of a decoding core call by rows {profile['core_ms_by_rows']}, of a coda + head "
                  f"call {profile['coda_head_ms_by_rows']}, of a finish call {profile['finish_ms']}")
        if "profile" in report:
            bound = report["profile"]["bound"]
            print(f"bound (exit_bound) with a core call of {bound['core_ms']} ms and a finish call of "
                  f"{bound['finish_ms']} ms: adaptive / fixed <= {bound['at_exit_wait']:.2f}x at exit_wait_steps "
                  f"{args.exit_wait}, {bound['best']:.2f}x at best (exit_wait_steps {bound['best_exit_wait']}); "
                  f"the goal asks {0.7 * report['iteration_ratio']:.2f}x")
    if args.criteria_table:
        criteria_table(model, args)


if __name__ == "__main__":
    main()
