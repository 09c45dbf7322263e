"""The memory plan (huginn_ray.train.memory) against what a real CPU step allocates and saves, and its verdicts."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

import pytest
import torch

from huginn_ray.config import load_config
from huginn_ray.model import ModelConfig, RecurrentGPT
from huginn_ray.train import memory, observe, optim, parallel
from huginn_ray.train.config import TrainConfig, load_train_config
from huginn_ray.train.grad_sync import build_grad_sync
from huginn_ray.train.activation_memory import PeakLiveBytes, SavedBytes, saved_activation_bytes
from huginn_ray.train.memory import plan_memory
from huginn_ray.train.optim import build_optimizer

REPO = Path(__file__).resolve().parents[1]
FRONTIER = REPO / "configs/train/frontier_nebel_512_nodes.yaml"


def small_config(*extra):
    # reduced width: raven-small's layout at a width where the fixed memory is a few MiB; no module norms (their
    # copy of the parameters on log steps would be the peak of every plan here), but where a test asks for them
    return load_config(TrainConfig, None, [
        "max_steps=2", "block_size=64", "micro_batch_size=2", "model.name=raven-small",
        "model.overrides.n_embd=128", "model.overrides.num_attention_heads=4", "model.overrides.intermediate_size=384",
        "model.overrides.vocab_size=512", "scaling.num_workers=1", "grad_sync.chunk_mib=0.25",
        "observe.module_norms=false", *extra,
    ])


def parameter_bytes(model) -> int:
    """Bytes of the model's trainable parameters (fp32): what the module norms' copy of them takes."""
    return sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)


def model_config(cfg):
    return ModelConfig.from_name(cfg.model.name, activation_checkpointing=cfg.activation_checkpointing,
                                 **cfg.model.overrides.given())


def row(plan, item: str) -> int:
    """The bytes of the plan's row named `item`."""
    return {name: b for name, b, _ in plan.rows}[item]


def batch(cfg):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 512, (cfg.micro_batch_size, cfg.block_size), generator=g)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_activation_figure_equals_saved_bytes_of_a_real_cpu_step(checkpointing):
    cfg = small_config(f"activation_checkpointing={str(checkpointing).lower()}")
    mcfg = model_config(cfg)
    k = mcfg.mean_backprop_depth
    planned = row(plan_memory(cfg, mcfg), f"activations saved for backward (k={k})")

    torch.manual_seed(0)
    model = RecurrentGPT(mcfg).train()
    exclude = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    saved = SavedBytes(exclude)
    ids = batch(cfg)
    with saved.hooks():
        loss = model(ids, labels=ids, num_steps=(1, k), loss_chunk_tokens=cfg.loss_chunk_tokens).loss  # as the worker
    loss.backward()  # the graph the hooks saw is a working one
    assert saved.total == planned
    # and the meta measurement of one recomputed iteration equals the real one
    meta = saved_activation_bytes(model.to("meta"), ids.to("meta"), (1, k), loss_chunk_tokens=cfg.loss_chunk_tokens)
    assert meta["activations"] == planned


