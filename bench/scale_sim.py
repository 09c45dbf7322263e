"""What one rank of a W-rank run does, counted with this project's own code, for W up to 4,096 on one machine.

One process plays one rank of a world of W ranks (rank 0, then the last rank of the last node; each item is the
maximum of the two) through the real code paths of a run of each Frontier configuration as written (`SCENARIOS`):
`configs/train/frontier_nebel_512_nodes.yaml` (bf16-mixed: bf16 gathers, and the gradient exchange's second stream
for the parameters FSDP2 leaves whole; 4,096 train shards, so one micro-batch per step) and
`configs/train/frontier_nebel_131k.yaml` (131,072 tokens, `parallelism.context_parallel: 8`: cp groups of 8
consecutive ranks inside the node's shard group; 512 train shards of 131,073-token rows, one row of one shard per
cp group at W = 4,096):

    startup   the worker's own startup, loop.train_on_rank up to its steps: start_worker (register_node,
              build_components: mesh, cp group, model, FSDP2 units, optimizer; the placements' all-gather and the
              node-layout check; warm_mesh, the cp group's included), the validation rows' agreement, restore_state
              (no checkpoint: the seed's weights, check_replicas_agree), warmup_allreduce (128 MiB, 8 stages), and
              what run_steps makes before its first step: the Checkpointer (both configurations save
              asynchronously: checkpoint.async_save null and GPUs), whose background group lazy_gloo_group creates
    init_from build_components without weights, then load_initial_weights from a released-layout directory
    save      three saves (steps 128, 256, 384) through ckpt.start_save and finish_save: the first two through the
              configuration's path, dcp.async_save on the Checkpointer's background group (its thread plans and
              writes; finish_save waits for it at once, where the Checkpointer waits at the next save, so that
              each save's collectives are counted in its own phase), the third as the run's last save is made,
              synchronously (dcp.save on the default group); DCP's planner is the project's
              (checkpoint.SmallValuesOnRankZero, save-plan caching on), with its plan exchange and its `.metadata`,
              then the agreement and the marker. The save figures are the second's (the steady state), plus the
              plan items rank 0 receives at the first, and the last save's collectives and file operations
    resume    resume() of the last save: the candidate list, the completeness check, the agreement, and
              read_tensors through the replica-spread read (huginn_ray.train.replica_read.read_dcp: the group's
              bytes from the `.metadata`, this rank's contiguous span of them read from the files, the rounds of
              all-gather over the replicate group, the copies into the tensors), then the optimizer state set back
    step      one train_step (loop.py) with all its micro-batches (grad_accum: 1 in both configurations), on a
              model of the nebel's depth and 64 wide (scale_sim_step); with cp its sequence is scaled (131,072
              tokens to 128: 16 per rank) and the cp attention's collectives run over the cp group: the K/V
              all-gather of every attention call (every block of every iteration, the no-grad ones and the
              checkpointed blocks' recomputation included) and its reduce-scatter in backward
    steady    one poll of the hang watch (hang_watch.HangWatch.poll, nothing in flight), which every rank runs
              beside its steps: the store requests of steady state

over stand-ins that count instead of communicating (what they stand in for: 4,096 processes on 512 nodes):

- the process group is torch's fake backend (`torch.testing._internal.distributed.fake_pg`): collectives return
  at once; a dispatch mode counts every c10d operation (in dcp.async_save's thread too: `background_save_counted`).
  A broadcast from rank 0 delivers, on the other simulated rank, what the simulated rank 0 sent; an all-reduce
  leaves this rank's value (every rank agreeing). The background save's group, gloo in a run, is made by the same
  new_group call with the fake backend (the call counted); the connections gloo would open are modelled.
- DCP's save coordination: the objects the other ranks send (their local plans, their write results) and the
  one DCP's scatter gives the last rank are supplied by `scale_sim_dcp.OtherRanks` (what each rank's DCP would
  send); the collectives carrying them run and are counted. A background save's copy to host memory is not made
  (the state is on the meta device): its bytes are planned (`scale_sim_dcp.SparseWriter.stage`).
- the key-value store (`CountingStore`) counts every key an operation touches; keys the other ranks would have
  set are there, and a counter reads as if every rank had added to it.
- Ray Train's worker context (rank, node, local rank, node address) is `SimulatedContext`, and the placements'
  all-gather returns every rank's placement from it (the all-gather runs and is counted); there is no checkpoint
  registered with Ray, no MLflow logger, and the validation rows are zeros (the data is not read).
- the file system is real (a temporary directory) but every stat, open, directory listing and byte read or written
  through Python is counted (os.stat, os.scandir, os.listdir, io.open and the files it returns), and the
  safetensors slices requested are counted by their bytes.
- the model lives on the meta device (build_components, check_replicas_agree and the warm-up's buffer are given
  the meta device; the agreements whose values the code reads back run on the host): shapes and byte counts are
  real, no memory is used. DCP's tensor files are sparse files of their sizes (`scale_sim_dcp.SparseWriter`).
- the step's cp attention builds its lower-right causal mask (a tensor subclass that cannot be created inside a
  dispatch mode) outside the counting mode; it holds no data and runs no collective.

Measured (counted as the code runs): every per-rank item but those below. Planned: the bytes of DCP's tensor
pieces in the save (their sizes, not written), the bytes a background save stages in host memory, and in the
resume the archive header a rank reads for each piece whose data start it finds (measured on a real archive of
that dtype and rank); the gathered bytes are not copied into the (meta) tensors, nor the non-tensor values
unpickled. Computed from the data order: `data_read_amplification` and `data_reads_per_batch_row` (rows, not
bytes: the data is not read). Modelled: `store_requests_rank0_startup`, the requests rank 0's store server
answers, as W times a rank's own (every rank makes the same requests); `store_requests_rank0_per_s_steady`, W times
a rank's store requests per hang-watch poll over the poll interval (the step itself makes none:
`store_ops_per_step`, counted); `gloo_connections_background_group_rank0`, W - 1: the background group connects
lazily (TORCH_GLOO_LAZY_INIT), and rank 0's gathers reach every rank. Scaled: the step's model is 64 wide (FSDP2
refuses to train meta parameters): its gradient exchange's chunk size is the configuration's scaled by that
model's parameters over the nebel's, so that its gradient shard splits into about as many chunks as the nebel's;
with cp its sequence is 128 tokens (the cp group, the head-tail split and the number of attention calls are the
configuration's; the gathered bytes are not). Not simulated: the overlap of a background save with training (the
save is waited for at once), gloo's own connection handshakes, the data's bytes (a row of zeros).

    python bench/scale_sim.py --world-sizes 8,64,512,4096 [--config NAME] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import multiprocessing
import pickle
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
import ray.train
import ray.util
import torch
import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh
import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from huginn_ray.checkpoint_layout import TRAINING_STATE_DIR  # noqa: E402
from huginn_ray.config import load_config  # noqa: E402
from huginn_ray.model import ModelConfig, RecurrentGPT  # noqa: E402
from huginn_ray.train import checkpoint as ckpt  # noqa: E402
from huginn_ray.train import hang_watch, loop, parallel, validation  # noqa: E402
from huginn_ray.train.collectives import all_ranks  # noqa: E402
from huginn_ray.train.config import TrainConfig  # noqa: E402
from huginn_ray.train.run_plan import RunPlan  # noqa: E402
from huginn_ray.train.shard_reader import Rows  # noqa: E402
from scale_sim_counting import (CountingCollectives, CountingStore, Counts, ModelBytes,  # noqa: E402
                                counting_files, host_reads_of_meta, patched, uncounted)
from scale_sim_dcp import FromRankZero, OtherRanks, background_save_counted  # noqa: E402
from scale_sim_reads import init_from_model, simulated_resume  # noqa: E402
from scale_sim_step import NoData, step_collectives_quietly  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs/train"
META = torch.device("meta")
CPU = torch.device("cpu")
"""The agreements' tensors: their values are read back on the host."""
NODE_SIZE = 8
"""GCDs per Frontier node: Ray Train's local world size there, so hsdp's shard size S."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A configuration the simulator runs as written, and what it cannot take from the file."""

    config: Path
    num_streams: int
    """Train shards of its data (what its preflight would find)."""
    step_block_size: int
    """The step model's sequence length (scale_sim_step: the step runs 64 wide on CPU)."""


