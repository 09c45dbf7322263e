"""The continuous-depth-batching engine: each request gets what `generate` gives it alone at batch size 1,
with requests arriving while others run, within its capacities in rows and cache bytes."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from huginn_ray.generation import engine as engine_module
from huginn_ray.generation import stepping
from huginn_ray.generation.engine import Engine, EngineConfig
from huginn_ray.generation.exits import DEFAULT_THRESHOLDS, ExitCriterion
from huginn_ray.generation.generate import generate
from huginn_ray.generation.requests import Request, pick
from huginn_ray.model import ModelConfig, RecurrentGPT

CRITERIA = [*DEFAULT_THRESHOLDS, None]
THRESHOLDS = {"entropy-diff": 1e-2, "latent-diff": 0.1, "kl": 5e-3, "minp-kl": 1e-3, "argmax-stability": 2,
              "cosine": 1e-2}
"""Thresholds at which this model's rows exit at different iterations (the defaults rarely exit it early)."""
CACHES = ["full", "latest", "ring:3"]
SAMPLING = [dict(), dict(temperature=0.8), dict(temperature=1.0, top_k=20), dict(temperature=0.9, top_p=0.8)]
ROUNDING = 1e-4
"""A batched matmul's fp32 rounding may move a criterion value across its threshold; only a value within this
relative distance of the threshold explains a difference."""


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return RecurrentGPT(ModelConfig.from_name("raven-tiny")).eval()  # noise as the initial state, as released


