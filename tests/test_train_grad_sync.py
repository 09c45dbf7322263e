"""Every gradient exchange gives every rank the mean of the per-rank gradients (real gloo process groups).

Each rank builds the same toy recurrent model (a shared block applied k times under non-reentrant activation
checkpointing, like the core block, plus a parameter that never gets a gradient), computes its local gradient on
rank-dependent data, and exchanges it. Each rank can recompute every other rank's local gradient, so the expected
mean is computed locally and compared exactly (up to fp32 summation order).
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.checkpoint import checkpoint

from huginn_ray.train.grad_sync import ChunkStream, ChunkStreamOverlap, DDPSync, chunk_layout
from huginn_ray.train.warmup import WarmupError, register_node, warmup_allreduce


class ToyRecurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 5)
        self.core = nn.Linear(5, 5)
        self.core_norm = nn.Parameter(torch.ones(5))
        self.unused = nn.Parameter(torch.ones(4, 2))
        self.head = nn.Linear(5, 2)

    def step(self, h):
        return torch.tanh(self.core(h)) * self.core_norm

    def forward(self, x, k=3):
        h = self.embed(x)
        for _ in range(k):
            h = checkpoint(self.step, h, use_reentrant=False)
        return self.head(h).square().mean()


def toy_model():
    torch.manual_seed(0)
    return ToyRecurrent()


def rank_batch(rank: int, micro: int = 0):
    g = torch.Generator().manual_seed(100 * rank + micro)
    return torch.randn(4, 3, generator=g) * (rank + 1)


def local_grads(world_size: int, micro_batches: int):
    """Mean over ranks of each rank's gradient (summed over micro-batches), computed without communication."""
    per_rank = []
    for r in range(world_size):
        m = toy_model()
        for micro in range(micro_batches):
            m(rank_batch(r, micro)).backward()
        per_rank.append({n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in m.named_parameters()})
    return {n: torch.stack([g[n] for g in per_rank]).mean(0) for n in per_rank[0]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank, world_size, port, out_dir, fn, timeout_s):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    torch.set_num_threads(1)
    try:
        result = (globals()[fn] if isinstance(fn, str) else fn)(rank, world_size)
    except Exception as err:  # reported to the parent, which asserts on it
        result = {"error": type(err).__name__, "message": str(err), "trace": traceback.format_exc()}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    # no destroy_process_group: a test may leave a rank behind on purpose
    os._exit(0)


def spawn(fn, world_size, tmp_path, timeout_s=30):
    """Run `fn(rank, world_size)` in `world_size` fresh processes joined by a gloo group; their JSON reports.

    `fn`: the name of a function of this module, or a function of another test module (pickled by name)."""
    mp.start_processes(_run, args=(world_size, free_port(), str(tmp_path), fn, timeout_s),
                       nprocs=world_size, start_method="spawn", join=True)
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world_size)]