SCENARIOS = {
    "frontier_nebel_512_nodes": Scenario(CONFIGS / "frontier_nebel_512_nodes.yaml", 4096, 32),
    "frontier_nebel_131k": Scenario(CONFIGS / "frontier_nebel_131k.yaml", 512, 128),
}
"""name -> scenario. The 512-node run: 4,096 shards of 4,096-token rows, one per rank at W = 4,096. The 131k run
(context_parallel 8): 512 shards of 131,073-token rows, one per cp group at W = 4,096 (its global batch of 512
rows is a multiple of the shard count); its step model's sequence is 131,072 / 1,024 = 128 tokens, 16 per rank."""
SAVES = (("save_first", 128), ("save", 256), ("save_final", 384))
"""(phase, step) of the saves: the first and a later one (through the configuration's path: the background save
when it saves asynchronously), then the run's last save (always synchronous); resume reads the last."""

ITEMS = {
    "store_ops_startup": "keys the store touches for this rank: process group, mesh, warm-up (counted)",
    "store_requests_rank0_startup": "requests rank 0's store server answers at startup: W x this item's rank's "
                                    "own (modelled: every rank makes the same requests)",
    "process_groups_created_startup": "new_group calls this rank makes, up to its first step: the mesh's, the cp "
                                      "group's, the Checkpointer's background group (counted); each member group "
                                      "of a gloo backend also opens a full mesh: see the README",
    "gloo_connections_background_group_rank0": "connections rank 0 opens in the background save's gloo group "
                                               "(lazy_gloo_group: none at creation): W - 1 at its first save, "
                                               "whose gathers to rank 0 reach every rank (modelled; 0 without "
                                               "asynchronous saves)",
    "collectives_startup": "c10d operations from process group to the first step (counted)",
    "collective_bytes_startup": "bytes those operations deliver to this rank (counted)",
    "peak_model_bytes_startup": "largest model state (parameters, buffers, optimizer state) this rank holds at "
                                "once during startup (counted at every allocation of the model and optimizer)",
    "data_read_amplification": "rows this rank reads per row its cp group trains on (the data order's slices: "
                               "above 1 only with more cp groups than shards, which then share a shard, each "
                               "reading it all)",
    "data_reads_per_batch_row": "times the file system serves each row of the global batch: the above x "
                                "context_parallel (every rank of a cp group reads its group's rows whole and keeps "
                                "its positions)",
    "bytes_read_init_from": "bytes of the safetensors slices this rank requests and the headers of the files it "
                            "opens (counted)",
    "fs_metadata_ops_init_from": "stat/open/list calls of load_initial_weights (counted)",
    "collectives_per_step": "c10d operations of one train_step with all its micro-batches (counted on a model of "
                            "the nebel's depth and 64 wide; with cp, its sequence scaled: Scenario)",
    "store_ops_per_step": "keys the store touches during that train_step (counted)",
    "store_ops_per_hang_watch_poll": "keys the store touches in one poll of the hang watch with nothing in flight "
                                     "(counted: HangWatch.poll, once)",
    "store_requests_rank0_per_s_steady": "requests rank 0's store server answers per second in steady state: W x "
                                         "this rank's per poll / the poll interval (modelled: every rank polls; "
                                         "the steps make none)",
    "dcp_plan_items_rank0_first_save": "write items of the local plans rank 0 receives in DCP's plan exchange at "
                                       "the first save (counted; the other ranks' plans supplied)",
    "dcp_plan_items_rank0_later_save": "the same at a later save: DCP's plan cache sends no unchanged plan (counted)",
    "bytes_written_save": "bytes a rank writes at a later save: its DCP pieces (planned: their sizes) plus its "
                          "small files, the .metadata and the marker (counted)",
    "bytes_staged_save": "bytes a background save copies to host memory, this rank's part of the state (planned: "
                         "the copy is not made; 0 when the configuration saves synchronously)",
    "bytes_written_save_most_of_a_rank": "the most bytes of DCP pieces the save's global plan gives any of the W "
                                         "ranks (planned: rank 0's global plan)",
    "collectives_save": "c10d operations of a later save: DCP's plan exchange and write agreement (on the "
                        "background group when the configuration saves asynchronously), finish_save (counted)",
    "collective_bytes_save": "bytes those operations deliver to this rank (counted)",
    "fs_metadata_ops_save": "stat/open/list calls of a later save (counted)",
    "collectives_save_final": "c10d operations of the run's last save, always synchronous: dcp.save on the "
                              "default group, finish_save (counted)",
    "fs_metadata_ops_save_final": "stat/open/list calls of that save (counted)",
    "fs_metadata_ops_resume_checks": "stat/open/list calls of resume outside the tensors' read: candidates, "
                                     "marker, completeness check, trainer state (counted)",
    "fs_metadata_ops_resume": "stat/open/list calls of resume: the checks, the .metadata and the files of this "
                              "rank's spans of its replica group's bytes and of the values every rank holds "
                              "whole (counted)",
    "bytes_read_resume": "bytes resume reads: marker, trainer state, .metadata and this rank's span (counted) plus "
                         "the archive header of each piece whose data start it reads (planned)",
    "collectives_resume": "c10d operations of resume (counted)",
    "collective_bytes_resume": "bytes those operations deliver to this rank (counted)",
}


