"""Serving load test: N concurrent clients on loopback against the OpenAI-compatible server (jobs/serve.py).

    python bench/serve_load.py --checkpoint DIR [--tokenizer DIR] [--max-rows 8] [--replicas 1] [--exit-wait-steps N]
        [--compile] [--warm-up]
        [--clients 8] [--requests 64] [--max-seconds 120] [--max-tokens 24] [--num-steps 16]
        [--exit-criterion latent-diff] [--exit-threshold 0.03] [--stream-every 2] [--json]
    python bench/serve_load.py --url http://127.0.0.1:8000 ...      # a server already running

Without --url it starts `jobs/serve.py` on a free loopback port (its own private local Ray; run it inside
tools/private_netns.sh on a shared machine), and stops it with SIGINT at the end. `--clients` threads send
`--requests` completions in all (each client its next request as soon as its last one is answered), stopping
early after `--max-seconds`. Prompts: 16 seeded random token ids each; greedy, each request its own seed; every
`--stream-every`-th request is streamed. Prints output tokens/s (tokens of all answered requests over the wall
time from the first request to the last answer), p50/p99 latency of a whole request, p50/p99 time to the first
token of the streamed ones, and the mean core iterations per token; --json prints one JSON object. `--compile`
starts the server with `--compile`; `--warm-up` sends the whole load once, untimed, before the measured one (with
--compile: every kind of decode step the measured run meets is compiled then).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

PROMPT_TOKENS = 16
REPO = Path(__file__).resolve().parents[1]


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile (of at least one value)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def one_request(host: str, port: int, body: dict) -> dict:
    """Send one completion; its latency, time to first token (streamed), tokens and core iterations."""
    started = time.perf_counter()
    connection = http.client.HTTPConnection(host, port, timeout=600)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
    first_token = None
    if body["stream"]:
        tokens, iterations = 0, 0
        for line in response:
            line = line.strip()
            if line == b"data: [DONE]":
                break
            if line:
                choice = json.loads(line[len(b"data: "):])["choices"][0]
                if choice["token_ids"] and first_token is None:
                    first_token = time.perf_counter() - started
                tokens += len(choice["token_ids"])
                iterations += sum(choice["core_iterations"])
    else:
        usage = json.loads(response.read())["usage"]
        tokens, iterations = usage["completion_tokens"], usage["core_iterations"]
    connection.close()
    return dict(latency=time.perf_counter() - started, first_token=first_token, tokens=tokens, iterations=iterations)


def load(url: str, args: argparse.Namespace, vocab_size: int) -> dict:
    import random

    parsed = urllib.parse.urlparse(url)
    rng = random.Random(0)
    bodies = [dict(prompt=[rng.randrange(vocab_size) for _ in range(PROMPT_TOKENS)], max_tokens=args.max_tokens,
                   temperature=0, seed=index, num_steps=args.num_steps, exit_criterion=args.exit_criterion,
                   exit_threshold=args.exit_threshold, stream=index % args.stream_every == 0,
                   return_token_ids=True) for index in range(args.requests)]
    results, errors, lock = [], [], threading.Lock()
    next_index = iter(range(args.requests))
    started = time.perf_counter()
    deadline = started + args.max_seconds

    def client():
        while time.perf_counter() < deadline:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            try:
                result = one_request(parsed.hostname, parsed.port, bodies[index])
            except Exception as err:  # reported, not hidden: a load test counts its failures
                with lock:
                    errors.append(f"request {index}: {err}")
                continue
            with lock:
                results.append(result)

    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if not results:
        raise SystemExit(f"no request was answered: {errors[:3]}")
    tokens = sum(r["tokens"] for r in results)
    firsts = [r["first_token"] for r in results if r["first_token"] is not None]
    return dict(clients=args.clients, requests=len(results), failed=len(errors), wall_s=round(wall, 2),
                tokens=tokens, tokens_per_s=round(tokens / wall, 1),
                latency_p50_s=round(percentile([r["latency"] for r in results], 0.5), 3),
                latency_p99_s=round(percentile([r["latency"] for r in results], 0.99), 3),
                first_token_p50_s=round(percentile(firsts, 0.5), 3) if firsts else None,
                first_token_p99_s=round(percentile(firsts, 0.99), 3) if firsts else None,
                mean_iterations=round(sum(r["iterations"] for r in results) / tokens, 2), errors=errors[:3])


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, str(REPO / "jobs" / "serve.py"), "--checkpoint", args.checkpoint, "--port", str(port),
               "--max-rows", str(args.max_rows), "--replicas", str(args.replicas)]
    if args.tokenizer:
        command += ["--tokenizer", args.tokenizer]
    if args.exit_wait_steps is not None:
        command += ["--exit-wait-steps", str(args.exit_wait_steps)]
    if args.compile:
        command.append("--compile")
    server = subprocess.Popen(command, env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return server, url
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise SystemExit(f"the server did not come up (exit status {server.poll()})")
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="model to serve (a server this script starts)")
    parser.add_argument("--tokenizer")
    parser.add_argument("--url", help="a running server instead")
    parser.add_argument("--max-rows", type=int, default=8, help="engine rows of the server it starts")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--exit-wait-steps", type=int, help="the server's --exit-wait-steps (default: the server's)")
    parser.add_argument("--compile", action="store_true", help="the server's --compile")
    parser.add_argument("--warm-up", action="store_true", help="send the whole load once, untimed, first")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-seconds", type=float, default=120)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--num-steps", type=int, default=16)
    parser.add_argument("--exit-criterion", default="latent-diff")
    parser.add_argument("--exit-threshold", type=float, default=0.03)
    parser.add_argument("--stream-every", type=int, default=2, help="every N-th request is streamed")
    parser.add_argument("--vocab-size", type=int, default=None, help="prompt token ids below this (default: the "
                        "model's vocab_size with --checkpoint, else 4096)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if bool(args.url) == bool(args.checkpoint):
        parser.error("give --checkpoint (a server it starts) or --url (a running one)")
    vocab_size = args.vocab_size
    if vocab_size is None and args.checkpoint:
        from huginn_ray.model.config import ModelConfig
        from huginn_ray.model.pretrained import resolve_model_dir

        vocab_size = ModelConfig.from_json(resolve_model_dir(args.checkpoint) / "config.json").vocab_size
    server = None
    url = args.url
    if args.checkpoint:
        server, url = start_server(args)
    try:
        if args.warm_up:
            load(url, args, vocab_size or 4096)
        figures = load(url, args, vocab_size or 4096)
    finally:
        if server is not None:
            server.send_signal(signal.SIGINT)
            server.wait(timeout=120)
    if args.json:
        print(json.dumps(figures))
        return
    print(f"{figures['requests']} requests ({figures['failed']} failed) from {args.clients} clients in "
          f"{figures['wall_s']} s: {figures['tokens']} tokens, {figures['tokens_per_s']} tokens/s; latency p50 "
          f"{figures['latency_p50_s']} s, p99 {figures['latency_p99_s']} s; time to first token (streamed) p50 "
          f"{figures['first_token_p50_s']} s, p99 {figures['first_token_p99_s']} s; mean core iterations per token "
          f"{figures['mean_iterations']}")
    for error in figures["errors"]:
        print(f"error: {error}")


if __name__ == "__main__":
    main()