def exchange_all_kinds(rank, world_size):
    warmup_allreduce(torch.device("cpu"), mib=1, timeout_s=10)
    report = {}
    for micro_batches in (1, 2):
        expected = local_grads(world_size, micro_batches)
        for kind in ("chunk_stream", "chunk_stream_overlap", "ddp"):
            model = toy_model()
            if kind == "chunk_stream":
                sync = ChunkStream(model, chunk_numel=7)  # 7 elements: chunks span several parameters
            elif kind == "chunk_stream_overlap":
                sync = ChunkStreamOverlap(model, chunk_numel=7)
            else:
                sync = DDPSync(model, find_unused_parameters=True)
            for micro in range(micro_batches):
                with sync.micro_batch(last=micro == micro_batches - 1):
                    sync.module(rank_batch(rank, micro)).backward()
            sync.finish()
            worst = 0.0
            for name, p in model.named_parameters():
                got = p.grad if p.grad is not None else torch.full_like(p, float("nan"))
                worst = max(worst, (got - expected[name]).abs().max().item())
            report[f"{kind}/ga{micro_batches}"] = worst
    # the expected mean is not trivially equal to the local gradient
    local = toy_model()
    local(rank_batch(rank)).backward()
    report["local_vs_mean"] = (local.core.weight.grad - local_grads(world_size, 1)["core.weight"]).abs().max().item()
    # a second backward in the same step would put a partial gradient on the wire: refused
    sync = ChunkStreamOverlap(toy_model(), chunk_numel=1000)
    try:
        with sync.micro_batch(last=True):
            sync.module(rank_batch(rank)).backward()
            sync.module(rank_batch(rank)).backward()
        sync.finish()
        report["double_backward"] = "accepted"
    except RuntimeError as err:
        report["double_backward"] = str(err)
    return report


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_exchange_gives_the_mean_gradient(tmp_path, world_size):
    """After the warm-up all-reduce, which passes when every rank takes part."""
    results = spawn("exchange_all_kinds", world_size, tmp_path)
    for rank, report in enumerate(results):
        assert "error" not in report, report.get("trace")
        assert report.pop("local_vs_mean") > 1e-3
        assert "fired twice" in report.pop("double_backward")
        assert set(report) == {f"{k}/ga{g}" for k in ("chunk_stream", "chunk_stream_overlap", "ddp") for g in (1, 2)}
        for key, worst in report.items():
            assert worst < 1e-6, f"rank {rank} {key}: max deviation from the mean gradient {worst}"


def real_model(activation_checkpointing=True):
    from huginn_ray.model import ModelConfig, RecurrentGPT

    torch.manual_seed(0)
    # the block shapes of test_model_compile.py's model, so that the compiled variant below finds the blocks
    # that module compiled in inductor's on-disk cache instead of compiling them again
    return RecurrentGPT(ModelConfig.from_name("raven-tiny", vocab_size=64, n_embd=32, num_attention_heads=2,
                                              intermediate_size=64, block_size=64,
                                              activation_checkpointing=activation_checkpointing))


def real_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    ids = torch.randint(0, 64, (2, 17), generator=g)
    return ids[:, :-1], ids[:, 1:]


DEPTHS = [(0, 1), (3, 2), (1, 2)]  # the recurrence changes from step to step, as in training


def real_model_local_mean(world_size: int, step: int, n: int, k: int):
    grads = []
    for r in range(world_size):
        m = real_model()
        torch.manual_seed(step)  # the latent noise is the same on every rank
        m(*real_batch(r, step)[:1], labels=real_batch(r, step)[1], num_steps=(n, k)).loss.backward()
        grads.append({name: p.grad.clone() for name, p in m.named_parameters()})
    return {name: torch.stack([g[name] for g in grads]).mean(0) for name in grads[0]}


def exchange_real_model(rank, world_size, compiled=False):
    from huginn_ray.train.parallelize import compile_blocks
    from huginn_ray.train import parallel

    report = {}
    for kind in ("chunk_stream", "chunk_stream_overlap", "ddp", "hsdp"):
        model = real_model()
        if compiled:  # the expected mean stays eager: compiled blocks must give the same gradients
            compile_blocks(model)
        if kind == "chunk_stream":
            sync = ChunkStream(model, chunk_numel=10_000)
        elif kind == "chunk_stream_overlap":
            sync = ChunkStreamOverlap(model, chunk_numel=10_000)
        elif kind == "ddp":
            sync = DDPSync(model)
        else:  # shard groups of one rank: FSDP2's units and hooks, and the chunk stream between the groups
            mesh = parallel.build_mesh(parallel.MeshShape(True, world_size, 1), "cpu")
            parallel.apply_hsdp(model, mesh)
            sync = ChunkStream(model, chunk_numel=10_000, group=mesh.get_group("replicate"), divide_by=world_size)
        worst = 0.0
        for step, (n, k) in enumerate(DEPTHS):
            expected = real_model_local_mean(world_size, step, n, k)
            inputs, labels = real_batch(rank, step)
            with sync.micro_batch(last=True):
                torch.manual_seed(step)
                sync.module(inputs, labels=labels, num_steps=(n, k)).loss.backward()
            sync.finish()
            for name, p in model.named_parameters():
                grad = p.grad.full_tensor() if kind == "hsdp" else p.grad
                worst = max(worst, (grad - expected[name]).abs().max().item())
            model.zero_grad(set_to_none=True)  # no optimizer step: every step starts from the same weights
        report[kind] = worst
    return report


