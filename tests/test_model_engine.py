"""The continuous-depth-batching engine: each request gets what `generate` gives it alone at batch size 1,
with requests arriving while others run, within its capacities in rows and cache bytes."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from huginn_ray.generation import admission
from huginn_ray.generation import engine as engine_module
from huginn_ray.generation.counting import OpCounter
from huginn_ray.generation.decode_step import StepKind, decode_step
from huginn_ray.generation.engine import Engine, EngineConfig
from huginn_ray.generation.exits import DEFAULT_THRESHOLDS
from huginn_ray.generation.generate import generate
from huginn_ray.generation.requests import Request, pick
from huginn_ray.model import ModelConfig, RecurrentGPT
from huginn_ray.model.noise import TRUNC_NORMAL_UNIFORM

CRITERIA = [*DEFAULT_THRESHOLDS, None]
THRESHOLDS = {"entropy-diff": 1e-2, "latent-diff": 0.1, "kl": 5e-3, "minp-kl": 1e-3, "argmax-stability": 2,
              "cosine": 1e-2}
"""Thresholds at which this model's rows exit at different iterations (the defaults rarely exit it early)."""
CACHES = ["full", "latest", "ring:3"]
SAMPLING = [dict(), dict(temperature=0.8), dict(temperature=1.0, top_k=20), dict(temperature=0.9, top_p=0.8)]


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


def alone(model, request: Request):
    """`generate` at batch size 1 with the request's settings and its seeded generator."""
    result = generate(model, torch.tensor([request.prompt]), request.max_new_tokens, request.num_steps,
                      request.exit_criterion, request.exit_threshold, request.min_steps, request.check_every,
                      request.exit_in_prefill, request.cache, request.warm_start, request.temperature,
                      request.top_k, request.top_p, generator=torch.Generator().manual_seed(request.seed))
    return result.tokens[0, len(request.prompt):].tolist(), result.steps[0].tolist()


def drive(engine: Engine, arrivals: dict[int, list[Request]], watch=None) -> dict[int, tuple[list, list]]:
    """(tokens, core iterations) of every request, submitting arrivals[step] before engine step `step`, until
    idle; `watch(engine)` after every step."""
    outputs, step, ids = {}, 0, []
    while step <= max(arrivals) or engine.busy:
        ids += [engine.submit(request) for request in arrivals.get(step, [])]
        for event in engine.step():
            tokens, steps = outputs.setdefault(event.request_id, ([], []))
            tokens.append(event.token_id)
            steps.append(event.core_iterations)
        if watch is not None:
            watch(engine)
        step += 1
    return [outputs[request_id] for request_id in ids]


@pytest.mark.parametrize("exit_wait_steps,admit_rows", [(0, 1), (3, 2)])
def test_each_request_gets_its_batch_1_output_with_requests_arriving_while_others_run(model, exit_wait_steps,
                                                                                      admit_rows):
    wanted = requests(21)  # every criterion x cache strategy, every sampling mode, warm start or not
    engine = Engine(model, EngineConfig(max_rows=4, max_cache_bytes=10**9, exit_wait_steps=exit_wait_steps,
                                        admit_rows=admit_rows))
    seen = {"in_flight": 0, "mixed": 0, "mid_forward": 0}

    def watch(engine):
        slots, active = engine.slots, engine.slots.active
        seen["in_flight"] = max(seen["in_flight"], engine.rows_in_flight)
        positions, iterations = set(slots.position[active].tolist()), set(slots.iteration[active].tolist())
        seen["mixed"] += len(positions) > 1 and len(iterations) > 1
        seen["mid_forward"] += engine.loop_step in (3, 7, 12) and bool((slots.iteration[active] > 0).any())

    arrivals = {0: wanted[:6], 3: wanted[6:9], 7: wanted[9:10], 12: wanted[10:]}
    got = drive(engine, arrivals, watch)
    assert seen["in_flight"] == 4 and engine.rows_in_flight == 0 and engine.cache_bytes_reserved == 0
    assert seen["mixed"] > 10 and seen["mid_forward"] >= 2  # rows at different positions and iterations
    assert got == [alone(model, request) for request in wanted]
    steps = [s for _, iterations in got for s in iterations]
    assert min(steps) < 10 and max(steps) == 10  # exits happened, and full depth too


