"""Training on a Ray cluster of several real Ray nodes on this machine, through jobs/train.py.

`ray.cluster_utils.Cluster` starts two Ray nodes with 2 CPUs each, each at its own loopback address: the head
(127.0.0.1, where the driver and Ray Train's controller run) and a raylet at 127.0.0.2. Ray Train tells nodes
apart by address and numbers the ranks node by node (the nodes in the order their workers were placed), so node
ranks, local ranks and the local world size (the shard size of `hsdp`) come from Ray itself, not from any
override.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from huginn_ray.train.tracking import tracking_uri
from isolation import private_namespace_problem
from test_train_data import make_dataset
from test_train_ray import REPO, env, run_id_of, times_logged

pytestmark = pytest.mark.slow
HEAD, WORKER_NODE = "127.0.0.1", "127.0.0.2"
CPUS_PER_NODE = 2
STEPS = 8


@pytest.fixture(scope="module")
def nodes():
    """The head and one more Ray node; yields (cluster, the second node)."""
    problem = private_namespace_problem()
    if problem:
        pytest.skip(f"starts Ray nodes that must stay private: {problem}")
    from ray.cluster_utils import Cluster

    # a short private temp dir: Cluster writes its address file and sessions under $RAY_TMPDIR/ray, and other
    # Ray instances may share /tmp/ray
    temp_dir = tempfile.mkdtemp(prefix="hr_", dir="/tmp")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {**env(), "RAY_TMPDIR": temp_dir}.items():
            patch.setenv(key, value)
        cluster = Cluster(initialize_head=True,
                          head_node_args={"num_cpus": CPUS_PER_NODE, "node_ip_address": HEAD})
        try:
            second = cluster.add_node(num_cpus=CPUS_PER_NODE, node_ip_address=WORKER_NODE)
            cluster.wait_for_nodes()
            yield cluster, second
        finally:
            cluster.shutdown()  # the processes this cluster started; never a machine-wide `ray stop`
            shutil.rmtree(temp_dir, ignore_errors=True)


def overrides(name, out_dir, dataset, *extra):
    """The run's MLflow store is the embedded SQLite one under out_dir (rank 0 runs on this machine too)."""
    data_dir, tokenizer = dataset
    return [
        f"run_name={name}", f"out_dir={out_dir}", f"data.data_dir={data_dir}", f"data.tokenizer_path={tokenizer}",
        "block_size=32", "model.overrides.vocab_size=64",
        "micro_batch_size=2", "log_step_interval=1", "eval_step_interval=100", "eval_depths=[4]",
        "warmup_allreduce_mib=1", "optim.lr=3e-3", "schedule.warmup_steps=3", "schedule.cooldown_steps=0",
        "pg_timeout_s=60", "parallelism.mode=hsdp", *extra,
    ]


