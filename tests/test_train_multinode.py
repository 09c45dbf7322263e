"""Training on a Ray cluster of several real Ray nodes on this machine, through jobs/train.py.

`ray.cluster_utils.Cluster` starts a head node (127.0.0.1, no CPUs: it hosts the driver and Ray Train's
controller) and two raylets, each its own Ray node with 2 CPUs at its own loopback address (127.0.0.2 and
127.0.0.3). Ray Train numbers nodes by address, so node ranks, local ranks and the local world size (the shard
size of `hsdp`) come from Ray itself, not from any override.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from isolation import MlflowServer, private_namespace_problem
from test_train_data import make_dataset
from test_train_ray import REPO, env, losses, run_id_of, times_logged

pytestmark = pytest.mark.slow
NODE_ADDRESSES = ("127.0.0.2", "127.0.0.3")
CPUS_PER_NODE = 2


@pytest.fixture(scope="module")
def nodes():
    """A head node and one raylet per NODE_ADDRESSES; yields (cluster, {address: node})."""
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
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1"})
        try:
            raylets = {address: cluster.add_node(num_cpus=CPUS_PER_NODE, node_ip_address=address)
                       for address in NODE_ADDRESSES}
            cluster.wait_for_nodes()
            yield cluster, raylets
        finally:
            cluster.shutdown()  # the processes this cluster started; never a machine-wide `ray stop`
            shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow_server"), env=env()).start()
    try:
        yield server.uri
    finally:
        server.stop()


def overrides(name, out_dir, dataset, mlflow_uri, *extra):
    data_dir, tokenizer = dataset
    return [
        f"run_name={name}", f"out_dir={out_dir}", f"data.data_dir={data_dir}", f"data.tokenizer_path={tokenizer}",
        f"mlflow.tracking_uri={mlflow_uri}", "block_size=32", "model.overrides.vocab_size=64",
        "micro_batch_size=2", "log_step_interval=1", "eval_step_interval=100", "eval_depths=[4]",
        "warmup_allreduce_mib=1", "optim.lr=3e-3", "schedule.warmup_steps=3", "schedule.cooldown_steps=0",
        "pg_timeout_s=60", "parallelism.mode=hsdp", *extra,
    ]


def test_hsdp_shard_groups_are_ray_s_nodes(nodes, mlflow_server, tmp_path):
    """4 workers on two 2-CPU Ray nodes: Ray Train puts ranks 0-1 on one node and 2-3 on the other, and hsdp's
    shard groups (shard size 0: the local world size Ray reports) are those nodes."""
    cluster, _ = nodes
    dataset = make_dataset(tmp_path / "data", num_shards=4, rows_per_shard=64, seq_len=32)
    args = overrides("nodes", tmp_path / "runs", dataset, mlflow_server, "max_steps=4", "scaling.num_workers=4",
                     "checkpoint.save_step_interval=4")
    run = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "train.py"), "--config", str(REPO / "configs/train/tiny_cpu.yaml"),
         *args], env={**env(), "RAY_ADDRESS": cluster.address}, capture_output=True, text=True, timeout=300, cwd=REPO)
    console = run.stdout + run.stderr
    assert run.returncode == 0, console[-5000:]
    assert ("[huginn] 4 workers on 2 node(s): node 0 (127.0.0.2) ranks 0-1, node 1 (127.0.0.3) ranks 2-3; "
            "hsdp: 2 shard group(s) of 2 ranks") in run.stdout, console[-5000:]
    checkpoint = next((tmp_path / "runs" / "nodes").glob("checkpoint_*"))
    assert json.loads((checkpoint / "trainer_state.json").read_text())["layout"] == "hsdp, shard_size 2"
    assert sorted(p.name for p in (checkpoint / "state").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert sorted(losses(mlflow_server, run_id_of(run.stdout))) == [1, 2, 3, 4]
