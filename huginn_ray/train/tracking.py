"""MLflow: one MLflow run per training run, continued across worker restarts and reruns (resumes).

The driver opens the run (`open_run`) before the workers start: it looks for a run tagged with this training
run's directory and reuses it, else creates one and logs the resolved config as params. Rank 0 logs metrics
to it (`MetricsLogger`); the driver marks it FINISHED or FAILED at the end. The run id also goes into every
checkpoint.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from huginn_ray.config import flatten, to_dict

RUN_DIR_TAG = "huginn.run_dir"
SECRET_KEY = re.compile(r"(^|_)(token|secret|password|key)$")  # hf_token, api_key; not tokenizer_path


def tracking_uri(configured: str | None, out_dir: str) -> str:
    """Config, then $MLFLOW_TRACKING_URI, then an embedded SQLite store under out_dir/mlflow."""
    if configured:
        return configured
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(out_dir).resolve() / 'mlflow' / 'mlflow.db'}"


def artifact_root(out_dir: str) -> str:
    return (Path(out_dir).resolve() / "mlflow" / "artifacts").as_uri()


def loggable_params(cfg) -> dict[str, str]:
    """The resolved config, flattened, with anything that looks like a secret left out; MLflow caps values."""
    params = {}
    for key, value in flatten(to_dict(cfg)).items():
        if SECRET_KEY.search(key.lower().rsplit(".", 1)[-1]):
            continue
        params[key] = str(value)[:6000]
    return params


def open_run(cfg, uri: str, run_dir: str) -> str:
    """The MLflow run id of this training run: the existing one for run_dir, else a new one with params."""
    if uri.startswith("sqlite:"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(cfg.mlflow.experiment)
    if experiment is None:
        location = artifact_root(cfg.out_dir) if uri.startswith("sqlite:") else None
        experiment_id = client.create_experiment(cfg.mlflow.experiment, artifact_location=location)
    else:
        experiment_id = experiment.experiment_id
    existing = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_DIR_TAG}` = '{run_dir}'", max_results=1)
    if existing:
        run_id = existing[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        return run_id
    run = client.create_run(experiment_id, run_name=cfg.run_name, tags={RUN_DIR_TAG: run_dir})
    params = [Param(k, v) for k, v in loggable_params(cfg).items()]
    for start in range(0, len(params), 100):
        client.log_batch(run.info.run_id, params=params[start : start + 100])
    return run.info.run_id


def close_run(uri: str, run_id: str, ok: bool) -> None:
    MlflowClient(uri).set_terminated(run_id, status="FINISHED" if ok else "FAILED")


class MetricsLogger:
    """Rank 0's metric sink."""

    def __init__(self, uri: str, run_id: str):
        self.client = MlflowClient(uri)
        self.run_id = run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for start in range(0, len(batch), 500):
            self.client.log_batch(self.run_id, metrics=batch[start : start + 500])