# --- one simulated rank ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Setup:
    """What every simulated rank of every world size shares."""

    scenario: Scenario
    cfg: TrainConfig
    plan: RunPlan
    model_cfg: ModelConfig
    shard_size: int
    root: Path
    """A temporary directory: the checkpoints and the released model directory."""
    shapes: dict[str, torch.Size]
    """Every parameter's shape (the released weights' shapes)."""
    local_plans_by_shard: dict = dataclasses.field(default_factory=dict)
    """DCP's local save plan of each shard index (`prime`)."""


def zero_validation_rows(data_dir, order, rank, eval_iters, row_length) -> Rows:
    """Stands in for shard_reader.validation_rows: one row of zeros per validation micro-batch."""
    return Rows(np.zeros((eval_iters, row_length), np.int32), None, np.zeros(eval_iters, np.int64))


@dataclasses.dataclass
class SimulatedContext:
    """Ray Train's worker context (ray.train.get_context()) of one rank: consecutive ranks fill a node."""

    rank: int
    world_size: int
    node_size: int

    def get_world_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.world_size

    def get_node_rank(self) -> int:
        return self.rank // self.node_size

    def get_local_rank(self) -> int:
        return self.rank % self.node_size

    def get_local_world_size(self) -> int:
        return self.node_size

    def node_ip(self) -> str:
        return self.placement(self.rank)["node_ip"]

    def placement(self, rank: int) -> dict:
        """Rank `rank`'s placement as start_worker reports it."""
        node = rank // self.node_size
        return {"node_rank": node, "local_rank": rank % self.node_size, "local_world_size": self.node_size,
                "node_ip": f"10.128.{node // 256}.{node % 256}"}

    def every_placement(self, value, device) -> list[dict]:
        """Stands in for loop's all_ranks of the placements: the all-gather runs (counted), and every rank's
        placement is what it gathers (over the fake group it would gather this rank's W times)."""
        all_ranks(value, device)
        return [self.placement(rank) for rank in range(self.world_size)]