def exchange_real_model_compiled(rank, world_size):
    return exchange_real_model(rank, world_size, compiled=True)


@pytest.mark.parametrize("fn", ["exchange_real_model", "exchange_real_model_compiled"])
def test_every_exchange_on_the_recurrent_model_with_changing_depth(tmp_path, fn):
    """Eager, and with compile_blocks: the gradient hooks of every exchange fire on the compiled blocks' weights."""
    results = spawn(fn, 2, tmp_path, timeout_s=120)
    for rank, report in enumerate(results):
        assert "error" not in report, report.get("trace")
        assert sorted(report) == ["chunk_stream", "chunk_stream_overlap", "ddp", "hsdp"]
        for kind, worst in report.items():
            assert worst < 1e-6, f"rank {rank} {kind}: max deviation from the mean gradient {worst}"


OVERLAP_CHUNK = 2000
"""Elements per chunk of the hsdp overlap test: this rank's shards of raven-tiny (shard groups of 2) are 5216
elements per sandwich block (coda 5216, core 2 x 5216, prelude 5216) and 2064 in the root unit (the embedding
1024, the adapter 1024, the final norm 16): 22928 in all, 12 chunks."""


def unit_of(name: str) -> str:
    """The FSDP2 unit (huginn_ray.train.parallel.apply_hsdp) that holds parameter `name` of raven-tiny."""
    for unit in ("transformer.prelude.0", "transformer.core_block", "transformer.coda.0"):
        if name.startswith(unit + "."):
            return unit.removeprefix("transformer.")
    return "root"


def hsdp_overlap(rank, world_size):
    """2 x 2 hsdp, two micro-batches: the overlapped replicate-dimension stream launches its chunks from the
    hooks FSDP2 calls after each unit's reduce-scatter of the last micro-batch, and ends with the same bits as
    the stream after backward."""
    from huginn_ray.train import grad_sync, parallel

    mesh = parallel.build_mesh(parallel.MeshShape(True, world_size, 2), "cpu")
    n, k = DEPTHS[1]
    grads, events = {}, []
    for kind in ("chunk_stream", "chunk_stream_overlap"):
        model = real_model()
        parallel.apply_hsdp(model, mesh)
        sync = grad_sync.build_hsdp_grad_sync(kind, model, OVERLAP_CHUNK * 4 / 2**20, mesh.get_group("replicate"),
                                              world_size, max_chunks_in_flight=2)
        all_reduce = grad_sync.dist.all_reduce
        recording = kind == "chunk_stream_overlap"
        if recording:
            # the order of events: each unit's gradients final (a hook registered after the stream's, so it
            # fires right after it), each chunk's all-reduce launched, backward returned
            def launch(*args, **kwargs):
                events.append(("launch", args[0].numel()))
                return all_reduce(*args, **kwargs)

            grad_sync.dist.all_reduce = launch
            for name, p in model.named_parameters():
                p.register_post_accumulate_grad_hook(lambda _p, name=name: events.append(("final", unit_of(name))))
        try:
            for micro in range(2):
                with sync.micro_batch(last=micro == 1):
                    inputs, labels = real_batch(rank, micro)
                    torch.manual_seed(micro)
                    sync.module(inputs, labels=labels, num_steps=(n, k)).loss.backward()
                if recording:
                    events.append(("backward returned", micro))
            sync.finish()
            if recording:
                events.append(("finished", None))
        finally:
            grad_sync.dist.all_reduce = all_reduce
        grads[kind] = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    means = [real_model_local_mean(world_size, micro, n, k) for micro in range(2)]
    expected = {name: means[0][name] + means[1][name] for name in grads["chunk_stream"]}
    # the events, compressed: a unit's gradients final once per micro-batch (its last parameter), with the number
    # of chunks launched until then
    timeline, launched = [], 0
    for what, detail in events:
        launched += what == "launch"
        if what != "launch":
            entry = {"final": f"{detail} final", "finished": "finished"}.get(what, f"{what} {detail}")
            if timeline and what == "final" and timeline[-1][0] == entry:
                timeline.pop()
            timeline.append((entry, launched))
    return {
        "timeline": [f"{entry}, {count} launched" for entry, count in timeline],
        "chunk_sizes": sorted({detail for what, detail in events if what == "launch"}),
        "bitwise": all(torch.equal(grads["chunk_stream"][name], grads["chunk_stream_overlap"][name])
                       for name in expected),
        "worst": max((grads["chunk_stream_overlap"][name] - expected[name]).abs().max().item() for name in expected),
    }


