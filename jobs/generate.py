"""Generate text from a checkpoint, at a fixed depth or with an adaptive exit.

    python jobs/generate.py --checkpoint DIR --prompt TEXT [--num-steps 32] [--max-new-tokens 64]
        [--exit-criterion kl --exit-threshold 1e-3] [--min-steps 0] [--check-every 1] [--no-exit-in-prefill]
        [--warm-start] [--cache full|latest|ring:16] [--tokenizer DIR] [--temperature 0] [--top-k K] [--top-p P] [--seed 0]
        [--chat [--system TEXT]] [--device cpu|cuda] [--dtype float32|bfloat16]

Prints the text, then tokens/s, mean core iterations per token, the iterations of each token, FLOPs per token
and cache bytes per token. DIR is a model directory, a training checkpoint, or a training out_dir (newest
checkpoint); DIR and --tokenizer may be in a bucket (`s3://...`: a model directory or a training checkpoint, read
through this node's cache, huginn_ray/model_cache.py). The tokenizer defaults to one stored beside the model. The
model runs on the accelerator in bf16 when one is present, else on the CPU in fp32 (--device, --dtype;
huginn_ray/model/inference.py).

With --chat the prompt is the user's message of a conversation (after a system message with --system), rendered
with the released chat template and Huginn's header (huginn_ray/data/chat.py, add_generation_prompt); generation
stops at Huginn's <|end_turn|>, and the whole conversation is printed as rendered.
"""

from __future__ import annotations

import argparse
import sys

import torch

from huginn_ray.generation.exits import DEFAULT_THRESHOLDS
from huginn_ray.generation.generate import generate
from huginn_ray.model.export import find_tokenizer
from huginn_ray.model.inference import DTYPES, inference_placement, load_for_inference
from huginn_ray.model_cache import local_dir, local_model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the one stored with the model)")
    parser.add_argument("--num-steps", type=int, default=None, help="core iterations (max with an exit criterion)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--exit-criterion", choices=[*DEFAULT_THRESHOLDS, "none"], default="none")
    parser.add_argument("--exit-threshold", type=float, default=None, help="default: the criterion's")
    parser.add_argument("--min-steps", type=int, default=0, help="iterations before the first check")
    parser.add_argument("--check-every", type=int, default=1)
    parser.add_argument("--no-exit-in-prefill", action="store_true", help="run the prompt at the full depth")
    parser.add_argument("--warm-start", action="store_true", help="continuous chain-of-thought")
    parser.add_argument("--cache", default="full", help="full, latest or ring:N")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None, help="with --temperature: sample among the k most probable")
    parser.add_argument("--top-p", type=float, default=None,
                        help="with --temperature: sample among the most probable tokens whose probability reaches P")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat", action="store_true", help="the prompt is a user message, in the chat template")
    parser.add_argument("--system", default="", help="with --chat: a system message before the prompt")
    parser.add_argument("--device", help="cpu or cuda[:N] (default: cuda when a GPU is present)")
    parser.add_argument("--dtype", choices=list(DTYPES), help="weights' dtype (default: bfloat16 on a GPU, else float32)")
    args = parser.parse_args(argv)
    if args.system and not args.chat:
        parser.error("--system needs --chat")
    try:
        placement = inference_placement(args.device, args.dtype)
        model_dir = local_model_dir(args.checkpoint, log=lambda line: print(line, file=sys.stderr))
        model, attention = load_for_inference(model_dir, placement)
        tokenizer_dir = local_dir(args.tokenizer, "--tokenizer") if args.tokenizer else find_tokenizer(model_dir)
        if tokenizer_dir is None:
            raise ValueError(f"no tokenizer stored with {model_dir}: pass --tokenizer")
        from huginn_ray.data.chat import chat_token_ids, render
        from huginn_ray.data.tokenizer import load_text_tokenizer, special_token_ids
        tokenizer = load_text_tokenizer(f"{tokenizer_dir}/tokenizer.json")  # the prompt is text, specials too
        special = special_token_ids(tokenizer_dir)
        if args.chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            ids, _ = render(messages + [{"role": "user", "content": args.prompt}], tokenizer,
                            add_generation_prompt=True)
            stop = chat_token_ids(tokenizer).end_turn
        else:
            ids = [special["bos"]] + tokenizer.encode(args.prompt, add_special_tokens=False).ids
            stop = special["eos"]
        torch.manual_seed(args.seed)
        result = generate(
            model, torch.tensor([ids], device=placement.device), args.max_new_tokens, num_steps=args.num_steps,
            exit_criterion=args.exit_criterion, exit_threshold=args.exit_threshold, min_steps=args.min_steps,
            check_every=args.check_every, exit_in_prefill=not args.no_exit_in_prefill, cache=args.cache,
            warm_start=args.warm_start,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_token_id=stop,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    new = result.tokens[0, len(ids):].tolist()
    if args.chat:
        print(tokenizer.decode(ids + new, skip_special_tokens=False))
    else:
        print(args.prompt + tokenizer.decode(new, skip_special_tokens=False))
    depth = args.num_steps or model.config.mean_recurrence
    how = "fixed depth" if args.exit_criterion == "none" else f"exit {args.exit_criterion}"
    print(f"[huginn] {len(new)} tokens in {result.seconds:.2f}s: {len(new) / result.seconds:.1f} tokens/s "
          f"({how}, max {depth} iterations, cache {args.cache}{', warm start' if args.warm_start else ''}; "
          f"{placement.describe()}, {attention} attention)")
    print(f"[huginn] mean core iterations per token: {result.mean_steps:.2f} "
          f"(per token: {' '.join(str(s) for s in result.steps[0].tolist())})")
    print(f"[huginn] FLOPs per token: {result.flops_per_token:.3g}; cache bytes per token: "
          f"{result.cache_bytes_per_token:,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