def test_hsdp_over_ray_s_nodes_loses_a_node_and_finishes_on_the_rest(nodes, tmp_path):
    """`scaling.num_workers: [2, 4]` under hsdp on two 2-CPU Ray nodes: Ray Train puts two ranks on each node and
    hsdp's shard groups (Ray's local world size) are the nodes. After the step-4 checkpoint rank 1 stops answering
    (fault injection: the group is frozen at step 5's first collective) and the test removes the second Ray node
    for good. Ray Train restarts the group on the 2 workers it can get, one shard group on the head node, from the
    step-4 checkpoint; the run ends at max_steps, in one MLflow run, and says `resize at step 4: 4 -> 2 workers`.
    Then a node takes the lost one's place and 4 gloo ranks, 2 on each node, read the step-4 checkpoint back both
    ways: the replica-spread read gives the bits of today's path (every rank reading its whole part)."""
    cluster, second = nodes
    out_dir = tmp_path / "runs"
    dataset = make_dataset(tmp_path / "data", num_shards=4, rows_per_shard=64, seq_len=32)
    args = overrides("elastic", out_dir, dataset, f"max_steps={STEPS}", "scaling.num_workers=[2, 4]",
                     "checkpoint.save_step_interval=4", "checkpoint.keep=3", "max_failures=1",
                     "fault_injection.hang_rank_at_step=4", "fault_injection.hang_rank=1")
    console_path = tmp_path / "console.txt"
    with open(console_path, "w") as console_file:
        # the restart first asks for the 4 workers that Ray's view of the cluster (refreshed every 20 s) may still
        # count; a short wait for their placement group lets it retry sooner (Ray Train passes the variable on)
        driver = subprocess.Popen(
            [sys.executable, str(REPO / "jobs" / "train.py"), "--config", str(REPO / "configs/train/tiny_cpu.yaml"),
             *args], env={**env(), "RAY_ADDRESS": cluster.address, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "2"},
            stdout=console_file, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        try:
            # the group is frozen at step 5 and the step-4 checkpoint is complete (the ranks upload their parts
            # in the background): now the node goes
            deadline = time.monotonic() + 240
            while not (step_4_saved(out_dir / "elastic") and (out_dir / "elastic" / "fault_injected_rank1_step4").exists()):
                assert driver.poll() is None and time.monotonic() < deadline, console_path.read_text()[-5000:]
                time.sleep(0.2)
            cluster.remove_node(second, allow_graceful=False)
            driver.wait(timeout=240)
        finally:
            driver.kill()
    console = console_path.read_text()
    assert driver.returncode == 0, console[-5000:]
    # before: two ranks on each of Ray's nodes (in the order Ray placed them), one shard group each
    before = re.search(r"\[huginn\] 4 workers on 2 node\(s\): node 0 \((\S+)\) ranks 0-1, node 1 \((\S+)\) ranks 2-3; "
                       r"hsdp: 2 shard group\(s\) of 2 ranks$", console, re.M)
    assert before and sorted(before.groups()) == [HEAD, WORKER_NODE], console[-5000:]
    saved = {state["step"]: (directory, state) for directory, state in registered_checkpoints(out_dir / "elastic")}
    assert sorted((step, state["world_size"], state["layout"]) for step, (_, state) in saved.items()) == \
        [(4, 4, "hsdp, shard_size 2"), (STEPS, 2, "hsdp, shard_size 2")]
    assert sorted(p.name for p in (saved[4][0] / "state").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    # after: the survivors, one shard group on the head node, resumed from step 4
    assert "[huginn] resize at step 4: 4 -> 2 workers" in console, console[-5000:]
    assert (f"[huginn] 2 workers on 1 node(s): node 0 ({HEAD}) ranks 0-1; hsdp: 1 shard group(s) of 2 ranks"
            in console), console[-5000:]
    assert f"[huginn] finished at step {STEPS}" in console
    # one MLflow run, every step logged, steps 1-4 once (the restart went on from the step-4 checkpoint)
    mlflow_uri = tracking_uri(None, str(out_dir))
    client = MlflowClient(mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("huginn_ray").experiment_id],
                              filter_string="attributes.run_name = 'elastic'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED" and runs[0].info.run_id == run_id_of(console)
    counts = times_logged(mlflow_uri, runs[0].info.run_id)
    assert sorted(counts) == list(range(1, STEPS + 1)) and all(counts[s] == 1 for s in range(1, 5)), counts
    workers = [(m.step, m.value) for m in sorted(client.get_metric_history(runs[0].info.run_id, "num_workers"),
                                                  key=lambda m: m.timestamp)]
    assert workers == [(0, 4.0), (4, 2.0)]
    # the step-4 checkpoint read back by 4 gloo ranks as 2 Ray nodes x 2, both ways (a node takes the lost one's
    # place): through the replica-spread read each rank reads its half of its shard group's part and gets the
    # other half from its replica on the other node; today's path (every rank reading its whole part) gives the
    # same bits
    cluster.add_node(num_cpus=CPUS_PER_NODE, node_ip_address=WORKER_NODE)
    cluster.wait_for_nodes()
    reports = read_back_on_two_nodes(cluster, saved[4][0], args)
    assert sorted(report["node_ip"] for report in reports) == [HEAD, HEAD, WORKER_NODE, WORKER_NODE]
    for rank, report in enumerate(reports):
        assert report["tensors"] > 0 and report["differing"] == [], (rank, report)
        # hsdp: shard groups of 2 (the nodes), 2 replicas of each part: half of the whole part's bytes, about
        assert 0.4 * report["read_whole"] <= report["read_spread"] <= 0.6 * report["read_whole"], (rank, report)


def read_back_on_two_nodes(cluster, checkpoint: Path, args: list[str]) -> list[dict]:
    """Ranks 0-1 on the head node and 2-3 on the other, one gloo group of 4: each reads `checkpoint` into the
    run's model and optimizer (hsdp, the shard groups the nodes) by `read_both_ways`; their reports, by rank."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}})
    try:
        nodes = sorted((node["NodeManagerAddress"], node["NodeID"]) for node in ray.nodes() if node["Alive"])
        assert [ip for ip, _ in nodes] == [HEAD, WORKER_NODE], nodes
        with socket.socket() as s:
            s.bind((HEAD, 0))
            port = s.getsockname()[1]
        reader = ray.remote(num_cpus=1)(read_both_ways)
        return ray.get([reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[rank // 2][1],
                                                                                           soft=False))
                        .remote(rank, port, str(checkpoint), args) for rank in range(4)], timeout=120)
    finally:
        ray.shutdown()


def read_both_ways(rank: int, port: int, checkpoint: str, args: list[str]) -> dict:
    """One of 4 gloo ranks (a Ray task): build the run's model and optimizer as the loop does (without their
    init), read `checkpoint` into them with today's path (replicas=None) and into another pair through the
    replica-spread read (the mesh's replicate group), and compare every local tensor (torch.equal)."""
    from datetime import timedelta

    import ray
    import torch
    import torch.distributed as dist

    from huginn_ray.config import load_config
    from huginn_ray.train.replica_read import counting_reads
    from huginn_ray.train import checkpoint as ckpt
    from huginn_ray.train import loop
    from huginn_ray.train.config import TrainConfig
    from huginn_ray.train.init_from import model_config
    from huginn_ray.train.parallel import local
    from huginn_ray.train.run_plan import RunPlan
    from test_train_parallel import MemoryReader

    dist.init_process_group("gloo", init_method=f"tcp://{HEAD}:{port}", rank=rank, world_size=4,
                            timeout=timedelta(seconds=60))
    try:
        cfg = load_config(TrainConfig, REPO / "configs/train/tiny_cpu.yaml", args)
        plan = RunPlan(global_batch_rows=cfg.micro_batch_size * 4, num_streams=4, data_dir=cfg.data.data_dir,
                       schedule_steps=STEPS, pad_id=0, eos_id=1, precision="fp32", model_config=model_config(cfg))
        loop.ShardReader = MemoryReader
        loaded, reads = [], []
        for replicas in (None, "replicate"):
            c = loop.build_components(cfg, plan, rank, torch.device("cpu"), local_world_size=2, initialise=False)
            with counting_reads() as count:
                ckpt.read_tensors(Path(checkpoint), c.model, c.optimizer,
                                  c.mesh.get_group(replicas) if replicas else None)
            reads.append(count.bytes)
            names = {p: name for name, p in c.model.named_parameters()}
            tensors = {name: local(p.detach()).clone() for name, p in c.model.named_parameters()}
            for p, values in c.optimizer.state.items():
                tensors.update({f"{key} of {names[p]}": local(v).clone() for key, v in values.items()
                                if torch.is_tensor(v)})
            loaded.append(tensors)
        whole, spread = loaded
        differing = sorted(set(whole) ^ set(spread)) + [k for k in whole if k in spread
                                                         and not torch.equal(whole[k], spread[k])]
        return {"node_ip": ray.util.get_node_ip_address(), "tensors": len(whole), "differing": differing,
                "read_whole": reads[0], "read_spread": reads[1]}
    finally:
        dist.destroy_process_group()


def registered_checkpoints(run_dir: Path) -> list[tuple[Path, dict]]:
    """The complete checkpoints Ray Train holds for a run: (directory, trainer state)."""
    from huginn_ray.train.checkpoint import incomplete

    return [(p.parent, json.loads(p.read_text())) for p in sorted(run_dir.glob("checkpoint_*/trainer_state.json"))
            if incomplete(p.parent) is None]


def step_4_saved(run_dir: Path) -> bool:
    return any(state["step"] == 4 for _, state in registered_checkpoints(run_dir))