def test_hsdp_overlap_launches_the_replicate_stream_during_the_last_backward_with_the_same_bits(tmp_path):
    """4 gloo ranks as 2 shard groups of 2. The first chunk goes out when the coda's reduce-scatter has written
    its shard's gradient, while the core, prelude and root units are still in backward; the root unit's
    gradients, final in FSDP2's end-of-backward callback, complete the last chunks. The first micro-batch's
    backward launches nothing."""
    results = spawn("hsdp_overlap", 4, tmp_path, timeout_s=120)
    for rank, report in enumerate(results):
        assert "error" not in report, report.get("trace")
        assert report["timeline"] == [
            "coda.0 final, 0 launched", "core_block final, 0 launched", "prelude.0 final, 0 launched",
            "root final, 0 launched", "backward returned 0, 0 launched",
            # 5216 // 2000, 3 x 5216 // 2000, 4 x 5216 // 2000, then all 12 (the last one zero-padded)
            "coda.0 final, 2 launched", "core_block final, 7 launched", "prelude.0 final, 10 launched",
            "root final, 12 launched", "backward returned 1, 12 launched", "finished, 12 launched",
        ], f"rank {rank}"
        assert report["chunk_sizes"] == [OVERLAP_CHUNK]  # every message of the stream is one whole chunk
        assert report["bitwise"], f"rank {rank}: the overlapped stream's gradients differ from chunk_stream's"
        assert report["worst"] < 1e-6, f"rank {rank}: max deviation from the mean gradient {report['worst']}"


def hsdp_clip(rank, world_size):
    """One shard group of two ranks: each holds half of every gradient; clipping must use the norm of the whole
    gradients, summed over the group in one all-reduce."""
    from huginn_ray.train import parallel

    model = real_model()
    mesh = parallel.build_mesh(parallel.MeshShape(True, world_size, world_size), "cpu")
    parallel.apply_hsdp(model, mesh)
    sync = ChunkStream(model, chunk_numel=10_000, group=mesh.get_group("replicate"), divide_by=world_size)
    n, k = DEPTHS[1]
    inputs, labels = real_batch(rank, 1)
    torch.manual_seed(1)
    model(inputs, labels=labels, num_steps=(n, k)).loss.backward()
    sync.finish()
    expected = real_model_local_mean(world_size, 1, n, k)
    expected_norm = torch.stack([g.norm(2) for g in expected.values()]).norm(2)
    params = list(model.parameters())
    calls = []
    all_reduce = parallel.dist.all_reduce
    parallel.dist.all_reduce = lambda *args, **kwargs: calls.append(1) or all_reduce(*args, **kwargs)
    try:
        norm = parallel.clip_grad_norm_(params, max_norm=1e-3)
    finally:
        parallel.dist.all_reduce = all_reduce
    scale = 1e-3 / (expected_norm + 1e-6)
    worst = max((p.grad.full_tensor() - expected[name] * scale).abs().max().item()
                for name, p in model.named_parameters())
    local_elements = sum(parallel.local(p.grad).numel() for p in params)
    return {"norm": norm.item(), "expected_norm": expected_norm.item(), "worst": worst, "collectives": len(calls),
            "local_elements": local_elements}


