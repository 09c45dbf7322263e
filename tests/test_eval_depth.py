"""Depth-scaling evaluation: Ray tasks over the validation shards, table, CSV, plot, MLflow."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from huginn_ray.data.tokenizer import special_token_ids, train_tokenizer
from huginn_ray.eval.batch_inference import DepthLossReplica, Replicas
from huginn_ray.eval.validation_rows import read_validation_rows
from huginn_ray.eval.depth_scaling import validation_plot
from huginn_ray.model import ModelConfig, RecurrentGPT, save_pretrained

REPO = Path(__file__).resolve().parents[1]


def write_shards(data_dir: Path, shards: int, rows: int, length: int, pad: int) -> None:
    rng = np.random.default_rng(0)
    for rank in range(shards):
        ids = rng.integers(0, 4000, size=(rows, length))
        ids[0, -5:] = pad  # some padding, which the loss ignores
        (data_dir / "val").mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"input_ids": pa.array(list(ids), type=pa.list_(pa.int32()))}),
                       data_dir / "val" / f"{rank:05d}.parquet")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("depth")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_tokenizer([p.read_text() for p in sorted((stdlib / "json").glob("*.py"))], 4096, root / "data" / "tokenizer")
    ids = special_token_ids(root / "data" / "tokenizer")
    write_shards(root / "data" / "shards", shards=2, rows=3, length=33, pad=ids["pad"])
    torch.manual_seed(0)
    save_pretrained(RecurrentGPT(ModelConfig.from_name("raven-tiny")), root / "ckpt" / "model")
    return root, ids


@pytest.mark.slow
def test_depth_scaling_job_writes_table_csv_plot_and_mlflow(setup):
    root, ids = setup
    out = root / "eval"
    result = subprocess.run(
        [sys.executable, "jobs/evaluate.py", "--checkpoint", str(root / "ckpt"), "--data-dir",
         str(root / "data" / "shards"), "--out", str(out), "--depths", "1,2,4", "--max-rows", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FLOPs/token" in result.stdout
    rows = list(csv.DictReader((out / "depth_scaling.csv").open()))
    assert [int(r["depth"]) for r in rows] == [1, 2, 4]
    assert (out / "depth_scaling.png").stat().st_size > 1000
    # the same numbers computed here, by one replica called directly on all rows at once (no Ray)
    shards = sorted(str(p) for p in (root / "data" / "shards" / "val").glob("*.parquet"))
    keys, val_rows = read_validation_rows(shards, 2)
    assert keys.tolist() == [0, 1, 2**32, 2**32 + 1]  # shard x 2^32 + row: training's validation keys
    replica = DepthLossReplica(str(root / "ckpt" / "model"), [1, 2, 4], Replicas(1, "cpu", "float32"), 233,
                               ids["pad"], ids["eos"])
    direct = replica({"key": keys, "input_ids": val_rows})
    for i, row in enumerate(rows):
        assert float(row["loss"]) == pytest.approx(direct["loss_sums"][:, i].sum() / direct["tokens"].sum(), rel=1e-5)
        assert int(row["tokens"]) == 2 * 2 * 32 - 2 * 5  # 2 shards x 2 rows x 32 labels, 5 pads per shard
    # metrics and both files in a new MLflow run (the checkpoint has none)
    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"sqlite:///{out / 'mlflow' / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("huginn-eval").experiment_id])[0]
    assert run.data.metrics["eval/loss_depth_4"] == pytest.approx(float(rows[2]["loss"]), rel=1e-9)
    assert {a.path for a in client.list_artifacts(run.info.run_id, "depth_scaling")} == {
        "depth_scaling/depth_scaling.csv", "depth_scaling/depth_scaling.png"}


def test_validation_plot_is_drawn_and_uploaded_by_the_logger_s_thread_not_the_step_loop(tmp_path, capsys):
    """Training's validation plot: the step loop only enqueues it (MetricsLogger.log_drawn_artifact); matplotlib
    runs on the logger's drawing thread. A draw that fails or has nothing to show logs nothing and raises nowhere."""
    import threading

    from mlflow.tracking import MlflowClient

    from huginn_ray.train.tracking import MetricsLogger
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("t", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    metrics = {"val_loss_1": 5.0, "val_loss_4": 4.5, "val_loss_32": 4.4, "val_loss": 4.4, "val_ppl_4": math.exp(4.5)}
    drawn_on = []

    def draw(directory):
        drawn_on.append(threading.current_thread().name)
        return validation_plot(metrics, 25, 4, directory)

    def fails(directory):
        raise RuntimeError("no display")

    logger = MetricsLogger(uri, run_id)
    logger.log_drawn_artifact("plot of step 24", fails, "depth_scaling")
    logger.log_drawn_artifact("plot of step 25", draw, "depth_scaling")
    logger.log_drawn_artifact("plot of step 26", lambda d: validation_plot({"val_loss_1": 5.0}, 26, 4, d),
                              "depth_scaling")  # one depth: nothing to draw
    logger.close()
    assert drawn_on == ["huginn-mlflow-drawer"]
    assert [a.path for a in client.list_artifacts(run_id, "depth_scaling")] == ["depth_scaling/step_000025.png"]
    assert "[huginn] warning: plot of step 24 not logged: RuntimeError: no display" in capsys.readouterr().out
