"""First contact with a GPU: the GPU path of training checked end to end, in one run of a few minutes.

    make gpu-check                                    # the device present (cuda if torch sees one), JSON in out/
    python bench/gpu_check.py --device cpu --quick    # tiny shapes in seconds: tests/test_gpu_check.py runs this

On the device present it measures and prints, as a table, and writes as JSON (--out):
1. peak: the best bf16 matmul FLOP/s (fp32 on CPU) and a device-to-device copy's bandwidth (bytes read + written);
2. model step: forward+backward under bf16 autocast (fp32 on CPU), eager and compiled blocks, at the anchor,
   raven-small, raven-medium and a nebel-width model (nebel's D = 5280, 55 heads of 96, I = 17920, V = 65536)
   cut to fit the device: tokens/s, MFU against (1), and the attention kernel chosen at the training shape;
3. memory: the training memory plan (huginn_ray.train.memory) of that nebel-width configuration, item by item,
   against torch.cuda.memory_allocated / max_memory_allocated measured on the device (CPU: the plan only);
4. training: the project's own build_components/train_step on one device, with a world-size-1 process group
   (NCCL on GPUs, gloo on CPU) and no Ray: the loss falls, the host reads a device tensor once per step, a
   checkpoint saved mid-run resumes to the same losses;
5. generation at batch 1: tokens/s of an adaptive exit (kl) against the fixed depth, on the trained model;
6. engine: continuous depth batching (huginn_ray.generation.engine) at batch 32 on the trained model, fixed depth
   against latent-diff exits, each with the eager and the compiled step (EngineConfig.compile), replayed as CUDA
   graphs on a GPU: tokens/s, iterations per token, outputs equal to batch-1 generation;
   decode calls: one core iteration at decoding's shape (1 and 32 rows of one token): its ATen operations, ms
   per call eager, and ms per replay of it captured in a CUDA graph (how much of decoding is launch overhead);
7. optimizer: AdamW's fused kernel (what the training takes on GPUs) against its multi-tensor step over the
   parameters of a nebel-width model of 1/1/1 layers: seconds per step, and the largest difference of the
   weights after the same steps from the same gradients (within ADAMW_TOLERANCE, else the row fails); and
   ELLISAdam, the training's default, eager and compiled (`optim.compile_step`, not with --quick) against its
   reference formula (bench/ellis_reference.py), weights within ADAMW_TOLERANCE.
8. bf16 gathers: hsdp on the one device (a shard group of one: FSDP2 still gathers, casts and reduce-scatters)
   with the blocks' matmul weights gathered in fp32, then in bf16 (`parallelism.param_dtype`), under bf16
   autocast: seconds per forward+backward, bytes all-gathered per step by dtype (bf16 at most 0.6 x fp32's), the
   loss (within 5e-3 relative), and the gathered core block's norm weights and qk_bias still fp32.

What the GPU machine needs: torch and what this package's training modules import at import time (numpy,
pyarrow, safetensors, pyyaml); not Ray, not MLflow (huginn_ray.train.loop imports them inside the functions that
run under Ray Train). The lent H100/H200 image holds all four, so no wheel has to be carried there; on a machine
without them, carry those four wheels. Run it from the repository root (the script puts the root on sys.path).
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import socket
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch._dynamo
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ellis_reference import ReferenceState, reference_step  # noqa: E402
from model_step import CUSTOM, matmul_flops_per_second, step_seconds, synchronize  # noqa: E402

from huginn_ray.cluster.devices import distributed_backend  # noqa: E402
from huginn_ray.config import from_dict  # noqa: E402
from huginn_ray.data.shards import shard_path  # noqa: E402
from huginn_ray.generation.engine import Engine, EngineConfig, TokenEvent  # noqa: E402
from huginn_ray.generation.exits import DEFAULT_THRESHOLDS  # noqa: E402
from huginn_ray.generation.generate import generate  # noqa: E402
from huginn_ray.generation.requests import Request  # noqa: E402
from huginn_ray.model import ModelConfig, RecurrentGPT, training_flops_per_token  # noqa: E402
from huginn_ray.model.attention import (AttentionBackendError, AttentionShape, choose_attention_backend,  # noqa: E402
                                         probe_attention_backends, restrict_attention)
from huginn_ray.train import checkpoint as ckpt  # noqa: E402
from huginn_ray.train import loop, parallel  # noqa: E402
from huginn_ray.train.config import TrainConfig  # noqa: E402
from huginn_ray.train.memory import GIB, plan_memory  # noqa: E402
from huginn_ray.train.observe import ModuleNorms  # noqa: E402
from huginn_ray.train.optim import adamw_fused, build_optimizer, param_groups  # noqa: E402
from huginn_ray.train.parallelize import compile_blocks  # noqa: E402
from huginn_ray.train.run_plan import RunPlan  # noqa: E402

NEBEL_WIDTH = dict(n_embd=5280, num_attention_heads=55, intermediate_size=17920, vocab_size=65536,
                   padding_multiple=4096, mean_recurrence=8, mean_backprop_depth=4, activation_checkpointing=True)
NEBEL_CUTS = [(2, 4, 2, 4096), (1, 2, 1, 4096), (1, 1, 1, 4096), (1, 1, 1, 2048), (1, 1, 1, 1024)]
"""(prelude, core, coda layers, seq_len), tried in order: the first whose training memory plan fits in
FIT_FRACTION of the device is the nebel-width model."""
FIT_FRACTION = 0.6
TINY = dict(n_embd=64, num_attention_heads=4, intermediate_size=128, vocab_size=256, padding_multiple=64,
            block_size=64, n_layers_in_prelude=1, n_layers_in_recurrent_block=1, n_layers_in_coda=1,
            mean_recurrence=4, mean_backprop_depth=2)
"""--quick: every shape at this size (seq_len 32), the nebel-width one through the same cut."""


@dataclass
class Setup:
    device: torch.device
    quick: bool
    steps: int
    """Timed fwd+bwd steps per variant."""
    train_steps: int
    save_at: int
    new_tokens: int
    depth: int
    """Generation depth (the adaptive exit's maximum)."""

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def compile(self, model: RecurrentGPT) -> RecurrentGPT:
        # --quick: dynamo traces the blocks (the path a GPU compiles) without inductor's code generation
        return compile_blocks(model, backend="eager") if self.quick else compile_blocks(model, dynamic=False)


def model_config(name: str, setup: Setup, **overrides) -> ModelConfig:
    if setup.quick:
        return ModelConfig(name=name, **{**TINY, **overrides})
    if name in CUSTOM:
        return ModelConfig(name=name, **{**CUSTOM[name], **overrides})
    if name == "nebel-width":
        return ModelConfig(name=name, **{**NEBEL_WIDTH, **overrides})
    return ModelConfig.from_name(name, **overrides)


# ---------------------------------------------------------------------------------------------------------
# 1. peak
# ---------------------------------------------------------------------------------------------------------
def measure_peak(setup: Setup) -> dict:
    dtype = torch.bfloat16 if setup.on_gpu else torch.float32
    shapes = [(8192, 8192, 8192), (4096, 4096, 4096)] if setup.on_gpu else [(256, 256, 256)]
    flops, shape = matmul_flops_per_second(setup.device, dtype, shapes, repeats=10 if setup.on_gpu else 3)
    copy_bytes = 2**30 if setup.on_gpu else 2**23
    source = torch.ones(copy_bytes // 4, device=setup.device)
    target = torch.empty_like(source)
    fastest = float("inf")
    for _ in range(10):
        synchronize(setup.device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(setup.device)
        fastest = min(fastest, time.perf_counter() - start)
    return {"matmul_flops": flops, "matmul_dtype": str(dtype).removeprefix("torch."), "matmul_shape": list(shape),
            "copy_bytes": copy_bytes, "copy_bytes_per_s": 2 * copy_bytes / fastest}


# ---------------------------------------------------------------------------------------------------------
# 2. model step
# ---------------------------------------------------------------------------------------------------------
def nebel_cut(setup: Setup) -> tuple[ModelConfig, int, TrainConfig]:
    """The nebel-width model that fits: (model config, seq_len, its world-size-1 training config)."""
    device_bytes = device_memory(setup.device)
    for prelude, core, coda, seq_len in NEBEL_CUTS:
        seq_len = 32 if setup.quick else seq_len
        config = model_config("nebel-width", setup, n_layers_in_prelude=prelude, n_layers_in_recurrent_block=core,
                              n_layers_in_coda=coda, block_size=seq_len, activation_checkpointing=True)
        cfg = train_config(config, seq_len, micro_batch_size=1, setup=setup, steps=4, data_dir="")
        plan = plan_memory(cfg, config)
        if plan.total <= FIT_FRACTION * device_bytes:
            return config, seq_len, cfg
    raise RuntimeError(f"no nebel-width cut fits {FIT_FRACTION} x {device_bytes / GIB:.1f} GiB: {NEBEL_CUTS}")


def model_steps(setup: Setup, peak: float) -> list[dict]:
    shapes = [("anchor", 8, 256), ("raven-small", 16, 1024), ("raven-medium", 8, 1024)]
    if setup.quick:
        shapes = [(name, 2, 32) for name, _, _ in shapes]
    config, seq_len, _ = nebel_cut(setup)
    label = (f"nebel-width {config.n_layers_in_prelude}/{config.n_layers_in_recurrent_block}/"
             f"{config.n_layers_in_coda} layers, activation checkpointing")
    rows = []
    for config, label, batch, seq_len in [*((model_config(name, setup), name, batch, seq_len)
                                             for name, batch, seq_len in shapes), (config, label, 1, seq_len)]:
        try:
            rows.append(model_step(setup, peak, config, label, batch, seq_len))
        except Exception as err:  # noqa: BLE001 - a first GPU run shows every shape it can (a compile error, OOM)
            rows.append({"shape": label, "batch": batch, "seq_len": seq_len, "error": failure(err)})
            free_device_memory(setup.device)
    return rows


def model_step(setup: Setup, peak: float, config: ModelConfig, label: str, batch: int, seq_len: int) -> dict:
    num_steps = (1, 2) if setup.quick else (4, 4)
    dtype = torch.bfloat16 if setup.on_gpu else torch.float32
    shape = AttentionShape(batch, config.num_attention_heads, seq_len, config.head_dim, dtype)
    probe = probe_attention_backends(shape, setup.device)
    row = {"shape": label, "batch": batch, "seq_len": seq_len, "num_steps": list(num_steps),
           "n_embd": config.n_embd, "heads": config.num_attention_heads, "attention_probe": probe}
    try:
        backend = choose_attention_backend(probe, shape, "auto")
    except AttentionBackendError as err:
        return {**row, "attention_backend": None, "error": str(err)}
    torch._dynamo.reset()  # every shape compiles its own static graphs
    torch.manual_seed(0)
    with torch.device("meta"):
        eager = RecurrentGPT(config)
    models = {"eager": restrict_attention(eager.materialize(setup.device), backend)}
    with torch.device("meta"):
        compiled = RecurrentGPT(config)
    compiled.materialize(setup.device).load_state_dict(models["eager"].state_dict())
    models["compiled"] = setup.compile(restrict_attention(compiled, backend))
    seconds = step_seconds(models, batch, seq_len, num_steps, setup.device, autocast=setup.on_gpu, steps=setup.steps,
                           loss_chunk_tokens=1024)
    flops_per_token = training_flops_per_token(config, num_steps, seq_len)
    row.update(attention_backend=backend, params=sum(p.numel() for p in eager.parameters()))
    for variant, median in seconds.items():
        tokens_per_s = batch * seq_len / median
        row[variant] = {"seconds": median, "tokens_per_s": tokens_per_s, "mfu": flops_per_token * tokens_per_s / peak}
    row["compiled_over_eager"] = seconds["eager"] / seconds["compiled"]
    del models, eager, compiled
    free_device_memory(setup.device)
    return row


# ---------------------------------------------------------------------------------------------------------
# 3. memory plan against the allocator
# ---------------------------------------------------------------------------------------------------------
def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def free_device_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_allocated(device: torch.device) -> int | None:
    """The most bytes allocated since the last reset_peak (None off CUDA, whose allocator alone counts)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def difference(after: int | None, before: int | None) -> int | None:
    return None if after is None or before is None else after - before


def memory_check(setup: Setup, root: Path) -> dict:
    """The plan of the nebel-width training configuration, then the same configuration built by build_components
    on the device, allocated bytes measured from before the build: after it (parameters, buffers and the
    optimizer state, which the optimizer allocates at construction), the peak of one micro-batch's forward and
    loss (+ activations, bf16 weight casts, the chunked loss's head copy and chunk) and what stays after it
    (+ activations), the peak of its backward (over the parameters and state: the gradients as backward
    allocates them, the activations, the transients), after it (+ gradients), the peak of an optimizer step
    above that, with the module norms of a log step; then the peak of a whole (log) train_step."""
    config, seq_len, cfg = nebel_cut(setup)
    plan = plan_memory(cfg, config, accumulates=False)  # one micro-batch a step, as measured here
    cfg.data.data_dir = str(write_shard(root / "memory", config.vocab_size, seq_len, rows=8))
    run_plan = train_plan(cfg, config, setup)
    device = setup.device
    free_device_memory(device)
    before = allocated(device)
    c = loop.build_components(cfg, run_plan, 0, device)
    built = allocated(device)
    batch = c.reader.next_step()[0]
    inputs, labels = batch.inputs.to(device), batch.labels.to(device)
    k = config.mean_backprop_depth
    reset_peak(device)
    with c.autocast:
        loss = c.sync.module(inputs, labels=labels, num_steps=(1, k), loss_chunk_tokens=cfg.loss_chunk_tokens,
                             check_token_ids=False).loss  # as train_step calls it
    forward_peak = peak_allocated(device)
    forward = allocated(device)
    reset_peak(device)
    loss.backward()
    c.sync.finish()
    backward_peak = peak_allocated(device)
    del loss
    gradients = allocated(device)
    norms = ModuleNorms(c.model, 1)  # as on a log step (observe.module_norms, the default)
    reset_peak(device)
    norms.snapshot()
    c.optimizer.step()
    norms.updates()
    step_peak = peak_allocated(device)
    c.optimizer.zero_grad(set_to_none=True)
    reset_peak(device)
    loop.train_step(c, 2, cfg, run_plan, device, norms=norms)
    synchronize(device)
    peak = peak_allocated(device)

    def planned(prefix: str) -> int:
        return next(size for name, size, _ in plan.rows if name.startswith(prefix))

    phase = {p.name: p.transient_bytes for p in plan.phases}

    built_planned = planned("parameters") + planned("optimizer state") + planned("exchange buffers")
    items = [
        ("parameters + buffers + optimizer state + exchange buffers", built_planned, difference(built, before)),
        ("gradients", sum(size for name, size, _ in plan.rows if name.startswith("gradients")),
         difference(gradients, built)),
        ("activations saved for backward (end of forward, outside autocast)", planned("activations saved"),
         difference(forward, built)),
        ("forward peak (activations, casts, the loss's head copy and chunk)",
         planned("activations saved") + phase["end of forward"], difference(forward_peak, built)),
        ("backward peak (gradients, activations, transients)",
         max(plan.phase_total(p) for p in plan.phases if "backward" in p.name) - built_planned,
         difference(backward_peak, built)),
        ("optimizer step of a log step (scratch, module norms' copies)", phase["optimizer step"],
         difference(step_peak, gradients)),
        ("total: the peak of a whole train_step", plan.total, difference(peak, before)),
    ]
    del c, inputs, labels
    free_device_memory(device)
    return {"config": f"{config.name} {config.n_layers_in_prelude}/{config.n_layers_in_recurrent_block}/"
                      f"{config.n_layers_in_coda} layers, D={config.n_embd}, micro-batch 1 x {seq_len}, k={k}",
            "plan": plan.render().splitlines(),
            "items": [{"item": item, "planned_bytes": planned, "measured_bytes": measured}
                      for item, planned, measured in items]}


# ---------------------------------------------------------------------------------------------------------
# 4. training through the project's loop, without Ray
# ---------------------------------------------------------------------------------------------------------
def write_shard(data_dir: Path, vocab: int, seq_len: int, rows: int) -> Path:
    """Rank 0's train shard of counting sequences mod (vocab - 2) from random starts: learnable, so the loss falls."""
    rng = np.random.default_rng(0)
    ids = (rng.integers(0, vocab - 2, size=(rows, 1)) + np.arange(seq_len + 1)) % (vocab - 2)
    path = shard_path(data_dir, "train", 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"input_ids": pa.array(list(ids.astype(np.int32)), type=pa.list_(pa.int32()))}), path,
                   row_group_size=64)
    return data_dir


def train_config(config: ModelConfig, seq_len: int, micro_batch_size: int, setup: Setup, steps: int,
                 data_dir: str) -> TrainConfig:
    return from_dict(TrainConfig, {
        "max_steps": steps, "block_size": seq_len, "micro_batch_size": micro_batch_size,
        "model": {"name": "nebel-raven-3.5b" if config.name == "nebel-width" else "raven-tiny"},
        "optim": {"lr": 3e-3}, "schedule": {"warmup_steps": 2, "cooldown_steps": 0},
        "data": {"data_dir": data_dir}, "scaling": {"num_workers": 1, "use_gpu": setup.on_gpu},
        "activation_checkpointing": config.activation_checkpointing,
        "device_memory_gib": device_memory(setup.device) / GIB,
    })


def train_plan(cfg: TrainConfig, config: ModelConfig, setup: Setup) -> RunPlan:
    """What preflight hands the workers, for this one-rank run (one shard)."""
    return RunPlan(global_batch_rows=cfg.micro_batch_size, num_streams=1, schedule_steps=cfg.max_steps,
                   data_dir=cfg.data.data_dir, pad_id=config.vocab_size - 1, eos_id=config.vocab_size - 2,
                   precision="bf16-mixed" if setup.on_gpu else "fp32", model_config=config)


@contextmanager
def counting_host_reads(device: torch.device):
    """Counts reads of tensor values by the host (item, bool, float, int, tolist): `sites` by file:function:method
    in this package's training files, `device` those of tensors not on the CPU (each one a device sync)."""
    names = ("item", "__bool__", "__float__", "__int__", "tolist")
    originals = {name: getattr(torch.Tensor, name) for name in names}
    counts = {"sites": collections.Counter(), "device": 0}
    project = ("loop.py", "model.py", "optim.py", "grad_sync.py", "parallel.py", "shard_reader.py")

    def counting(name):
        def read(self, *args, **kwargs):
            frame = traceback.extract_stack(limit=2)[0]
            file = Path(frame.filename).name
            if file in project:
                counts["sites"][f"{file}:{frame.name}:{name}"] += 1
            if self.device.type != "cpu":
                counts["device"] += 1
            return originals[name](self, *args, **kwargs)
        return read

    for name in names:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def save_and_resume(c: loop.Components, step: int, cfg: TrainConfig, plan: RunPlan, device: torch.device,
                    run_dir: Path) -> loop.Components:
    """Save `c` after `step` into `run_dir` with the project's checkpoint functions and resume from it, as a
    rerun of the job does, into newly built components (model, optimizer, data position). The one place this
    check touches the checkpoint API."""
    rows = step * c.order.rows_per_stream_per_step
    ckpt.write(run_dir / f"checkpoint_{step:06d}", 0, c.model, c.optimizer,
               ckpt.TrainerState(step=step, tokens=step * plan.global_batch_rows * cfg.block_size, world_size=1,
                                 num_streams=1, global_batch_rows=plan.global_batch_rows, rows_per_stream=rows),
               device)
    resumed = loop.build_components(cfg, plan, 0, device)
    found = ckpt.resume(None, run_dir, 0, resumed.model, resumed.optimizer, device)
    assert found is not None and found.state.step == step, found
    resumed.reader.seek(found.state.rows_per_stream)
    resumed.resumed = True
    return resumed


def training_check(setup: Setup, root: Path) -> tuple[dict, RecurrentGPT]:
    """A reference run of train_steps steps, host reads counted from step 3 on (the optimizer state exists), then
    a second run that saves after save_at steps, resumes into new components and goes on to the end (its device
    reads counted too: optimizer step counters loaded onto the device would show there)."""
    config = model_config("anchor", setup)
    seq_len, micro_batch = (32, 2) if setup.quick else (256, 8)
    steps = setup.train_steps
    data_dir = write_shard(root / "train", config.vocab_size, seq_len, rows=micro_batch * (steps + 2))
    cfg = train_config(config, seq_len, micro_batch, setup, steps, str(data_dir))
    plan = train_plan(cfg, config, setup)
    device = setup.device
    c = loop.build_components(cfg, plan, 0, device)
    reference = [loop.train_step(c, step, cfg, plan, device).loss for step in (1, 2)]
    with counting_host_reads(device) as reads:
        reference += [loop.train_step(c, step, cfg, plan, device).loss for step in range(3, steps + 1)]
    counted = steps - 2
    del c
    c = loop.build_components(cfg, plan, 0, device)
    second = [loop.train_step(c, step, cfg, plan, device).loss for step in range(1, setup.save_at + 1)]
    with tempfile.TemporaryDirectory(dir=root) as run_dir:
        c = save_and_resume(c, setup.save_at, cfg, plan, device, Path(run_dir))
    with counting_host_reads(device) as reads_after_resume:
        second += [loop.train_step(c, step, cfg, plan, device).loss for step in range(setup.save_at + 1, steps + 1)]
    third = len(reference) // 3
    result = {
        "model": f"{config.name} D={config.n_embd}, micro-batch {micro_batch} x {seq_len}",
        "steps": steps, "losses": reference,
        "loss_falls": sum(reference[-third:]) < sum(reference[:third]),
        "host_reads_per_step": {site: n / counted for site, n in sorted(reads["sites"].items())},
        "device_reads_per_step": reads["device"] / counted,
        "resume": {"saved_after_step": setup.save_at, "losses": second,
                   "max_abs_loss_difference": max(abs(a - b) for a, b in zip(reference, second)),
                   "bitwise": reference == second,
                   "device_reads_per_step": reads_after_resume["device"] / (steps - setup.save_at)},
    }
    return result, restrict_attention(c.model, None)  # generation: torch's own kernel choice


# ---------------------------------------------------------------------------------------------------------
# 5. generation
# ---------------------------------------------------------------------------------------------------------
def generation_check(setup: Setup, model: RecurrentGPT) -> dict:
    model.eval()
    prompt = (torch.arange(16, device=setup.device) % (model.config.vocab_size - 2))[None]
    result = {}
    for label, criterion in (("fixed depth", None), ("adaptive (kl)", "kl")):
        generate(model, prompt, 2, setup.depth, exit_criterion=criterion)  # warm-up
        synchronize(setup.device)
        start = time.perf_counter()
        out = generate(model, prompt, setup.new_tokens, setup.depth, exit_criterion=criterion)
        synchronize(setup.device)
        seconds = time.perf_counter() - start
        result[label] = {"tokens_per_s": setup.new_tokens / seconds,
                         "mean_steps_per_token": float(out.steps[:, 1:].float().mean()),
                         "threshold": DEFAULT_THRESHOLDS.get(criterion)}
    return {"depth": setup.depth, "new_tokens": setup.new_tokens, "batch": 1, **result}


# ---------------------------------------------------------------------------------------------------------
# 6. engine
# ---------------------------------------------------------------------------------------------------------
EXIT_WAIT_STEPS = 3
"""The engine's EngineConfig.exit_wait_steps here, as bench/generate.py's default (admit_rows: a quarter of the
batch, as there)."""
EQUALITY_REQUESTS = 8
"""How many of the engine's requests are generated again at batch 1 to compare outputs (batch-1 generation is
launch-bound on a GPU: all 64 requests took minutes on an H100)."""


def engine_events(model: RecurrentGPT, config: EngineConfig, requests: list[Request]) -> list[list[TokenEvent]]:
    """Each request's token events, in order, from a new engine driven alone until it is idle."""
    engine = Engine(model, config)
    request_ids = [engine.submit(request) for request in requests]
    events: dict[int, list[TokenEvent]] = {request_id: [] for request_id in request_ids}
    while engine.busy:
        for event in engine.step():
            events[event.request_id].append(event)
    return [events[request_id] for request_id in request_ids]


ENGINE_RUNS = (("fixed depth", None, False), ("adaptive (latent-diff)", "latent-diff", False),
               ("fixed depth, compiled", None, True), ("adaptive (latent-diff), compiled", "latent-diff", True))
"""(label, exit criterion, EngineConfig.compile) of each engine run: on a GPU every one replays CUDA graphs."""


def engine_check(setup: Setup, model: RecurrentGPT) -> dict:
    """The continuous-depth-batching engine on the trained model: 2 x batch requests (greedy, seeded), at the
    fixed depth and with latent-diff exits, each with the eager and with the compiled step (`--quick`: eager
    only); tokens/s, iterations per token, and the fraction of requests whose adaptive output equals `generate`
    at batch size 1 (rounding of batched matmuls may move an exit). An untimed run of the same requests first
    captures (and compiles) every kind of step the timed run meets."""
    model.eval()
    batch = 4 if setup.quick else 32
    vocab = model.config.vocab_size - 2
    prompts = [tuple(((torch.arange(16) * (row + 3) + row) % vocab).tolist()) for row in range(2 * batch)]
    # --quick: the tiny model after 8 steps moves its state by ~0.5-1 per iteration; a threshold that exits it
    threshold = 0.9 if setup.quick else DEFAULT_THRESHOLDS["latent-diff"]
    result = {"threshold": threshold, "exit_wait_steps": EXIT_WAIT_STEPS, "runs": []}
    outputs = {}
    for label, criterion, compiled in ENGINE_RUNS:
        if compiled and setup.quick:
            continue
        config = EngineConfig(batch, 2**62, EXIT_WAIT_STEPS, max(1, batch // 4), compile=compiled)
        requests = [Request(prompt, setup.new_tokens, setup.depth, criterion, threshold, seed=row)
                    for row, prompt in enumerate(prompts)]
        engine_events(model, config, requests)  # warm-up: captures and compiles
        synchronize(setup.device)
        start = time.perf_counter()
        events = engine_events(model, config, requests)
        synchronize(setup.device)
        seconds = time.perf_counter() - start
        iterations = [event.core_iterations for request_events in events for event in request_events]
        result[label] = {"tokens_per_s": len(iterations) / seconds, "mean_iterations": sum(iterations) / len(iterations),
                         "max_iterations": max(iterations)}
        result["runs"].append(label)
        outputs[label] = [[event.token_id for event in request_events] for request_events in events]
    adaptive = [label for label in result["runs"] if "adaptive" in label]
    equal = dict.fromkeys(adaptive, 0)
    checked = prompts[:EQUALITY_REQUESTS]
    for row, prompt in enumerate(checked):
        alone = generate(model, torch.tensor([prompt], device=setup.device), setup.new_tokens, setup.depth,
                         "latent-diff", threshold, generator=torch.Generator(device=setup.device).manual_seed(row))
        for label in adaptive:
            equal[label] += alone.tokens[0, 16:].tolist() == outputs[label][row]
    result["tokens_equal_fraction"] = {label: count / len(checked) for label, count in equal.items()}
    result["requests_compared"] = len(checked)
    return {"depth": setup.depth, "new_tokens": setup.new_tokens, "batch": batch, "requests": len(prompts), **result}


# ---------------------------------------------------------------------------------------------------------
# 6b. decode calls: where a decoding step's time goes
# ---------------------------------------------------------------------------------------------------------
DECODE_CALLS = 50
"""Timed core calls per measurement (after 3 warm-up calls)."""


class CountingOps(TorchDispatchMode):
    """Counts the ATen operations dispatched (each one a kernel launch on a GPU, views aside)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def decode_call_check(setup: Setup, model: RecurrentGPT) -> dict:
    """One core iteration at decoding's shape (rows x 1 token x D; no KV cache, so attention sees one position)
    on the trained model: ATen operations per call, ms per call eager, and ms per replay of the same call captured
    in a CUDA graph (a GPU only). Eager much slower than the replay means the host's launches, not the GPU's
    work, set decoding's speed: what the generation and engine sections measure is then per-call overhead."""
    model.eval()
    core, width = model.transformer.core_block, model.config.n_embd
    weight = model.transformer.adapter.weight[:, :width]
    rope = model.freqs_cis[:, 16:17]
    result = {"blocks": len(core), "calls_timed": DECODE_CALLS, "rows": {}}
    for rows in (1, 4) if setup.quick else (1, 32):
        generator = torch.Generator(device=setup.device).manual_seed(rows)
        state = torch.randn(rows, 1, width, device=setup.device, generator=generator)
        injected = torch.randn(rows, 1, width, device=setup.device, generator=generator)

        def call() -> Tensor:
            return core.iterate(state, injected, weight, rope)

        with torch.no_grad():
            counting = CountingOps()
            with counting:
                call()
            eager = per_call_seconds(call, setup.device)
            graph = None
            if setup.on_gpu:
                graph = cuda_graph_replay_seconds(call)
        result["rows"][str(rows)] = {"aten_ops": counting.count, "eager_ms": eager * 1e3,
                                     "graph_ms": None if graph is None else graph * 1e3}
    return {"depth_of_a_call": "one core iteration", **result}


def per_call_seconds(call, device: torch.device) -> float:
    for _ in range(3):
        call()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(DECODE_CALLS):
        call()
    synchronize(device)
    return (time.perf_counter() - start) / DECODE_CALLS


def cuda_graph_replay_seconds(call) -> float:
    """Captures `call` in a CUDA graph (warmed up on a side stream, as capture requires) and times its replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return per_call_seconds(graph.replay, torch.device("cuda"))


# ---------------------------------------------------------------------------------------------------------
# 7. optimizer
# ---------------------------------------------------------------------------------------------------------
ADAMW_TOLERANCE = 1e-6
"""Largest |weight difference| allowed between AdamW's fused and multi-tensor steps after `Setup.steps` steps at
lr 1e-3 (each step moves a weight by about 1e-3; the two differ by the rounding of a few fp32 operations), and
between ELLISAdam's step and its reference formula (bench/ellis_reference.py)."""


def optimizer_check(setup: Setup, config: ModelConfig | None = None) -> dict:
    """On the same parameters, gradients and param groups (weight decay on the matrices only, as
    build_optimizer's groups) of `config` (default: a nebel-width model of 1/1/1 layers): AdamW `fused=True`
    against `foreach=True`; ELLISAdam (the training's default, OptimConfig's defaults) eager and compiled
    (`optim.compile_step`; not with --quick, where compiling would cost the test suite tens of seconds) against
    the reference formula. The median seconds of a step and the largest weight difference after `setup.steps`
    steps against the first of each group."""
    from huginn_ray.train.config import OptimConfig
    from huginn_ray.train.optim import configured_group_options

    if config is None:
        config = model_config("nebel-width", setup, n_layers_in_prelude=1, n_layers_in_recurrent_block=1,
                              n_layers_in_coda=1)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = RecurrentGPT(config)
    model.materialize(setup.device)
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    grads = [torch.randn_like(p) * 1e-2 for p in params]

    def ellis(compiled: bool):
        return build_optimizer(model, OptimConfig(compile_step=compiled)).step

    def reference():
        cfg = OptimConfig()
        options = configured_group_options(cfg)
        groups = [{**group, **options[group["name"]], "lr": cfg.lr}
                  for group in param_groups(model, cfg.weight_decay, cfg.no_weight_decay_for_bias_and_norm)]
        states = [[ReferenceState(p) for p in group["params"]] for group in groups]
        return lambda: [reference_step(group, group_states) for group, group_states in zip(groups, states)]

    def adamw(variant: str):
        return torch.optim.AdamW(param_groups(model, 0.1, True), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                                 **{variant: True}).step

    seconds, differences = {}, {}
    ellis_variants = [("ellis_reference", reference), ("ellis_eager", lambda: ellis(False))]
    if not setup.quick:
        ellis_variants.append(("ellis_compiled", lambda: ellis(True)))
    for variants in ((("fused", lambda: adamw("fused")), ("foreach", lambda: adamw("foreach"))), ellis_variants):
        first = None  # the first variant's weights, against which the others' are compared (one copy at a time)
        for name, make in variants:
            with torch.no_grad():
                for p, initial, grad in zip(params, start, grads):
                    p.copy_(initial)
                    p.grad = grad
            step = make()
            times = []
            for _ in range(setup.steps + 1):  # the first step allocates AdamW's moments (compiles): not timed
                synchronize(setup.device)
                started = time.perf_counter()
                step()
                synchronize(setup.device)
                times.append(time.perf_counter() - started)
            seconds[name] = float(np.median(times[1:]))
            del step
            if first is None:
                first = [p.detach().clone() for p in params]
            else:
                differences[name] = max((a - b).abs().max().item() for a, b in zip(first, params))
            free_device_memory(setup.device)
        del first

    row = {"params": sum(p.numel() for p in params), "steps": setup.steps + 1,
           "training_takes_fused": adamw_fused(setup.device),
           "fused_seconds": seconds["fused"], "foreach_seconds": seconds["foreach"],
           "fused_speedup": seconds["foreach"] / seconds["fused"], "max_abs_weight_difference": differences["foreach"],
           "tolerance": ADAMW_TOLERANCE,
           "ellis_seconds": {name.removeprefix("ellis_"): seconds[name] for name, _ in ellis_variants},
           "ellis_max_abs_weight_difference": {name.removeprefix("ellis_"): differences[name]
                                               for name, _ in ellis_variants[1:]}}
    errors = [f"{name} differs by {difference:.3g} > {ADAMW_TOLERANCE:g} in a weight" for name, difference
              in [("fused AdamW from foreach", differences["foreach"])] +
              [(f"ELLISAdam {name} from the reference", differences[f"ellis_{name}"]) for name in
               row["ellis_max_abs_weight_difference"]] if not difference <= ADAMW_TOLERANCE]
    if errors:
        row["error"] = "; ".join(errors)
    return row


# ---------------------------------------------------------------------------------------------------------
# 8. bf16 gathers
# ---------------------------------------------------------------------------------------------------------
def bf16_gather_check(setup: Setup) -> dict:
    """The anchor model (--quick: the tiny one) under hsdp on this device, gathered in fp32 and in bf16."""
    config = model_config("anchor", setup)
    batch, seq_len = (2, 32) if setup.quick else (8, 256)
    num_steps = (1, 2) if setup.quick else (4, 4)
    ids = torch.randint(0, config.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = ids[:, :-1].to(setup.device), ids[:, 1:].to(setup.device)
    mesh = parallel.build_mesh(parallel.MeshShape(sharded=True, world_size=1, shard_size=1), setup.device.type)
    row = {"model": f"anchor D={config.n_embd}", "batch": batch, "seq_len": seq_len}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = RecurrentGPT(config)
        model.materialize(setup.device)
        parallel.apply_hsdp(model, mesh, dtype)
        # a shard group of one gathers by copying, without a collective: the bytes are those of the unsharded
        # weights each unit's forward sees, times its gathers per step (prelude and coda blocks: forward and
        # backward; the core and the root: once), the fp32 tensors FSDP2 leaves whole not counted
        gathered, seen = {}, {}
        t = model.transformer
        whole = {id(p) for block in model.blocks() for p in parallel.fp32_parameters(block)} \
            if dtype != torch.float32 else set()
        units = [(block, 2) for block in [*t.prelude, *t.coda]] + [(t.core_block, 1)]

        def counter(unit, times, root=False):
            def count(module, args):
                if seen.get("counted"):
                    return
                params = [p for p in (unit.parameters(recurse=not root) if not root else root_parameters())
                          if id(p) not in whole]
                for p in params:
                    key = str(p.dtype).removeprefix("torch.")
                    gathered[key] = gathered.get(key, 0) + times * p.numel() * p.element_size()
            return count

        def root_parameters():
            in_blocks = {id(p) for block in model.blocks() for p in block.parameters()}
            return [p for p in model.parameters() if id(p) not in in_blocks]

        hooks = [unit.register_forward_pre_hook(counter(unit, times)) for unit, times in units]
        hooks.append(model.register_forward_pre_hook(counter(model, 1, root=True)))

        def record(module, args):
            if not seen:
                seen.update({name: str(p.dtype).removeprefix("torch.") for name, p in module.named_parameters()})

        hooks.append(t.core_block[0].register_forward_pre_hook(record))
        times, loss = [], None
        for step in range(setup.steps + 1):  # the first step (allocations) is not timed
            synchronize(setup.device)
            started = time.perf_counter()
            with torch.autocast(setup.device.type, dtype=torch.bfloat16):
                out = model(inputs, labels=labels, num_steps=num_steps)
            out.loss.backward()
            synchronize(setup.device)
            times.append(time.perf_counter() - started)
            loss = out.loss.item() if loss is None else loss
            model.zero_grad(set_to_none=True)
            seen["counted"] = True
        for hook in hooks:
            hook.remove()
        del seen["counted"]
        row[str(dtype).removeprefix("torch.")] = {"seconds": float(np.median(times[1:])), "loss": loss,
                                                  "gathered_bytes": gathered, "core_block_dtypes": seen}
        del model, out
        free_device_memory(setup.device)
    fp32, bf16 = row["float32"], row["bfloat16"]
    row["gathered_ratio"] = sum(bf16["gathered_bytes"].values()) / sum(fp32["gathered_bytes"].values())
    row["loss_relative_difference"] = abs(bf16["loss"] - fp32["loss"]) / abs(fp32["loss"])
    kept = {name: dtype for name, dtype in bf16["core_block_dtypes"].items() if "norm" in name or "qk_bias" in name}
    row["norms_and_qk_bias_fp32"] = set(kept.values()) == {"float32"}
    problems = [f"gathered {row['gathered_ratio']:.3f} x fp32's bytes (> 0.6)"] * (row["gathered_ratio"] > 0.6) + \
        [f"loss {row['loss_relative_difference']:.2g} relative from fp32 gathers' (> 5e-3)"] * (
            row["loss_relative_difference"] > 5e-3) + \
        [f"norms or qk_bias gathered as {kept}"] * (not row["norms_and_qk_bias_fp32"])
    if problems:
        row["error"] = "; ".join(problems)
    return row


# ---------------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------------
def init_one_rank(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(distributed_backend(device), init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, timeout=timedelta(seconds=120))


def failure(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err)[:2000]}"


def render(report: dict) -> str:
    """The table; a section that failed shows its error in its place."""
    mib = lambda b: "-" if b is None else f"{b / 2**20:,.1f}"  # noqa: E731
    device = report["device"]
    lines = [f"device: {device['name']} ({device['type']}), torch {device['torch']}{', --quick' if device['quick'] else ''}"]
    for section in SECTIONS:
        result = report[section]
        if isinstance(result, dict) and "error" in result:
            lines += ["", f"{section}: FAILED: {result['error']}"]
            continue
        if section == "peak":
            lines += [f"peak: matmul {result['matmul_flops'] / 1e12:.1f} TFLOP/s ({result['matmul_dtype']}, "
                      f"{'x'.join(map(str, result['matmul_shape']))}); device-to-device copy "
                      f"{result['copy_bytes_per_s'] / 1e9:.0f} GB/s (read + written)"]
        elif section == "model_step":
            lines += ["", f"{'shape':<58}{'B x T':>10}{'attention':>10}{'eager tok/s':>13}{'MFU':>7}"
                          f"{'compiled tok/s':>16}{'MFU':>7}{'ratio':>7}"]
            for row in result:
                where = f"{row['shape']:<58}{row['batch']:>4} x {row['seq_len']:<5}"
                if "error" in row:
                    lines.append(f"{where}  FAILED: {row['error']}")
                    continue
                lines.append(f"{where}{row['attention_backend']:>10}{row['eager']['tokens_per_s']:>13.0f}"
                             f"{row['eager']['mfu']:>7.1%}{row['compiled']['tokens_per_s']:>16.0f}"
                             f"{row['compiled']['mfu']:>7.1%}{row['compiled_over_eager']:>6.2f}x")
        elif section == "memory":
            lines += ["", f"memory: {result['config']}", f"{'item':<70}{'planned MiB':>12}{'measured MiB':>14}"]
            lines += [f"{i['item']:<70}{mib(i['planned_bytes']):>12}{mib(i['measured_bytes']):>14}"
                      for i in result["items"]]
        elif section == "training":
            resume = result["resume"]
            lines += ["", f"training ({result['model']}, {result['steps']} steps, world size 1, no Ray): loss "
                          f"{result['losses'][0]:.4f} -> {result['losses'][-1]:.4f} "
                          f"({'falls' if result['loss_falls'] else 'DOES NOT FALL'}); device reads per step "
                          f"{result['device_reads_per_step']:g}; resumed after step {resume['saved_after_step']}: max "
                          f"|loss difference| {resume['max_abs_loss_difference']:.3g}"
                          f"{' (bitwise)' if resume['bitwise'] else ''}, device reads per step after the resume "
                          f"{resume['device_reads_per_step']:g}",
                      "host reads per step by site: " + ", ".join(f"{site} {n:g}" for site, n in
                                                                  result["host_reads_per_step"].items())]
        elif section == "optimizer":
            lines += ["", f"optimizer, AdamW over {result['params']:,} parameters (the training takes "
                          f"{'fused' if result['training_takes_fused'] else 'single-tensor'} here): fused "
                          f"{result['fused_seconds'] * 1e3:.2f} ms/step, foreach {result['foreach_seconds'] * 1e3:.2f} "
                          f"ms/step ({result['fused_speedup']:.2f}x); max |weight difference| after "
                          f"{result['steps']} steps {result['max_abs_weight_difference']:.3g} (tolerance "
                          f"{result['tolerance']:g}); ELLISAdam "
                          + ", ".join(f"{name} {value * 1e3:.2f} ms/step" for name, value in
                                      result["ellis_seconds"].items())
                          + "; max |weight difference| from the reference "
                          + ", ".join(f"{name} {value:.3g}" for name, value in
                                      result["ellis_max_abs_weight_difference"].items())]
        elif section == "bf16_gather":
            lines += ["", f"bf16 gathers (hsdp on this device, {result['model']}, {result['batch']} x "
                          f"{result['seq_len']}, bf16 autocast): fwd+bwd {result['float32']['seconds'] * 1e3:.1f} ms "
                          f"with fp32 gathers, {result['bfloat16']['seconds'] * 1e3:.1f} ms with bf16; gathered "
                          f"bytes {result['gathered_ratio']:.3f} x fp32's; loss difference "
                          f"{result['loss_relative_difference']:.2g} relative; norms and qk_bias fp32: "
                          f"{result['norms_and_qk_bias_fp32']}"]
        elif section == "generation":
            lines += ["", f"generation, batch 1, depth {result['depth']}, {result['new_tokens']} tokens: " + "; ".join(
                f"{label} {result[label]['tokens_per_s']:.1f} tok/s ({result[label]['mean_steps_per_token']:.2f} "
                f"iterations/token)" for label in ("fixed depth", "adaptive (kl)"))]
        elif section == "engine":
            lines += ["", f"engine, batch {result['batch']}, {result['requests']} requests, depth {result['depth']}, "
                          f"{result['new_tokens']} tokens each, latent-diff < {result['threshold']}, exit_wait_steps "
                          f"{result['exit_wait_steps']}: " + "; ".join(
                f"{label} {result[label]['tokens_per_s']:.1f} tok/s ({result[label]['mean_iterations']:.2f} "
                f"iterations/token, max {result[label]['max_iterations']})" for label in result["runs"])
                + "; adaptive equal to batch-1 generate: " + ", ".join(
                    f"{label} {fraction:.3f}" for label, fraction in result["tokens_equal_fraction"].items())
                + f" of {result['requests_compared']} requests"]
        elif section == "decode_calls":
            lines += ["", f"decode calls ({result['depth_of_a_call']}, {result['blocks']} blocks, 1 token per row, no "
                          f"cache): " + "; ".join(
                f"{rows} rows: {row['aten_ops']} ATen ops, eager {row['eager_ms']:.3f} ms"
                + ("" if row["graph_ms"] is None else
                   f", CUDA graph replay {row['graph_ms']:.3f} ms ({row['eager_ms'] / row['graph_ms']:.1f}x)")
                for rows, row in result["rows"].items())]
    lines.append(f"total {report['seconds']:.0f} s")
    return "\n".join(lines)


SECTIONS = ("peak", "model_step", "memory", "training", "generation", "engine", "decode_calls", "optimizer",
            "bf16_gather")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a few seconds (the test suite's run)")
    parser.add_argument("--out", default="out/gpu_check.json", help="where the JSON goes")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" and not args.quick:
        parser.error(f"--device {args.device}: the full check is for a GPU; on a CPU run --quick "
                     "(bench/model_step.py measures CPU shapes)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.quick:
        setup = Setup(device, quick=True, steps=2, train_steps=8, save_at=4, new_tokens=6, depth=4)
    else:
        setup = Setup(device, quick=False, steps=10, train_steps=40, save_at=20, new_tokens=64, depth=16)
    if device.type == "cpu":
        torch.set_num_threads(1)  # the fp32 CPU run is bitwise reproducible with one thread
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if setup.on_gpu else platform.processor() or platform.machine()
    report = {"device": {"type": device.type, "name": name, "torch": torch.__version__, "quick": setup.quick,
                         "memory_bytes": device_memory(device), "command": " ".join(sys.argv)}}
    init_one_rank(device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    trained = None
    try:
        with tempfile.TemporaryDirectory() as root:
            # every section runs whatever happened in the others: a first GPU run shows all that it can
            for section in SECTIONS:
                try:
                    if section == "peak":
                        report[section] = measure_peak(setup)
                    elif section == "model_step":
                        peak = report["peak"].get("matmul_flops")
                        report[section] = model_steps(setup, peak) if peak else {"error": "no measured peak"}
                    elif section == "memory":
                        report[section] = memory_check(setup, Path(root))
                    elif section == "training":
                        report[section], trained = training_check(setup, Path(root))
                    elif section == "optimizer":
                        report[section] = optimizer_check(setup)
                    elif section == "bf16_gather":
                        report[section] = bf16_gather_check(setup)
                    elif trained is None:
                        report[section] = {"error": "no trained model (the training section failed)"}
                    elif section == "generation":
                        report[section] = generation_check(setup, trained)
                    elif section == "decode_calls":
                        report[section] = decode_call_check(setup, trained)
                    else:
                        report[section] = engine_check(setup, trained)
                except Exception as err:  # noqa: BLE001 - recorded in the report, and the exit status says so
                    traceback.print_exc()
                    report[section] = {"error": failure(err)}
                    free_device_memory(device)
                # written after every section, so a run stopped at a time limit still leaves what it measured
                out.write_text(json.dumps(report, indent=2) + "\n")
                print(f"[{time.perf_counter() - started:6.1f} s] {section} done", flush=True)
    finally:
        dist.destroy_process_group()
    report["seconds"] = time.perf_counter() - started
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(render(report))
    print(f"JSON: {out}")
    failed = [section for section in SECTIONS if "error" in report[section]] + \
        [row["shape"] for row in report["model_step"] if isinstance(report["model_step"], list) and "error" in row]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