def on_meta(fn, device_index: int):
    """`fn` with its device argument (positional `device_index`) replaced by the meta device: the model's
    tensors and the warm-up's buffer."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        args = list(args)
        args[device_index] = META
        return fn(*args, **kwargs)
    return wrapper


def meta_mesh(counts: Counts, new_groups: Counter):
    """The mesh and autocast of a model on the meta device (FSDP2 takes the mesh's device from a real device type,
    torch.autocast takes none but real ones: the host's; the tensors stay meta), and every new_group call counted
    by phase (init_device_mesh calls new_group by its own name: counted there too, should build_mesh use it); a
    gloo group asked for (the background save's) is made with the fake backend."""
    real_build_mesh, real_new_group, real_autocast = parallel.build_mesh, dist.new_group, torch.autocast

    def counted_new_group(*args, **kwargs):
        new_groups[counts.phase] += 1
        if kwargs.get("backend") == "gloo":  # the background save's group (lazy_gloo_group): over the fake group too
            kwargs["backend"] = "fake"
        return real_new_group(*args, **kwargs)

    def cpu_mesh(shape, device_type):
        return real_build_mesh(shape, "cpu" if device_type == "meta" else device_type)

    def host_autocast(device_type, *args, **kwargs):
        return real_autocast("cpu" if device_type == "meta" else device_type, *args, **kwargs)

    return patched([(dist, "new_group", counted_new_group), (device_mesh, "new_group", counted_new_group),
                    (parallel, "build_mesh", cpu_mesh), (torch, "autocast", host_autocast)])


def start_rank(setup: Setup, world_size: int, rank: int):
    """The worker's startup, loop.train_on_rank up to its steps, over the stand-ins, and what run_steps makes before
    its first step that talks to other ranks: the Checkpointer (with asynchronous saves, its background group).
    Returns the components and the Checkpointer."""
    ctx = SimulatedContext(rank, world_size, setup.shard_size)
    started = {}

    def run_steps(c, cfg, plan, state, val_batch, logger, rank, world_size, device):
        started.update(c=c, checkpointer=ckpt.Checkpointer(cfg.saves_asynchronously, rank, device))

    with patched([(ray.train, "get_context", lambda: ctx), (ray.train, "get_checkpoint", lambda: None),
                  (ray.util, "get_node_ip_address", ctx.node_ip), (loop, "training_device", lambda: CPU),
                  (validation, "validation_rows", zero_validation_rows), (loop, "open_logger", lambda *a: None),
                  (loop, "run_steps", run_steps),
                  (loop, "build_components", on_meta(loop.build_components, 3)), (loop, "all_ranks", ctx.every_placement),
                  (loop, "warmup_allreduce", on_meta(loop.warmup_allreduce, 0)),
                  (parallel, "check_replicas_agree", on_meta(parallel.check_replicas_agree, 3))]):
        loop.train_on_rank(setup.cfg, setup.plan)
    return started["c"], started["checkpointer"]


def simulate_rank(setup: Setup, world_size: int, rank: int, from_rank_zero: FromRankZero) -> dict:
    """Rank `rank` of a `world_size`-rank run, counted: startup, two saves, a resume of the later one, init_from.
    Rank 0 records in `from_rank_zero` what the other simulated rank receives from it."""
    counts = Counts()
    store = CountingStore(counts, world_size)  # held here: the process group keeps no Python reference to it
    new_groups = Counter()
    model_bytes = ModelBytes()
    results = {}
    other_ranks = OtherRanks(world_size, rank, setup.shard_size, setup.local_plans_by_shard, from_rank_zero, counts)
    collectives = CountingCollectives(counts, from_rank_zero.broadcasts, rank)
    try:
        with collectives, background_save_counted(collectives), counting_files(counts), model_bytes.watching(), \
                host_reads_of_meta(), meta_mesh(counts, new_groups), patched([(loop, "ShardReader", NoData)]):
            dist.init_process_group("fake", store=store, rank=rank, world_size=world_size)
            c, checkpointer = start_rank(setup, world_size, rank)
            results["peak_model_bytes_startup"] = model_bytes.peak
            results["data_read_amplification"] = read_amplification(c.order, c.shape.data_rank(rank))
            counts.phase = "steady"
            results["poll_s"] = hang_watch_poll(setup, rank, store)
            with other_ranks.installed():
                for phase, step in SAVES:
                    counts.phase = phase
                    background = None if phase == "save_final" else checkpointer.background_group
                    directory = simulated_save(setup, c, world_size, rank, step, background)
                    if phase == "save":
                        results["most_bytes_of_a_rank"] = other_ranks.most_bytes_of_a_rank()
            counts.phase = "resume"
            results["planned_resume_bytes"] = simulated_resume(c, directory, SAVES[-1][1], rank, counts)
            counts.phase = "init_from"
            init_from_model(setup, world_size, rank, counts)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with uncounted(), open(directory / TRAINING_STATE_DIR / ".metadata", "rb") as f:
        tensors = [md for md in pickle.load(f).state_dict_metadata.values() if isinstance(md, TensorStorageMetadata)]
    return {
        "store_ops_startup": counts.get("startup", "store_ops"),
        "store_requests_rank0_startup": world_size * counts.get("startup", "store_ops"),
        "process_groups_created_startup": new_groups["startup"],
        "gloo_connections_background_group_rank0": world_size - 1 if setup.cfg.saves_asynchronously else 0,
        "collectives_startup": counts.get("startup", "collectives"),
        "collective_bytes_startup": counts.get("startup", "collective_bytes"),
        "peak_model_bytes_startup": results["peak_model_bytes_startup"],
        "data_read_amplification": results["data_read_amplification"],
        "data_reads_per_batch_row": results["data_read_amplification"] * c.shape.context_parallel,
        "store_ops_per_hang_watch_poll": counts.get("steady", "store_ops"),
        "store_requests_rank0_per_s_steady": world_size * counts.get("steady", "store_ops") / results["poll_s"],
        "bytes_read_init_from": counts.get("init_from", "bytes_read"),
        "fs_metadata_ops_init_from": counts.get("init_from", "fs_metadata_ops"),
        "dcp_plan_items_rank0_first_save": counts.get("save_first", "dcp_plan_items"),
        "dcp_plan_items_rank0_later_save": counts.get("save", "dcp_plan_items"),
        "bytes_written_save": counts.get("save", "bytes_written"),
        "bytes_staged_save": counts.get("save", "bytes_staged"),
        "bytes_written_save_most_of_a_rank": results["most_bytes_of_a_rank"],
        "collectives_save": counts.get("save", "collectives"),
        "collective_bytes_save": counts.get("save", "collective_bytes"),
        "fs_metadata_ops_save": counts.get("save", "fs_metadata_ops"),
        "collectives_save_final": counts.get("save_final", "collectives"),
        "fs_metadata_ops_save_final": counts.get("save_final", "fs_metadata_ops"),
        "fs_metadata_ops_resume_checks": counts.get("resume", "fs_metadata_ops"),
        "fs_metadata_ops_resume": sum(counts.get(phase, "fs_metadata_ops") for phase in RESUME),
        "bytes_read_resume": sum(counts.get(phase, "bytes_read") for phase in RESUME)
        + results["planned_resume_bytes"],
        "collectives_resume": sum(counts.get(phase, "collectives") for phase in RESUME),
        "collective_bytes_resume": sum(counts.get(phase, "collective_bytes") for phase in RESUME),
        "state_bytes": sum(md.size.numel() * md.properties.dtype.itemsize for md in tensors),
        "state_tensors": len(tensors),
    }


RESUME = ("resume", "resume_read")
"""resume's phases: its checks, and the tensors' read."""


def read_amplification(order, data_rank: int) -> float:
    """Rows this rank reads per micro-batch (the r rows of every stream its rows touch) over the rows it keeps."""
    slices = order.slices(data_rank)
    return order.rows_per_stream_per_micro_batch * len(slices) / sum(s.stop - s.start for s in slices)


def simulated_save(setup: Setup, c, world_size: int, rank: int, step: int, background_group) -> Path:
    """The save of `step` into the run's directory, as the Checkpointer makes it: start_save (small files, then
    dcp.save, or with the Checkpointer's `background_group` dcp.async_save, whose thread plans and writes over that
    group), then finish_save (waits for the thread; agreement, marker), which the Checkpointer calls at the next
    save: here at once, so that every collective of the save is counted in its own phase. Returns the checkpoint's
    directory."""
    directory = setup.root / "runs" / f"{world_size:06d}" / f"checkpoint_2026-11-25_00-00-{step:06d}"
    state = ckpt.TrainerState(step=step, world_size=world_size, num_streams=setup.plan.num_streams,
                              global_batch_rows=setup.plan.global_batch_rows,
                              rows_per_stream=step * setup.plan.global_batch_rows // setup.plan.num_streams)
    pending = ckpt.start_save(directory, rank, c.model, c.optimizer, state, CPU, background_group)
    assert ckpt.finish_save(pending, CPU), f"the save of step {step} failed on rank {rank}"
    return directory



def hang_watch_poll(setup: Setup, rank: int, store) -> float:
    """One poll of this rank's hang watch (hang_watch.HangWatch.poll, what its thread does every poll interval) with
    nothing in flight; returns its poll interval."""
    watch = hang_watch.HangWatch(setup.root / "runs", setup.cfg.pg_timeout_s, rank, store, "gloo")
    assert not watch.poll(), "the hang watch answered a signal in steady state"
    return watch.poll_s


# --- driver ----------------------------------------------------------------------------------------------

def make_setup(root: Path, scenario: Scenario) -> Setup:
    """The scenario's configuration as written, with the plan its preflight would derive from its shards."""
    cfg = load_config(TrainConfig, scenario.config, ["out_dir=" + str(root / "runs"), "compile=false"])
    model_cfg = cfg_model(cfg)
    schedule_steps = int(cfg.max_tokens) // cfg.world_batch_size // cfg.block_size
    plan = RunPlan(global_batch_rows=cfg.world_batch_size, num_streams=scenario.num_streams,
                   data_dir=cfg.data.data_dir, schedule_steps=schedule_steps, pad_id=0, eos_id=1,
                   precision=cfg.precision, model_config=model_cfg)
    with torch.device("meta"):
        model = RecurrentGPT(model_cfg)
    return Setup(scenario, cfg, plan, model_cfg, NODE_SIZE, root,
                 {key: p.shape for key, p in model.named_parameters()})


def cfg_model(cfg: TrainConfig) -> ModelConfig:
    from huginn_ray.train.init_from import model_config
    return model_config(cfg)


def check_world_sizes(world_sizes: list[int], setup: Setup) -> None:
    """Refuse, before any rank runs, a world the simulation does not plan: more cp groups (ranks without cp) than
    shards (they would share shards, each reading it all: the data order's read amplification, which
    `data_read_amplification` reports, but the simulated figures are not planned for it), or not whole nodes of
    S ranks."""
    cp = setup.cfg.parallelism.context_parallel
    for world_size in world_sizes:
        if world_size // cp > setup.plan.num_streams:
            raise SystemExit(f"--world-sizes: {world_size} ranks ({world_size // cp} data ranks at context_parallel "
                             f"{cp}) but {setup.plan.num_streams} train shards: data ranks beyond the shard count "
                             f"would each read a shared shard whole (about "
                             f"{world_size / cp / setup.plan.num_streams:.1f}x the data reads); not simulated")
        if world_size % setup.shard_size:
            raise SystemExit(f"--world-sizes: {world_size} is not whole nodes of {setup.shard_size} ranks")


def simulate(world_sizes: list[int], scenario: str = "frontier_nebel_512_nodes") -> dict:
    """Every simulated rank runs in a child process of its own (torch's device-mesh and FSDP objects are cached per
    process, and a rank must not see another's): first the local plan of every shard index (what the other ranks
    send in DCP's plan exchange) and every step, then rank 0 of every world size, then its last rank (which
    receives what rank 0 sent)."""
    per_rank: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="huginn_scale_sim_") as tmp:
        setup = make_setup(Path(tmp), SCENARIOS[scenario])
        check_world_sizes(world_sizes, setup)
        ranks = [(world_size, rank) for world_size in world_sizes for rank in sorted({0, world_size - 1})]
        first = in_children([(prime, (setup, shard)) for shard in range(setup.shard_size)]
                            + [(step_collectives_quietly, (setup, world_size, rank)) for world_size, rank in ranks])
        setup.local_plans_by_shard = dict(enumerate(first[:setup.shard_size]))
        steps = dict(zip(ranks, first[setup.shard_size:]))
        from_zero = dict(zip(world_sizes, in_children([(simulate_rank_quietly, (setup, world_size, 0, FromRankZero()))
                                                       for world_size in world_sizes])))
        last = dict(zip([w for w in world_sizes if w > 1],
                        in_children([(simulate_rank_quietly, (setup, w, w - 1, from_zero[w][1]))
                                     for w in world_sizes if w > 1])))
        for world_size in world_sizes:
            results = [from_zero[world_size][0]] + ([last[world_size][0]] if world_size in last else [])
            for result, rank in zip(results, sorted({0, world_size - 1})):
                result["collectives_per_step"], result["store_ops_per_step"] = steps[world_size, rank]
            state_bytes, state_tensors = {(result.pop("state_bytes"), result.pop("state_tensors"))
                                          for result in results}.pop()
            for item in ITEMS:
                per_rank.setdefault(item, []).append(max(result[item] for result in results))
    parameter_bytes = sum(shape.numel() * 4 for shape in setup.shapes.values())
    return {"config": setup.scenario.config.name, "world_sizes": world_sizes, "per_rank": per_rank,
            "sizes": {"state_bytes": state_bytes, "state_tensors": state_tensors, "parameter_bytes": parameter_bytes}}


def in_children(tasks: list, parallel: int = 2) -> list:
    """fn(*args) of every task, each in a child process of its own, `parallel` at a time, results in task order.
    Children fork from a fork server started clean with torch, the training code and this module imported (fast,
    and safe where the caller has threads: a test process that ran Ray before)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "huginn_ray.train.loop", "ray.train", "scale_sim"])
    results, running = [None] * len(tasks), []

    def collect(index, process, receiver):
        try:
            outcome, value = receiver.recv()
        except EOFError:
            outcome, value = "error", f"the child exited with code {process.join() or process.exitcode}"
        process.join()
        if outcome == "error":
            raise RuntimeError(f"simulated rank failed:\n{value}")
        results[index] = value

    for index, (fn, args) in enumerate(tasks):
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(target=run_task, args=(fn, args, sender))
        process.start()
        sender.close()  # the child holds the only sending end: its exit ends the parent's wait
        running.append((index, process, receiver))
        if len(running) == parallel:
            collect(*running.pop(0))
    for task in running:
        collect(*task)
    return results


def run_task(fn, args, sender) -> None:
    try:
        sender.send(("ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        sender.send(("error", traceback.format_exc()))


def prime(setup: Setup, shard: int):
    """DCP's local save plan of shard index `shard` (rank `shard` of a world of one shard group, as the
    coordinator makes it: every value included), from the components build_components gives that rank."""
    store = CountingStore(Counts(), setup.shard_size)
    dist.init_process_group("fake", store=store, rank=shard, world_size=setup.shard_size)
    try:
        with contextlib.redirect_stdout(io.StringIO()), meta_mesh(Counts(), Counter()), \
                patched([(loop, "ShardReader", NoData)]):
            c = loop.build_components(setup.cfg, setup.plan, shard, META, local_world_size=setup.shard_size)
            planner = ckpt.SmallValuesOnRankZero()
            planner.set_up_planner({"model": ckpt.model_state(c.model),
                                    "optim": ckpt.get_optimizer_state_dict(c.model, c.optimizer)}, is_coordinator=True)
            return planner.create_local_plan()
    finally:
        dist.destroy_process_group()


def simulate_rank_quietly(setup: Setup, world_size: int, rank: int,
                          from_rank_zero: FromRankZero) -> tuple[dict, FromRankZero]:
    """One rank's counts, and what it sent (rank 0: what the other rank receives)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return simulate_rank(setup, world_size, rank, from_rank_zero), from_rank_zero


def table(result: dict) -> str:
    sizes = result["world_sizes"]
    lines = [f"{'per rank (max of rank 0 and rank W-1)':<42}" + "".join(f"{'W=' + str(w):>16}" for w in sizes)]
    for item, values in result["per_rank"].items():
        lines.append(f"{item:<42}" + "".join(f"{v:>16,}" for v in values))
    state, parameters = result["sizes"]["state_bytes"], result["sizes"]["parameter_bytes"]
    for item, whole in (("bytes_read_resume", state), ("bytes_read_init_from", parameters)):
        lines.append(f"{item + ' x W / ' + ('state' if whole == state else 'P'):<42}"
                     + "".join(f"{v * w / whole:>16.3f}" for v, w in zip(result["per_rank"][item], sizes)))
    lines.append(f"state (the checkpoint's tensors) {state:,} bytes, P (the parameters, fp32) {parameters:,} bytes")
    lines.append("")
    lines += [f"{item}: {ITEMS[item]}" for item in result["per_rank"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", default="8,64,512,4096")
    parser.add_argument("--config", choices=sorted(SCENARIOS), action="append",
                        help="the configuration to simulate (repeatable; default: every one, in turn)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object, configuration name -> its figures, instead of the tables")
    args = parser.parse_args()
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    results = {}
    for name in args.config or SCENARIOS:
        start = time.perf_counter()
        results[name] = simulate(world_sizes, name)
        if not args.json:
            print(f"{name} ({SCENARIOS[name].config.name}, shard size {NODE_SIZE})\n{table(results[name])}\n"
                  f"{time.perf_counter() - start:.0f} s\n")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()