def test_the_compiled_step_gives_each_request_its_batch_1_output(model):
    """EngineConfig.compile: each kind of decode step runs as TorchDynamo's one graph, compiled by Inductor
    (fused loops in place of the eager ops), and each request still gets what `generate` gives it alone: a logit
    criterion (the coda and head inside the core step), top-p sampling, `latest` and `ring:3` caches, warm start,
    a request arriving mid-flight. The requests share their criterion, sampling modes and cache kinds, and every
    step finishes (exit_wait_steps 0), so that one kind is compiled: compiling costs tens of seconds a kind on a
    cold cache."""
    from torch._dynamo.utils import counters

    wanted = [Request((5, 6, 7, 8), 4, 8, "kl", 5e-3, cache="latest", temperature=1.0, top_p=0.9, seed=1),
              Request((9, 10), 4, 8, "kl", 1e-2, cache="ring:3", temperature=0.9, top_p=0.8, seed=2),
              Request((11, 12, 13), 3, 8, "kl", 5e-3, cache="latest", warm_start=True, temperature=0.7, top_p=0.8,
                      seed=3)]
    graphs = counters["stats"]["unique_graphs"]
    engine = Engine(model, EngineConfig(max_rows=3, max_cache_bytes=10**9, exit_wait_steps=0, compile=True))
    got = drive(engine, {0: wanted[:2], 2: wanted[2:]})
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert got == [alone(model, request) for request in wanted]
    steps = [s for _, iterations in got for s in iterations]
    assert min(steps) < 8 and max(steps) == 8  # exits happened, and full depth too


def test_every_forward_starts_its_criterion_from_the_starting_comparands(model):
    """After every step, a row at iteration 0 (a forward that has not run yet: just admitted, or its previous
    token just finished) holds its criterion's starting comparands, as batch-1 generation's fresh ExitCriterion:
    the initial state, ENTROPY_START, no argmax and a stability of 0, the uniform log-probabilities."""
    from huginn_ray.generation.exits import ENTROPY_START
    from huginn_ray.generation.slots import CRITERION_CODES

    codes = {code: name for name, code in CRITERION_CODES.items()}
    engine = Engine(model, EngineConfig(max_rows=4, max_cache_bytes=10**9, exit_wait_steps=0))
    checked = {name: 0 for name in CRITERION_CODES}
    V = engine.slots.previous_logp.shape[1]

    def watch(engine):
        slots = engine.slots
        for row in torch.nonzero(slots.active & (slots.iteration == 0)).flatten().tolist():
            name = codes.get(int(slots.criterion[row]))
            if name in ("latent-diff", "cosine"):
                assert torch.equal(slots.previous_state[row, 0], slots.state[row].float()), (name, row)
            elif name == "entropy-diff":
                assert slots.previous_entropy[row].item() == ENTROPY_START
            elif name == "argmax-stability":
                assert (slots.previous_argmax[row].item(), slots.stable[row].item()) == (-1, 0)
            elif name in ("kl", "minp-kl"):
                assert torch.equal(slots.previous_logp[row], torch.full((V,), -math.log(V)))
            if name is not None:
                checked[name] += 1

    drive(engine, {0: requests(14, min_steps=0)}, watch)
    assert min(checked.values()) >= 2, checked  # every criterion, at forwards after the first


def test_the_decode_step_reads_nothing_from_the_device(model):
    """Every decode step of a run with every criterion, cache and sampling mode, counted by OpCounter: ATen ops
    but no host read (the counter does count one: `.item()`, `.tolist()`, `nonzero`)."""
    engine = Engine(model, EngineConfig(max_rows=4, max_cache_bytes=10**9, exit_wait_steps=1))
    counter, run, steps = OpCounter(), engine.runner.run, []
    counter.counting = False

    def counted(kind):
        counter.counting = True
        run(kind)
        counter.counting = False
        steps.append(kind)

    engine.runner.run = counted
    with counter:
        drive(engine, {0: requests(8, seed=7)})
        assert counter.host_reads == 0 and counter.ops > 100 * len(steps) and len(steps) > 20
        assert {kind.finish for kind in steps} == {True, False} and any(kind.top_p for kind in steps)
        counter.counting = True
        torch.ones(3).sum().item(), torch.ones(2).tolist(), torch.ones(2).nonzero()
    assert counter.read_ops == ["_local_scalar_dense", "tolist", "nonzero"]