def requests(count: int, seed: int = 5, **fixed) -> list[Request]:
    """Requests that differ in every setting: prompt length, criterion, cache, sampling, warm start, checks."""
    g = torch.Generator().manual_seed(seed)
    made = []
    for i in range(count):
        criterion = CRITERIA[i % len(CRITERIA)]
        prompt = tuple(torch.randint(0, 4000, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist())
        settings = dict(max_new_tokens=5 + i % 3, num_steps=10, exit_criterion=criterion,
                        exit_threshold=THRESHOLDS.get(criterion), cache=CACHES[i % len(CACHES)],
                        warm_start=i % 2 == 0, min_steps=i % 2, check_every=1 + (i % 4 == 3),
                        exit_in_prefill=i % 5 != 4, seed=100 + i, **SAMPLING[i % len(SAMPLING)])
        made.append(Request(prompt, **{**settings, **fixed}))
    return made


class Trace:
    """Every Sequence made and, per sequence, each forward's criterion values (for explaining differences)."""

    def __init__(self, monkeypatch):
        self.sequences = []
        init, begin = stepping.Sequence.__init__, stepping.Sequence.begin
        quantities = ExitCriterion.quantities
        trace = self

        def traced_init(sequence, *args, **kwargs):
            init(sequence, *args, **kwargs)
            sequence.values = []
            trace.sequences.append(sequence)

        def traced_begin(sequence, *args, **kwargs):
            begin(sequence, *args, **kwargs)
            sequence.values.append([])
            if sequence.criterion is not None:
                sequence.criterion.log = sequence.values[-1]

        def traced_quantities(criteria, *args, **kwargs):
            values = quantities(criteria, *args, **kwargs)
            for criterion, value in zip(criteria, values.tolist()):
                criterion.log.append(value)
            return values

        monkeypatch.setattr(stepping.Sequence, "__init__", traced_init)
        monkeypatch.setattr(stepping.Sequence, "begin", traced_begin)
        monkeypatch.setattr(ExitCriterion, "quantities", staticmethod(traced_quantities))


def alone(model, request: Request):
    """`generate` at batch size 1 with the request's settings and its seeded generator."""
    result = generate(model, torch.tensor([request.prompt]), request.max_new_tokens, request.num_steps,
                      request.exit_criterion, request.exit_threshold, request.min_steps, request.check_every,
                      request.exit_in_prefill, request.cache, request.warm_start, request.temperature,
                      request.top_k, request.top_p, generator=torch.Generator().manual_seed(request.seed))
    return result.tokens[0, len(request.prompt):].tolist(), result.steps[0].tolist()


def compare(request, batched, single, got, expected) -> int:
    """0 when the engine's output equals batch size 1's; 1 when the first difference is an exit moved across
    the threshold by rounding (a criterion value within ROUNDING of it in either run); else fails."""
    if got == expected:
        return 0
    (tokens, steps), (tokens_1, steps_1) = got, expected
    first = next(i for i in range(min(len(steps), len(steps_1))) if (tokens[i], steps[i]) != (tokens_1[i], steps_1[i]))
    assert steps[first] != steps_1[first], f"token {first} differs at the same depth: {got} vs {expected}"
    threshold = request.exit_threshold
    near = [v for v in batched.values[first] + single.values[first] if abs(v - threshold) <= ROUNDING * threshold]
    assert near, (f"token {first}: depth {steps[first]} vs {steps_1[first]} alone, with no criterion value within "
                  f"{ROUNDING} of {threshold}: {batched.values[first]} vs {single.values[first]}")
    print(f"rounding moved an exit: token {first}, values {near} at threshold {threshold}")
    return 1


def test_only_a_criterion_value_at_the_threshold_explains_a_difference():
    request = Request((1,), 2, exit_criterion="kl", exit_threshold=1e-3)
    same = ([5, 6], [3, 4])
    assert compare(request, None, None, same, same) == 0
    at_threshold = SimpleNamespace(values=[[0.5, 0.99995e-3]])  # exits after 2 iterations, alone after 3
    alone_values = SimpleNamespace(values=[[0.5, 1.00002e-3, 1e-4]])
    assert compare(request, at_threshold, alone_values, ([5, 7], [2, 4]), ([5, 6], [3, 4])) == 1
    away = SimpleNamespace(values=[[0.5, 0.9e-3]])
    with pytest.raises(AssertionError, match="no criterion value within"):
        compare(request, away, SimpleNamespace(values=[[0.5, 1.1e-3, 1e-4]]), ([5], [2]), ([5], [3]))
    with pytest.raises(AssertionError, match="differs at the same depth"):
        compare(request, at_threshold, alone_values, ([5, 7], [3, 4]), ([5, 6], [3, 4]))


@pytest.mark.parametrize("exit_wait_steps,admit_rows", [(0, 1), (3, 2)])
def test_each_request_gets_its_batch_1_output_with_requests_arriving_while_others_run(model, monkeypatch,
                                                                                      exit_wait_steps, admit_rows):
    trace = Trace(monkeypatch)
    calls = {"steps_with_ends": 0, "finish": 0}

    def counted(name, function):
        def call(*args):
            out = function(*args)
            calls[name] += bool(out) if name == "steps_with_ends" else 1
            return out
        monkeypatch.setattr(engine_module, function.__name__, call)

    counted("steps_with_ends", engine_module.iterate_pool)
    counted("finish", engine_module.finish)
    wanted = requests(21)  # every criterion x cache strategy, every sampling mode, warm start or not
    engine = Engine(model, EngineConfig(max_rows=4, max_cache_bytes=10**9, exit_wait_steps=exit_wait_steps,
                                        admit_rows=admit_rows))
    waits, held = [0], 0
    arrivals = {0: wanted[:6], 3: wanted[6:9], 7: wanted[9:10], 12: wanted[10:]}
    ids, outputs, in_flight, mixed, mid_forward = [], {}, [], 0, 0
    step = 0
    while step <= max(arrivals) or engine.busy:
        if step in arrivals:
            mid_forward += any(sequence.iteration > 0 for sequence in engine.pool.values())
            ids += [engine.submit(request) for request in arrivals[step]]
        free, waiting, running = 4 - engine.rows_in_flight, len(engine.waiting), engine.rows_in_flight
        events = engine.step()
        admitted = waiting - len(engine.waiting)
        if waiting and running:  # admission waits for admit_rows free rows (or all that wait), then takes them
            assert admitted == (min(free, waiting) if free >= min(admit_rows, waiting) else 0), (free, waiting)
            held += 0 < free < min(admit_rows, waiting)
        for event in events:
            tokens, steps = outputs.setdefault(event.request_id, ([], []))
            tokens.append(event.token_id)
            steps.append(event.core_iterations)
        pool = list(engine.pool.values())
        in_flight.append(len(pool))
        mixed += len({s.cache.length for s in pool}) > 1 and len({s.iteration for s in pool}) > 1
        waits += [engine.loop_step - ended for ended in engine.ended_at.values()]  # steps waited so far
        step += 1
    assert max(in_flight) == 4 and engine.rows_in_flight == 0 and engine.cache_bytes_reserved == 0
    # ended forwards wait for others up to exit_wait_steps, never longer; so fewer coda/prelude calls
    assert max(waits) == exit_wait_steps
    assert (held > 0) == (admit_rows > 1)  # free rows left idle for admit_rows
    if exit_wait_steps:
        assert calls["finish"] < calls["steps_with_ends"]
    else:
        assert calls["finish"] == calls["steps_with_ends"]
    assert mixed > 10 and mid_forward == 3  # rows at different positions and iterations; arrivals mid-forward
    batched = list(trace.sequences)  # in admission order: first come, first served
    rounding = 0
    for request_id, request, sequence in zip(ids, wanted, batched):
        expected = alone(model, request)
        rounding += compare(request, sequence, trace.sequences[-1], outputs[request_id], expected)
    print(f"differences explained by rounding at the threshold: {rounding} of {len(wanted)} requests")
    steps = [s for _, iterations in outputs.values() for s in iterations]
    assert min(steps) < 10 and max(steps) == 10  # exits happened, and full depth too


def test_a_request_arriving_mid_batch_gets_its_batch_1_output(model):
    first = requests(3, seed=9, max_new_tokens=8)
    late = requests(1, seed=11, exit_criterion="kl", exit_threshold=5e-3)[0]
    engine = Engine(model, EngineConfig(max_rows=8, max_cache_bytes=10**9))
    running = [engine.submit(request) for request in first]
    outputs = {request_id: [] for request_id in running}
    for _ in range(12):
        for event in engine.step():
            outputs[event.request_id].append(event.token_id)
    assert all(0 < len(outputs[request_id]) for request_id in running) and engine.rows_in_flight == 3
    assert any(sequence.iteration > 0 for sequence in engine.pool.values())
    late_id = engine.submit(late)
    outputs[late_id] = []
    while engine.busy:
        for event in engine.step():
            outputs[event.request_id].append(event.token_id)
    assert outputs[late_id] == alone(model, late)[0]
    assert [outputs[request_id] for request_id in running] == [alone(model, request)[0] for request in first]


def test_capacity_in_cache_bytes_holds_admission_and_freed_rows_are_reused(model):
    wanted = requests(6, seed=3, cache="full", num_steps=6, max_new_tokens=4)
    probe = Engine(model, EngineConfig(max_rows=1, max_cache_bytes=10**9))
    needs = [probe.reservation(request.checked(model.config)) for request in wanted]
    cfg = model.config
    assert needs[0] == (len(wanted[0].prompt) + 3) * 2 * cfg.n_embd * 4 * (
        cfg.n_layers_in_prelude + cfg.n_layers_in_coda + cfg.n_layers_in_recurrent_block * 6)
    capacity = sorted(needs)[-1] + sorted(needs)[-2]  # room for any two, never three
    assert capacity < sum(sorted(needs)[:3])
    engine = Engine(model, EngineConfig(max_rows=8, max_cache_bytes=capacity))
    ids = [engine.submit(request) for request in wanted]
    outputs, in_flight = {request_id: [] for request_id in ids}, []
    while engine.busy:
        for event in engine.step():
            outputs[event.request_id].append(event.token_id)
        assert engine.cache_bytes_reserved <= capacity
        in_flight.append(engine.rows_in_flight)
    assert max(in_flight) == 2 and len(in_flight) > 2 * 4  # two at a time, freed capacity reused
    entry_bytes = 2 * cfg.n_embd * 4
    assert (engine.caches.entries.shape[0] - 1) * entry_bytes <= capacity  # the pool's storage too (less scratch)
    assert [outputs[request_id] for request_id in ids] == [alone(model, request)[0] for request in wanted]

    # cancel frees the row at once: the waiting request takes it in the next step
    engine = Engine(model, EngineConfig(max_rows=1, max_cache_bytes=10**9))
    first, second = engine.submit(wanted[0]), engine.submit(wanted[1])
    engine.step()
    assert list(engine.pool) == [first] and engine.cancel(first) and engine.rows_in_flight == 0
    assert engine.cancel(first) is False
    engine.step()
    assert list(engine.pool) == [second]


def test_stop_tokens_finish_a_request(model):
    request = requests(1, seed=5, exit_criterion=None)[0]
    tokens, _ = alone(model, request)
    engine = Engine(model, EngineConfig(max_rows=2, max_cache_bytes=10**9))
    engine.submit(dataclasses.replace(request, stop_token_ids=(tokens[2],)))
    events = []
    while engine.busy:
        events += engine.step()
    assert [event.token_id for event in events] == tokens[: tokens.index(tokens[2]) + 1]
    assert events[-1].finish_reason == "stop"


def test_top_p_samples_from_the_smallest_set_that_reaches_it():
    logits = torch.tensor([[0.6, 0.3, 0.1]]).log()
    g = torch.Generator().manual_seed(0)
    drawn = {p: {int(pick(logits, 1.0, None, g, p)) for _ in range(200)} for p in (0.5, 0.8, 1.0)}
    assert drawn == {0.5: {0}, 0.8: {0, 1}, 1.0: {0, 1, 2}}


@pytest.mark.parametrize("field,value,message", [
    ("prompt", (), "prompt must be a non-empty"),
    ("prompt", (1, 4096), r"prompt\[1\] = 4096 is not a token id in \[0, 4096\)"),
    ("max_new_tokens", 0, "max_new_tokens must be an integer >= 1, got 0"),
    ("max_new_tokens", 255, "prompt length 2 \\+ max_new_tokens 255 exceeds block_size=256"),
    ("num_steps", 0, "num_steps must be an integer >= 1"),
    ("exit_criterion", "entropy", "unknown exit criterion 'entropy' \\(exit_criterion\\)"),
    ("exit_threshold", -1.0, "exit_threshold must be a number >= 0"),
    ("check_every", "2", "check_every must be an integer >= 1, got '2'"),
    ("cache", "ring:0", "cache must be 'full', 'latest' or 'ring:N'"),
    ("warm_start", 1, "warm_start must be true or false"),
    ("temperature", -0.5, "temperature must be a number >= 0"),
    ("top_k", 0, "top_k must be an integer >= 1"),
    ("top_p", 0.0, "top_p must be a number > 0 and <= 1"),
    ("seed", -1, "seed must be an integer >= 0"),
    ("stop_token_ids", (5000,), "stop_token_ids holds 5000"),
])
def test_bad_request_fields_are_refused_naming_the_field(model, field, value, message):
    engine = Engine(model, EngineConfig(max_rows=2, max_cache_bytes=10**9))
    settings = dict(prompt=(1, 2), max_new_tokens=3, exit_criterion="kl")
    with pytest.raises(ValueError, match=message):
        engine.submit(Request(**{**settings, field: value}))
    assert not engine.busy


def test_capacities_are_checked(model):
    with pytest.raises(ValueError, match="max_rows must be an integer >= 1, got 0"):
        EngineConfig(max_rows=0, max_cache_bytes=1)
    with pytest.raises(ValueError, match="exit_wait_steps must be an integer >= 0, got -1"):
        EngineConfig(max_rows=1, max_cache_bytes=1, exit_wait_steps=-1)
    with pytest.raises(ValueError, match="admit_rows must be at most max_rows=2, got 3"):
        EngineConfig(max_rows=2, max_cache_bytes=1, admit_rows=3)
    engine = Engine(model, EngineConfig(max_rows=2, max_cache_bytes=1000))
    with pytest.raises(ValueError, match="exceeds max_cache_bytes=1,000"):
        engine.submit(Request((1, 2), 3))


def test_a_full_row_with_the_most_cache_keys_batches_with_a_latest_row(model):
    """The `full` row, in the last slot, keeps more table keys than any other; batched with a `latest` row it
    must not index past its own keys for the latest copies it does not keep."""
    mixed = [Request((5, 6, 7), max_new_tokens=4, num_steps=4, cache="latest", seed=1),
             Request((8, 9), max_new_tokens=4, num_steps=8, cache="full", seed=2)]
    engine = Engine(model, EngineConfig(max_rows=2, max_cache_bytes=10**9))
    outputs = {engine.submit(request): [] for request in mixed}
    while engine.busy:
        for event in engine.step():
            outputs[event.request_id].append(event.token_id)
    assert list(outputs.values()) == [alone(model, request)[0] for request in mixed]


def test_the_generation_benchmark_reports_the_exit_bound_of_its_own_calls(tmp_path):
    """bench/generate.py --profile: the bound of separate core and finish calls, from the run's own call costs;
    exit_bound itself at its two limits (a free finish gives the iteration ratio; no exits cost a finish a step)."""
    repo = Path(__file__).resolve().parent.parent
    # by its path: jobs/generate.py is another module named `generate` on the suite's path
    spec = importlib.util.spec_from_file_location("bench_generate", repo / "bench" / "generate.py")
    bench_generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_generate)
    exit_bound = bench_generate.exit_bound

    assert exit_bound(1.0, 0.0, 4.0, 16, 0) == 4.0
    assert exit_bound(2.0, 2.0, 16.0, 16, 0) == (2.0 + 2.0 / 16) / 4.0
    assert exit_bound(1.0, 1.0, 6.0, 16, 2) == 16 / 7.0 * (1.0 + 1 / 16) / (1.0 + 1 / 3)
    run = subprocess.run([sys.executable, str(repo / "bench" / "generate.py"), "--batch", "4", "--new-tokens", "3",
                          "--num-steps", "4", "--exit-wait", "1", "--repeats", "1", "--profile", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(repo)})
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.splitlines()[-1])
    profile = report["profile"]
    bound = profile["bound"]
    assert bound["core_ms"] == profile["fixed"]["core_ms_by_rows"][str(4)]
    assert bound["finish_ms"] == profile["adaptive"]["finish_ms"] > 0
    assert bound["at_exit_wait"] == exit_bound(bound["core_ms"], bound["finish_ms"], report["mean_iterations"], 4, 1)
    assert bound["best"] == max(exit_bound(bound["core_ms"], bound["finish_ms"], report["mean_iterations"], 4, wait)
                                for wait in range(9))