def test_hsdp_clipping_uses_the_norm_of_the_whole_gradients_in_one_all_reduce(tmp_path):
    results = spawn("hsdp_clip", 2, tmp_path)
    whole = sum(p.numel() for p in real_model().parameters())
    for report in results:
        assert "error" not in report, report.get("trace")
        assert report["norm"] == pytest.approx(report["expected_norm"], rel=1e-6)
        assert report["worst"] < 1e-9  # clipped to a norm of 1e-3: gradients of order 1e-4
        assert report["collectives"] == 1
        assert report["local_elements"] < whole  # each rank held a part


def test_post_accumulate_hook_fires_once_per_parameter_in_the_recurrent_model():
    model = real_model(activation_checkpointing=True)
    counts = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: counts.__setitem__(name, counts.get(name, 0) + 1))
    for n, k in DEPTHS + [(0, 5)]:  # the core block runs k times with gradients, each under a checkpoint
        counts.clear()
        inputs, labels = real_batch(0, 0)
        model(inputs, labels=labels, num_steps=(n, k)).loss.backward()
        assert counts == {name: 1 for name, _ in model.named_parameters()}, (n, k, counts)


def test_chunk_layout_spans_parameters_and_pads_last_chunk():
    chunks = chunk_layout([5, 3, 9], chunk_numel=4)
    assert sum(s.count for c in chunks for s in c) == 17
    assert len(chunks) == 5  # 4 full chunks and a last one with 1 valid element
    assert [(s.param_index, s.grad_offset, s.chunk_offset, s.count) for s in chunks[1]] == [(0, 4, 0, 1), (1, 0, 1, 3)]
    assert [(s.param_index, s.count) for s in chunks[-1]] == [(2, 1)]


def test_post_accumulate_hook_fires_once_per_parameter_per_backward_under_checkpointing():
    model = toy_model()
    counts = {name: 0 for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: counts.__setitem__(name, counts[name] + 1))
    for k in (1, 3, 7):  # the shared block is used k times, every use recomputed by the checkpoint in backward
        for name in counts:
            counts[name] = 0
        model(rank_batch(0), k=k).backward()
        assert counts == {**{n: 1 for n in counts}, "unused": 0}, f"k={k}: {counts}"


def warmup_with_missing_rank(rank, world_size):
    register_node()
    if rank == world_size - 1:
        time.sleep(5)  # this rank "hangs" while setting up, before the warm-up
        return {"slept": True}
    try:
        warmup_allreduce(torch.device("cpu"), mib=1, timeout_s=2)
    except WarmupError as err:
        time.sleep(1)  # rank 0 hosts the store: let rank 1 read it before rank 0 exits
        return {"error": "WarmupError", "message": str(err)}
    return {"message": "warm-up passed"}


def test_warmup_names_the_rank_and_node_that_did_not_answer(tmp_path):
    results = spawn("warmup_with_missing_rank", 3, tmp_path)
    host = socket.gethostname()
    for report in results[:2]:
        assert report.get("error") == "WarmupError", report
        assert f"rank 2 (node {host})" in report["message"]
        missing_part = report["message"].split(" did not answer")[0]
        assert "rank 0" not in missing_part and "rank 1" not in missing_part


def hung_collective(rank, world_size):
    if rank == 1:
        time.sleep(5)  # never joins the all-reduce
        return {"slept": True}
    try:
        dist.all_reduce(torch.ones(3))
    except Exception as err:  # gloo raises its own error type on timeout
        return {"error": type(err).__name__, "message": str(err)}
    return {"message": "all-reduce returned"}


def test_a_hung_collective_raises_at_the_process_group_timeout(tmp_path):
    results = spawn("hung_collective", 2, tmp_path, timeout_s=2)
    assert "error" in results[0], results[0]
    assert "timed out" in results[0]["message"].lower() or "timeout" in results[0]["message"].lower()
