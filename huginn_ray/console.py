"""A console a person can read: the project's own lines on stdout, Ray's own INFO/WARNING lines in Ray's log files.

Jobs reach Ray through `huginn_ray.cluster.local_ray.connect_ray`, after `local_ray_environment()` before
`import ray` where they can (jobs/train.py). A private local Ray is started in the process by `init_local_ray`
(data and evaluation jobs: `quiet_local_ray` and `local_ray_init_kwargs`) or as a `LocalRayHead` in a session of
its own (training and serving: `quiet_local_ray` for the head's processes, `ray_connect_kwargs` for the driver). What it configures, and why each line used to appear:

- `RAY_AUTH_MODE=token` explicitly: Ray 2.5x enables token authentication for a new local cluster by default
  and warns that it did so; setting the mode explicitly keeps the safe default without the warning.
- `_node_ip_address=127.0.0.1` and `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`: otherwise Ray finds the node's
  address by "connecting" a UDP socket to 8.8.8.8 / 2001:4860:4860::8888 and warns when there is no route
  (private namespaces, offline nodes).
- the dashboard on 127.0.0.1: Ray Train's placement-group cleaner asks the state API, which the dashboard
  serves, whether the Train controller is alive every two seconds; without the dashboard every check failed
  with "Failed to query Ray Train Controller actor state".
- `RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0`: the watcher polls for cloud spot-instance preemption, which a local
  (or Slurm) cluster does not have.
- `TORCH_CPP_LOG_LEVEL=ERROR`: c10d's warnings about hostnames it cannot resolve in a private namespace.
- Ray's Python loggers at ERROR in the driver and in every Ray process (`logging_config`), and Ray Train's
  controller/worker console logging at ERROR (`run_training(..., ray_train_log_level=...)`; the training workers
  also set their root logger to that level, because Ray Train logs "Reporting training result" at every
  checkpoint through a logger named by its file path, outside `ray.train`), so INFO/WARNING
  lines go only to the session's log files (under the Ray temp dir, logs/). Errors, tracebacks of failed
  workers and Ray Train's failure reports still reach the console in full.

`verbose=True` keeps Ray's defaults for logging (the environment settings above still apply).
"""

from __future__ import annotations

import logging
import os
import re

QUIET_ENV = {
    "RAY_AUTH_MODE": "token",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_DISABLE_USAGE_STATS": "1",
    # Ray's Python side takes the loopback address as the node's address instead of probing 8.8.8.8 (a
    # one-node Ray started by a job; the name of the switch is about Windows/macOS, where it is the default)
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    # Ray Train's print patch sends each worker line both to its logger and to stdout (lines twice)
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
}


def local_ray_environment() -> None:
    """Set the environment a local Ray (and its workers, which inherit it) starts with; explicit settings win.

    Call it before `import ray`: Ray reads RAY_AUTH_MODE when it is imported, and a driver that read another
    mode than the GCS it starts cannot connect to it."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)


def quiet_local_ray(verbose: bool = False) -> None:
    """Ray's loggers in this process at ERROR, and c10d's C++ warnings off in the workers, unless verbose."""
    local_ray_environment()
    if not verbose:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        for name in ("ray", "ray.train", "ray.data", "ray.tune"):
            logging.getLogger(name).setLevel(logging.ERROR)
        logging.getLogger("mlflow").setLevel(logging.WARNING)  # "Creating initial MLflow database tables..."


def local_ray_init_kwargs(verbose: bool = False, dashboard: bool = True) -> dict:
    """Keyword arguments of `ray.init` for a local single-node Ray started by a job. Jobs without Ray Train
    (data preparation, evaluation) need no dashboard: nothing queries the state API there."""
    return dict(include_dashboard=dashboard, dashboard_host="127.0.0.1", _node_ip_address="127.0.0.1",
                **ray_connect_kwargs(verbose))


def ray_connect_kwargs(verbose: bool = False) -> dict:
    """Keyword arguments of `ray.init` for this job's console, also when it connects to a running Ray."""
    import ray

    kwargs = dict(log_to_driver=True)  # the workers' own lines (progress, errors) reach the console
    if not verbose:
        kwargs["logging_level"] = logging.ERROR
        kwargs["logging_config"] = ray.LoggingConfig(encoding="TEXT", log_level="ERROR")
    return kwargs


def summary_line(metrics: dict) -> str:
    """The final line of a training run, from the metrics of its last checkpoint as Ray Train reports them."""
    parts = []
    if "step" in metrics:
        parts.append(f"step {metrics['step']}")
    if "loss" in metrics:
        parts.append(f"loss {metrics['loss']:.4f}")
    if "tokens" in metrics:
        parts.append(f"{metrics['tokens']:,} tokens")
    return ("final: " + ", ".join(parts)) if parts else ""


_EXCEPTION_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Timeout|Interrupt)): ?(.*)$")
_RANKS = re.compile(r"\[(Rank[^\]]*) Error Snippet\]")


def failure_line(error: BaseException) -> str:
    """One line for a failed run after Ray's full report: which ranks failed and the last exception they raised
    (Ray Train's WorkerGroupError carries every rank's traceback snippet; its last exception line is the cause)."""
    text = str(error)
    causes = [m for line in text.splitlines() if (m := _EXCEPTION_LINE.match(line))]
    if causes:
        cause = f"{causes[-1].group(1)}: {causes[-1].group(2)}"
    else:
        cause = f"{type(error).__name__}: {next((line.strip() for line in text.splitlines() if line.strip()), '')}"
    ranks = _RANKS.search(text)
    return (f"{ranks.group(1).lower()}: " if ranks else "") + cause[:300]