def test_outputs_depend_on_the_order_of_the_pre_drawn_random_numbers(model, monkeypatch):
    """Batch-1 generation draws a token's sample, then its next forward's noise: drawing them the other way
    round at admission changes sampled outputs (so the equality tests would catch a wrong order)."""
    sampled = [dataclasses.replace(request, temperature=1.0, top_k=None, top_p=None, warm_start=False)
               for request in requests(4, seed=13)]
    right = drive(Engine(model, EngineConfig(max_rows=4, max_cache_bytes=10**9)), {0: sampled})
    assert right == [alone(model, request) for request in sampled]

    def swapped(model, request, generator, dtype):  # noise first, then the sample's exponential
        later, cfg = request.max_new_tokens - 1, model.config
        uniform = torch.zeros(later, cfg.n_embd, dtype=dtype)
        exponential = torch.empty(later, cfg.vocab_size)
        for index in range(later):
            uniform[index : index + 1].uniform_(*TRUNC_NORMAL_UNIFORM, generator=generator)
            exponential[index : index + 1].exponential_(1, generator=generator)
        return admission.Draws(exponential, uniform)

    monkeypatch.setattr(engine_module, "draw_ahead", swapped)
    wrong = drive(Engine(model, EngineConfig(max_rows=4, max_cache_bytes=10**9)), {0: sampled})
    assert wrong != right


def test_the_decode_step_traces_as_one_graph(model):
    """TorchDynamo traces a finishing step with every criterion and sampling mode with no graph break (what
    torch.compile(fullgraph=True) and a CUDA graph capture need)."""
    engine = Engine(model, EngineConfig(max_rows=4, max_cache_bytes=10**9))
    for request in requests(6, seed=3):
        engine.submit(request)
    engine.step()
    kind = StepKind(columns=engine.kind().columns, finish=True, criteria=tuple(sorted(DEFAULT_THRESHOLDS)),
                    sampling=True, top_k=True, top_p=True)
    explained = torch._dynamo.explain(decode_step)(model, engine.slots, kind)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


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
    assert bool((engine.slots.iteration[engine.slots.active] > 0).any())
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
    assert [outputs[request_id] for request_id in ids] == [alone(model, request)[0] for request in wanted]

    # cancel frees the row at once: the waiting request takes it in the next step
    engine = Engine(model, EngineConfig(max_rows=1, max_cache_bytes=10**9))
    first, second = engine.submit(wanted[0]), engine.submit(wanted[1])
    engine.step()
    assert list(engine.in_flight) == [first] and engine.cancel(first) and engine.rows_in_flight == 0
    assert engine.cancel(first) is False
    engine.step()
    assert list(engine.in_flight) == [second]


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
    with pytest.raises(ValueError, match="cuda_graphs needs the model on a CUDA device, not cpu"):
        Engine(model, EngineConfig(max_rows=2, max_cache_bytes=1000, cuda_graphs=True))
    engine = Engine(model, EngineConfig(max_rows=2, max_cache_bytes=1000))
    assert not engine.runner.cuda_graphs  # off by default on the CPU
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


def test_the_generation_benchmark_reports_its_counters(tmp_path):
    """bench/generate.py --json: host reads per decode step, ATen ops per token of both engines, graph breaks,
    and which goals hold (the engines eager: the compiled step has its own test, compiling costs seconds a kind)."""
    repo = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, str(repo / "bench" / "generate.py"), "--batch", "4", "--new-tokens", "3",
                          "--num-steps", "4", "--exit-wait", "1", "--repeats", "1", "--no-compile", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(repo)})
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["host_syncs_per_step"] == 0 and report["graph_breaks"] == 0
    assert report["ops_per_token_adaptive"] > 0 and report["ops_per_token_fixed"] > 0
    assert report["tokens_equal_fraction"] == 1.0 and report["goals"]["host_syncs_per_step == 0"]
    assert report["engine_step"] == "eager" and report["compile_s"] == 0.0