def test_the_plan_counts_the_largest_micro_batch_a_rank_gets(tmp_path):
    """A rank of a data order that gives it 2 rows with micro_batch_size 1 (huginn_ray.train.data_order) plans
    what a micro_batch_size of 2 plans; the CLI reads the shard count from data.data_dir's manifest."""
    from test_train_data import make_dataset

    one, two = small_config("micro_batch_size=1"), small_config("micro_batch_size=2")
    planned = plan_memory(one, model_config(one), micro_batch_rows=2)
    assert planned.header.split(", ")[2] == "micro-batch 2 x 64 tokens"
    assert [(phase.name, phase.transient_bytes) for phase in planned.phases] == [
        (phase.name, phase.transient_bytes) for phase in plan_memory(two, model_config(two)).phases]
    assert planned.rows == plan_memory(two, model_config(two)).rows
    assert planned.total > plan_memory(one, model_config(one)).total
    assert "more workers (on scaling.num_workers=1 a rank gets micro-batches of up to 2 rows" in planned.advice
    # 3 workers of 2 shards x 2 rows, micro_batch_size 1: ranks of 1, 1 and 2 rows
    data_dir, _ = make_dataset(tmp_path, num_shards=2, rows_per_shard=4, seq_len=64)
    three = small_config("micro_batch_size=1", "scaling.num_workers=3", "world_batch_size=4",
                         f"data.data_dir={data_dir}")
    assert memory.rank_micro_batches(three) == (2, False)  # one micro-batch a step (GA 1)
    # on 2 workers of that order a step runs 2 micro-batches of 1 row: an elastic [2, 3] run accumulates
    elastic = small_config("micro_batch_size=1", "scaling.num_workers=[2, 3]", "world_batch_size=4",
                           f"data.data_dir={data_dir}")
    assert memory.rank_micro_batches(elastic) == (2, True)
    assert memory.rank_micro_batches(small_config("micro_batch_size=1")) == (None, True)  # no data dir: m


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_chunked_loss_backward_figure_equals_a_real_cpu_step(precision):
    # 128 tokens in chunks of 48: the last one partial. Under bf16 the backward recomputes in bf16 (the
    # forward's dtype, recorded: autocast is off in backward), so it also holds a bf16 copy of the weight.
    cfg = small_config(f"precision={precision}", "loss_chunk_tokens=48")
    mcfg = model_config(cfg)
    loss_backward = next(p for p in plan_memory(cfg, mcfg).phases if p.name == "loss backward")
    assert loss_backward.transient == "chunked loss backward, chunk 48"
    planned = loss_backward.transient_bytes

    torch.manual_seed(0)
    model = RecurrentGPT(mcfg).train()
    ids = batch(cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss = model(ids, labels=ids, num_steps=(1, mcfg.mean_backprop_depth),
                     loss_chunk_tokens=cfg.loss_chunk_tokens).loss
    peak_after_loss_node = []
    with PeakLiveBytes() as peak:  # what backward allocates from its start until the loss's node is done
        loss.grad_fn.register_hook(lambda *_: peak_after_loss_node.append(peak.peak))
        loss.backward()
    assert peak_after_loss_node == [planned]
    weight, hidden, chunk_logits, chunk_hidden = 512 * 128, 128 * 128, 48 * 512, 48 * 128  # elements
    small = 1028  # the label mask, the per-row scale, one chunk's targets, scalars
    if precision == "fp32":  # head gradient (fp32 accumulator) + hidden's gradient + a chunk's logits + its dh
        assert planned == weight * 4 + hidden * 4 + chunk_logits * 4 + chunk_hidden * 4 + small
    else:  # + the weight in bf16 and the bf16 product (weight-sized) added into the fp32 accumulator
        assert planned == weight * (2 + 4 + 2) + hidden * 4 + chunk_logits * 2 + chunk_hidden * 2 + small


def test_weight_cast_figure_equals_what_cpu_autocast_caches():
    """The bf16 weight casts the meta emulation counts at the end of the forward are what a real CPU forward's
    autocast cache frees on exit, plus the chunked loss's own bf16 copy of the head weight (alive during the
    loss's forward, freed when it returns)."""
    cfg = small_config("precision=bf16-mixed", "loss_chunk_tokens=48")
    mcfg = model_config(cfg)
    k = mcfg.mean_backprop_depth
    torch.manual_seed(0)
    model = RecurrentGPT(mcfg).train()
    ids = batch(cfg)

    def alive(mode: PeakLiveBytes) -> int:
        return sum(size for ref, size in mode.live.values() if not ref.expired())

    with PeakLiveBytes() as created:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(ids, labels=ids, num_steps=(1, k), loss_chunk_tokens=cfg.loss_chunk_tokens)
            inside = alive(created)
        cache = inside - alive(created)
    planned = saved_activation_bytes(model.to("meta"), ids.to("meta"), (1, k), bf16=True,
                                     loss_chunk_tokens=cfg.loss_chunk_tokens)["weight_casts"]
    head = 512 * 128 * 2
    assert (cache, planned) == (3_407_872, 3_407_872 + head)


def live_tensor_bytes(extra) -> int:
    """Distinct storages of every live CPU tensor the garbage collector knows of, plus `extra` (gradients live
    in autograd's C++ structures without a Python object)."""
    storages = {}
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op object warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    tensors += [t for t in extra if t is not None]
    for t in tensors:
        if t.device.type == "cpu" and not t.is_meta:
            s = t.untyped_storage()
            storages[s._cdata] = s.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("kind", ["chunk_stream", "chunk_stream_overlap"])
def test_planned_fixed_memory_matches_what_a_cpu_step_allocates(single_rank_group, kind):
    cfg = small_config(f"grad_sync.kind={kind}", "grad_sync.max_chunks_in_flight=2")
    mcfg = model_config(cfg)
    plan = plan_memory(cfg, mcfg)
    fixed = sum(b for name, b, _ in plan.rows if not name.startswith("activations"))

    gc.collect()
    before = live_tensor_bytes([])
    torch.manual_seed(0)
    model = RecurrentGPT(mcfg).train()
    sync = build_grad_sync(kind, model, cfg.grad_sync.chunk_mib, max_chunks_in_flight=2)
    optimizer = build_optimizer(model, cfg.optim)
    ids = batch(cfg)
    for _ in range(2):  # the second step holds optimizer state and gradients at once
        optimizer.zero_grad(set_to_none=True)
        with sync.micro_batch(last=True):
            sync.module(ids, labels=ids, num_steps=(1, mcfg.mean_backprop_depth)).loss.backward()
        sync.finish()
        optimizer.step()
    gc.collect()
    allocated = live_tensor_bytes([p.grad for p in model.parameters()]) - before
    assert abs(allocated - fixed) <= 0.10 * allocated, (allocated, fixed, plan.render())
    if kind == "chunk_stream_overlap":  # bounded buffers, not a second copy of the gradients
        assert row(plan, "exchange buffers (chunk_stream_overlap)") == 2 * 256 * 1024
    if hasattr(sync, "remove_hooks"):
        sync.remove_hooks()


@pytest.mark.parametrize("log_step", [False, True])
def test_the_plan_holds_a_whole_cpu_train_step_and_its_optimizer_step_to_the_byte(single_rank_group, monkeypatch,
                                                                                     log_step):
    """Two replicated train steps as the loop runs them (bf16 autocast, the gradient exchange, clipping,
    ELLISAdam's eager step; a log step's module norms), with the live bytes of every storage: what exists before
    the step (parameters, buffers, optimizer state, exchange buffer) plus the peak of what it creates
    (PeakLiveBytes). Norm chunks of 2^16 elements, so that the largest tensors take several."""
    monkeypatch.setattr(observe, "NORM_CHUNK", 2**16)
    cfg = small_config("precision=bf16-mixed", "grad_sync.kind=chunk_stream",
                       f"observe.module_norms={str(log_step).lower()}")
    mcfg = model_config(cfg)
    plan = plan_memory(cfg, mcfg, accumulates=False)  # one micro-batch a step, as below
    optimizer_step = plan.phases[-1]
    assert optimizer_step.name == "optimizer step"

    gc.collect()
    before = live_tensor_bytes([])
    torch.manual_seed(0)
    model = RecurrentGPT(mcfg).train()
    sync = build_grad_sync(cfg.grad_sync.kind, model, cfg.grad_sync.chunk_mib)
    optimizer = build_optimizer(model, cfg.optim)
    norms = observe.ModuleNorms(model, 1) if log_step else None
    fixed = live_tensor_bytes([]) - before
    ids = batch(cfg)
    for _ in range(2):
        with PeakLiveBytes() as forward_backward:
            with sync.micro_batch(last=True):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = sync.module(ids, labels=ids, num_steps=(1, mcfg.mean_backprop_depth),
                                      loss_chunk_tokens=cfg.loss_chunk_tokens)
                out.loss.backward()
                del out
            sync.finish()
            grad_squares = norms.grads() if log_step else None
            parallel.clip_grad_norm_(list(model.parameters()), cfg.grad_clip)
        gradients = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
        with PeakLiveBytes() as step:
            if log_step:
                norms.snapshot()
            optimizer.step()
            if log_step:
                update_squares = norms.updates()
        optimizer.zero_grad(set_to_none=True)
        # the optimizer step's scratch (on a log step with the norms' copies of the parameters, and their updates
        # made one by one) is the plan's to the byte, and so is everything alive during it
        assert step.peak == optimizer_step.transient_bytes
        assert fixed + gradients + step.peak == plan.phase_total(optimizer_step)
        # the largest tensor (the update written over its denominator), the sums of 75 tensors and 3 scalars of
        # the clip (a log step peaks in the norms' copies and their updates instead)
        if not log_step:
            assert step.peak == max(p.numel() for p in model.parameters()) * 4 + (75 + 3) * 4
        if log_step:  # squares of the gradients before clipping, and of the step's updates
            assert grad_squares.sum() > 0 and update_squares.sum() > 0
        assert plan.total >= fixed + max(forward_backward.peak, gradients + step.peak), plan.render()
        # the backward's peak, planned with the gradients as backward allocates them, is within 3 % of the real
        # one (every activation counts to the end of backward); counting every gradient from the forward on,
        # as for a step that accumulates, overshoots it by 15 %
        core_backward = next(phase for phase in plan.phases if phase.name == "core backward")
        assert plan.peak is (optimizer_step if log_step else core_backward)  # a log step peaks in its norms
        planned = plan.phase_total(core_backward)
        assert fixed + forward_backward.peak <= planned <= 1.03 * (fixed + forward_backward.peak)
        accumulating = plan_memory(cfg, mcfg)
        forward_and_backward = max(accumulating.phase_total(phase) for phase in accumulating.phases[:-1])
        assert forward_and_backward > 1.14 * (fixed + forward_backward.peak)


def test_a_step_of_one_micro_batch_plans_its_gradients_from_its_backward_on():
    """Replicated, one micro-batch a step: no gradient during the forward, the head's (the tied embedding's) in
    the chunked loss's backward transient, all but the prelude blocks' in the core's backward, all at the
    optimizer step; DDP's buckets hold them for the whole run either way."""
    cfg = small_config("grad_sync.kind=chunk_stream")
    mcfg = model_config(cfg)
    accumulating, one = plan_memory(cfg, mcfg), plan_memory(cfg, mcfg, accumulates=False)
    with torch.device("meta"):
        model = RecurrentGPT(mcfg)
    prelude = 4 * sum(p.numel() for block in model.transformer.prelude for p in block.parameters())
    every = 4 * sum(p.numel() for p in model.parameters())
    assert row(accumulating, "gradients (fp32)") == every
    assert (row(one, "gradients (fp32)"), row(one, "gradients of the prelude blocks (fp32)")) == (
        every - prelude, prelude)
    missing = {"initial state draw": every, "end of forward": every, "loss backward": every,
               "core backward": prelude, "optimizer step": 0}
    assert [(phase.name, accumulating.phase_total(phase) - one.phase_total(alone))
            for phase, alone in zip(accumulating.phases, one.phases)] == [(name, missing[name]) for name in (
                "initial state draw", "end of forward", "loss backward", "core backward", "optimizer step")]
    ddp = small_config("grad_sync.kind=ddp")
    assert plan_memory(ddp, mcfg, accumulates=False).total == plan_memory(ddp, mcfg).total


@pytest.mark.parametrize("options", [["optim.update_clipping=false"],
                                     ["optim.update_clipping=false", "optim.atan_adam=false"], ["optim.name=AdamW"]])
def test_the_optimizer_step_phase_is_what_the_step_allocates(options):
    """The optimizer-step phase of the other optimizers and options (update clipping: the test above) against
    what each of two steps allocates on CPU."""
    cfg = small_config(*options)
    planned = plan_memory(cfg, model_config(cfg)).phases[-1]
    torch.manual_seed(0)
    model = RecurrentGPT(model_config(cfg)).train()
    optimizer = build_optimizer(model, cfg.optim)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        with PeakLiveBytes() as step:
            optimizer.step()
        assert (planned.name, step.peak) == ("optimizer step", planned.transient_bytes)


def test_frontier_plan_under_hsdp_and_why_replicate_does_not_fit(capsys):
    plan = plan_memory(load_train_config(FRONTIER, ["parallelism.param_dtype=float32"]))  # every gather in fp32
    head = 65536 * 5280  # padded vocab x n_embd: the tied head weight
    # activations and transients are the meta measurements of the replicated plan: hsdp does not change them;
    # every block checkpointed keeps each block's input (3.4 GiB; 12.1 with only the core's blocks checkpointed)
    assert row(plan, "activations saved for backward (k=8)") == 3_645_884_416
    phases = {phase.name: phase for phase in plan.phases}
    # per-block checkpointing in the core: backward recomputes the adapter and one block at a time
    assert phases["core backward"].transient_bytes == 2_528_505_880
    assert phases["loss backward"].transient_bytes == 2_999_808_004
    # this rank's eighth of every tensor (dim 0 padded to a multiple of 8), and what FSDP2 gathers whole
    local = 445_653_780
    assert row(plan, "gradients (fp32, sharded)") == local * 4
    # 75 tensors: 8 blocks x 9 + 3
    assert row(plan, "optimizer state (ELLISAdam: 2 fp32 moments)") == local * 8 + 75 * 8
    block = 395_398_080  # elements of one nebel sandwich block (the core is 4 of them)
    assert row(plan, memory.CORE_W) == row(plan, memory.CORE_G) == 4 * 4 * block
    assert phases["core reduce-scatter"].transient_bytes == 4 * 4 * block
    assert row(plan, memory.ROOT_W) == row(plan, memory.ROOT_G) == 4 * (head + 2 * 5280 * 5280 + 5280)
    # the peak is the core's backward: every row alive (the core's weights and gradients both gathered) plus one
    # block's recomputation; at the reduce-scatter the core's weights are already resharded
    rows = sum(b for _, b, _ in plan.rows)
    assert plan.peak.name == "core backward" and plan.total == rows + 2_528_505_880 == 31_023_527_856
    # the reduce-scatter input (fp32, core-sized) takes the place of the resharded core weights
    assert plan.phase_total(phases["core reduce-scatter"]) == rows
    assert plan.phase_total(phases["end of forward"]) == (rows - row(plan, memory.ROOT_G) - 4 * 4 * block
                                                           - row(plan, memory.PREFETCH) + 7_420_600_324)
    # chunk_stream_overlap between nodes: 4 chunks of 64 MiB in flight
    assert row(plan, "exchange buffers (chunk_stream_overlap)") == 4 * 64 * 2**20
    assert plan.fits
    assert plan.render().splitlines()[-1] == "total per rank: 28.9 GiB of 64.0 GiB device memory"
    assert [line.split()[2] for line in plan.render().splitlines() if "not counted:" in line] == [
        "CUDA/HIP", "communicator", "allocator"]
    # all-gathered per micro-batch, padded as FSDP2 pads dim 0 (qk_bias's dim 0 of 2 to 8): the core's 4 blocks
    # once, the 2 prelude and 2 coda blocks twice, the root once
    assert plan.gathered == {"float32": 4 * (12 * 395_429_760 + 401_792_160)}

    # the default on GPUs: the blocks' matmul weights gathered in bf16, their norms and qk_bias whole in fp32
    bf16 = plan_memory(load_train_config(FRONTIER, []))
    whole = 8 * 6 * 5280  # 8 blocks: 4 norm weights and qk_bias (2 x 55 heads x 96) each, instead of their shards
    assert row(bf16, "parameters (fp32, sharded) + buffers") == row(
        plan, "parameters (fp32, sharded) + buffers") + 4 * (whole - 8 * (4 * 660 + 5280))
    assert row(bf16, memory.CORE_W) == row(bf16, memory.CORE_G) == 2 * 4 * (block - 6 * 5280)
    assert row(bf16, memory.PREFETCH) == 2 * (block - 6 * 5280)
    assert row(bf16, memory.ROOT_W) == row(plan, memory.ROOT_W)  # the root unit stays fp32
    assert bf16.gathered == {"bfloat16": 2 * 12 * 395_366_400, "float32": 4 * 401_792_160}
    assert sum(bf16.gathered.values()) / sum(plan.gathered.values()) == pytest.approx(0.539, abs=1e-3)
    bf16_phases = {phase.name: phase for phase in bf16.phases}
    assert bf16_phases["core reduce-scatter"].transient_bytes == 4 * 4 * (block - 6 * 5280)  # reduced in fp32
    assert bf16_phases["end of forward"].transient_bytes < phases["end of forward"].transient_bytes - 5 * memory.GIB
    assert bf16.peak.name == "core reduce-scatter" and bf16.total == 24_544_272_536
    assert bf16.render().splitlines()[-1] == "total per rank: 22.9 GiB of 64.0 GiB device memory"
    assert "all-gathered per micro-batch: bfloat16 8.84 GiB, float32 1.50 GiB" in bf16.render()

    assert memory.main(["--config", str(FRONTIER), "parallelism.mode=replicate",
                        "grad_sync.kind=chunk_stream_overlap"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert float(out[-1].split("total per rank: ")[1].split(" GiB")[0]) > 0.9 * 64
    assert any("parallelism.mode=hsdp" in line for line in out)


def test_train_job_refuses_a_plan_above_the_device_memory(tmp_path, capsys, monkeypatch):
    import ray
    from test_train_preflight import TINY, make_dataset, train_main

    data_dir, tokenizer = make_dataset(tmp_path / "data", num_shards=2, rows_per_shard=40, seq_len=32)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    code = train_main()(["--config", str(TINY), f"out_dir={tmp_path}", f"data.data_dir={data_dir}",
                         f"data.tokenizer_path={tokenizer}", "block_size=32", "model.overrides.vocab_size=64",
                         "device_memory_gib=0.001"])
    err = capsys.readouterr().err
    assert code == 2
    assert "memory plan:" in err and "exceeds device_memory_gib x memory_headroom" in err
    assert "largest items: " in err and "what would help: parallelism.mode=hsdp" in err
    assert "block_size=32 needs 0.0 GiB per rank, no block_size of 32 tokens or more fits" in err


def test_hsdp_plan_holds_the_peak_of_a_real_fsdp2_step(single_rank_group):
    """A real FSDP2 forward+backward (one rank: FSDP2 still all-gathers into whole tensors and reduce-scatters out
    of them) against the plan by phase. Counted: the peak of the storages the step creates, i.e. the plan minus
    the parameters and the optimizer state that exist before it (the first step creates the sharded gradients)."""
    cfg = small_config("parallelism.mode=hsdp")
    mcfg = model_config(cfg)
    plan = plan_memory(cfg, mcfg)
    torch.manual_seed(0)
    model = RecurrentGPT(mcfg).train()
    parallel.apply_hsdp(model, parallel.build_mesh(parallel.mesh_shape(True, 1, 1), "cpu"))
    ids = batch(cfg)
    with PeakLiveBytes() as step:
        model(ids, labels=ids, num_steps=(1, mcfg.mean_backprop_depth),
              loss_chunk_tokens=cfg.loss_chunk_tokens).loss.backward()
    planned = (plan.total - row(plan, "parameters (fp32, sharded) + buffers")
               - row(plan, "optimizer state (ELLISAdam: 2 fp32 moments)"))
    assert plan.peak.name == "core backward"
    # the core's gathered weights and gradients are 2 x 17 % of it: a plan without either misses by more
    assert abs(step.peak - planned) <= 0.05 * planned, (step.peak, planned, plan.render())


def test_the_norms_square_sum_in_chunks_is_the_whole_tensor_s(monkeypatch):
    """observe.square_sum over chunks of NORM_CHUNK elements (45 elements in chunks of 7: six whole, one of 3)."""
    monkeypatch.setattr(observe, "NORM_CHUNK", 7)
    tensor = torch.randn(5, 9, generator=torch.Generator().manual_seed(0))
    assert observe.square_sum(tensor).item() == pytest.approx(tensor.double().square().sum().item(), rel=1e-12)
    assert observe.square_sum(tensor[:, :2]).item() == pytest.approx(tensor[:, :2].double().square().sum().item(),
                                                                     rel=1e-12)  # not contiguous


FRONTIER_131K = REPO / "configs/train/frontier_nebel_131k.yaml"


def test_context_parallel_plans_local_tokens_and_the_gathered_kv(capsys):
    """Huginn at 131,072 tokens, context_parallel 8: the activations of this rank's 16,384 tokens (those of the
    same run at block_size 16,384 without the split), and in the core's backward one attention call's gathered
    K and V (bf16) and their fp32 gradient: 2 x 131,072 x 5,280 elements each; under 0.9 x 64 GiB."""
    cp = plan_memory(load_train_config(FRONTIER_131K, []))
    local = plan_memory(load_train_config(FRONTIER_131K, ["block_size=16384", "parallelism.context_parallel=1"]))
    assert row(cp, "activations saved for backward (k=8)") == row(local, "activations saved for backward (k=8)") \
        == 14_416_267_264
    assert row(cp, memory.GATHERED_KV) == 0  # every block checkpointed: the recomputation gathers them again
    kv = 2 * 131_072 * 5280
    core_backward = [phase.transient_bytes for phase in cp.phases if phase.name == "core backward"]
    assert core_backward == [6_616_551_448 + kv * 2 + kv * 4] == [14_921_273_368]
    # before the forward: the rows' keyed initial state (16,384 local tokens) and one row's whole noise, fp32
    draw = [phase.transient_bytes for phase in cp.phases if phase.name == "initial state draw"]
    assert draw == [(16_384 + 131_072) * 5280 * 4] == [3_114_270_720]
    # the rest does not depend on the split
    assert [r[:2] for r in cp.rows if r[0] != memory.GATHERED_KV] == [r[:2] for r in local.rows]
    assert (cp.peak.name, cp.total, cp.fits) == ("core backward", 47_121_756_336, True)
    assert memory.main(["--config", str(FRONTIER_131K)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "total per rank: 43.9 GiB of 64.0 GiB device memory"
    assert "split over context_parallel=8 ranks (16384 each)" in out[0]


def test_context_parallel_without_checkpointing_keeps_every_calls_gathered_kv():
    """Without activation checkpointing every attention call with gradient (2 prelude + k=4 x 4 core + 2 coda
    blocks) saves its gathered K/V (fp32 on CPU: 2 x rows 2 x 64 tokens x D 128 x 4 bytes); the core's backward
    holds their fp32 gradient for one call. A block_size the split does not divide is refused by name."""
    plan = plan_memory(small_config("parallelism.context_parallel=2", "activation_checkpointing=false"))
    kv = 2 * 2 * 64 * 128 * 4
    assert row(plan, memory.GATHERED_KV) == (2 + 4 * 4 + 2) * kv == 2_621_440
    whole = plan_memory(small_config("block_size=32", "activation_checkpointing=false"))
    assert [phase.transient_bytes for phase in plan.phases if phase.name == "core backward"] == [kv]
    assert row(plan, "activations saved for backward (k=4)") == row(whole, "activations saved for backward (k=4)")
    with pytest.raises(ValueError, match=r"parallelism.context_parallel=3 must be positive and divide block_size=64"):
        plan_memory(small_config("parallelism.context_parallel=3"))


def test_a_sequence_that_does_not_fit_is_refused_naming_the_longest_block_that_fits():
    """The Frontier configuration at 131,072 tokens without context parallelism: refused before launch with the
    memory it needs and the longest block_size (in steps of 1,024) whose plan fits 0.9 x 64 GiB (the search
    plans 33,792 and 34,816 tokens: the first fits, the second does not)."""
    from huginn_ray.model import ModelConfig
    from huginn_ray.train.launch import PreflightError, check_memory

    cfg = load_train_config(FRONTIER, ["block_size=131072", "model.overrides.block_size=131072"])
    with pytest.raises(PreflightError, match=r"memory plan: 172\.2 GiB per rank exceeds .* what would help: "
                                             r"parallelism.context_parallel up to 8 .*; block_size=131072 needs "
                                             r"172\.2 GiB per rank, the longest block_size that fits is 33792 "
                                             r"\(context_parallel=1\) \(the whole plan"):
        check_memory(cfg, ModelConfig.from_name("nebel-raven-3.5b", block_size=131072), 1)
