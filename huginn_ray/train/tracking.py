"""MLflow: one MLflow run per training run, continued across worker restarts and reruns (resumes).

The driver opens the run (`open_run`) before the workers start: it looks for a run tagged with this training
run's directory and reuses it, else creates one and logs the resolved config as params (secrets left out,
credentials in URIs redacted). Rank 0 logs metrics to it through `MetricsLogger`, which never blocks or raises:
a background thread sends, retries while the server is down or slow, and drops the oldest values (with one
warning saying how many) only when its bounded buffer is full. The driver marks the run FINISHED, FAILED or
KILLED at the end. The run id also goes into every checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from huginn_ray.config import flatten, to_dict
from huginn_ray.redact import redact, redact_uri  # noqa: F401 - also this module's API
from huginn_ray.train.run_plan import WeightsSource

RUN_DIR_TAG = "huginn.run_dir"
SECRET_KEY = re.compile(r"(^|_)(token|secret|password|key)$")  # hf_token, api_key; not tokenizer_path


def tracking_uri(configured: str | None, out_dir: str) -> str:
    """Config, then $MLFLOW_TRACKING_URI, then an embedded SQLite store under out_dir/mlflow (a local out_dir:
    load_train_config refuses one in a bucket without a tracking URI)."""
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
        params[key] = redact(str(value))[:6000]
    return params


def open_run(cfg, uri: str, run_dir: str, init_source: WeightsSource | None = None) -> str:
    """The MLflow run id of this training run: the existing one for run_dir, else a new one with params (and,
    for a run that starts from a trained model, `init_from.path`, `init_from.hashed`, `init_from.sha256`:
    huginn_ray.train.init_from.describe_source)."""
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
    source = dataclasses.asdict(init_source) if init_source is not None else {}
    params = {**loggable_params(cfg), **{f"init_from.{k}": v for k, v in source.items()}}
    params = [Param(k, v) for k, v in params.items()]
    for start in range(0, len(params), 100):
        client.log_batch(run.info.run_id, params=params[start : start + 100])
    return run.info.run_id


def close_run(uri: str, run_id: str, status: str, attempts: int = 5) -> None:
    """Mark the run FINISHED, FAILED or KILLED. A tracking outage at this moment is reported, never raised: the
    training result does not depend on it (and a rerun sets the run RUNNING again)."""
    assert status in ("FINISHED", "FAILED", "KILLED"), status
    for attempt in range(attempts):
        try:
            MlflowClient(uri).set_terminated(run_id, status=status)
            return
        except Exception as err:  # noqa: BLE001 - any client error: the server is down, slow or refusing
            if attempt == attempts - 1:
                print(f"[huginn] warning: could not mark MLflow run {run_id} {status} at {redact_uri(uri)}: "
                      f"{type(err).__name__}: {redact(str(err))[:300]}", flush=True)
                return
            time.sleep(min(2.0**attempt, 10.0))


_LOGGERS: list["MetricsLogger"] = []


def close_loggers(timeout_s: float | None = None) -> None:
    """Flush and stop every MetricsLogger of this process (the training function's last act on rank 0)."""
    while _LOGGERS:
        _LOGGERS.pop().close(timeout_s)


@dataclass
class _Artifact:
    """A file waiting to be uploaded: `file` is the sender's own copy, or None until `draw` has made it."""

    name: str
    """What the warnings call it: the caller's path, or the file a `draw` makes."""
    artifact_path: str | None
    """The run's artifact directory it goes to."""
    file: str | None
    """The file to upload, in the logger's spool."""
    draw: Callable[[Path], Path | None] | None = None
    """Makes the file in the directory it is given (on the sender thread: a plot is drawn off the step loop);
    None when the file exists already."""


class MetricsLogger:
    """Rank 0's metric sink. `log`, `set_tag`, `log_artifact` and `log_drawn_artifact` only enqueue: they never
    block on the server and never raise, so a tracking outage cannot stop training, and drawing a plot costs the
    step loop nothing (a drawing thread of its own makes the file, so that metrics keep flowing meanwhile: a worker
    that dies soon after a validation still has its last steps' metrics sent).

    A background thread sends the queue in order, in batches of up to 1000 values, with MLflow's own HTTP
    retries off and a short request timeout; on failure it retries with backoff (up to `max_backoff_s`) until the
    server answers again, then flushes everything buffered. When more than `max_pending` values wait, the
    oldest are dropped; one warning per outage says how many were dropped (printed when sending resumes, or at
    close). `close` waits up to `flush_timeout_s` for the queue to drain and names what could not be sent.
    """

    BATCH = 1000  # MLflow's limit of metrics per log_batch
    TAG_BATCH = 100  # and of tags

    def __init__(self, uri: str, run_id: str, max_pending: int = 100_000, flush_timeout_s: float = 60.0,
                 request_timeout_s: float = 10.0, max_backoff_s: float = 30.0, max_pending_artifacts: int = 64):
        # Read by MLflow's REST client at every request: without this a down server blocks the sender for minutes
        # inside MLflow's own retries (the sender retries by itself, and nothing waits for it).
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(max(1, request_timeout_s))))
        self.uri, self.run_id = uri, run_id
        self.client = MlflowClient(uri)
        self.max_pending, self.flush_timeout_s, self.max_backoff_s = max_pending, flush_timeout_s, max_backoff_s
        self.max_pending_artifacts = max_pending_artifacts
        self._queue: deque[list[Metric | RunTag]] = deque()
        self._artifacts: deque[_Artifact] = deque()  # files ready to upload
        self._draws: deque[_Artifact] = deque()  # waiting for the drawing thread
        self._drawing = False
        self._pending = 0
        self._inflight: list[Metric] | None = None
        self._dropped = 0  # in the current outage, not yet reported
        self.dropped_total = 0
        self.sent_total = 0
        self._failing_since: float | None = None
        self._closing = False
        self._cond = threading.Condition()
        self._spool = tempfile.mkdtemp(prefix="huginn_artifacts_")
        self._thread = threading.Thread(target=self._send_loop, name="huginn-mlflow-sender", daemon=True)
        self._thread.start()
        self._drawer = threading.Thread(target=self._draw_loop, name="huginn-mlflow-drawer", daemon=True)
        self._drawer.start()
        _LOGGERS.append(self)

    # ---- the training side: never blocks, never raises
    def log(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        with self._cond:
            for start in range(0, len(batch), self.BATCH):
                self._queue.append(batch[start : start + self.BATCH])
                self._pending += len(batch[start : start + self.BATCH])
            while self._pending > self.max_pending and self._drop_oldest():
                pass
            self._cond.notify_all()

    def set_tag(self, key: str, value: str) -> None:
        """A run tag (text: which ranks straggled), queued in order with the metrics."""
        with self._cond:
            self._queue.append([RunTag(key, value[:5000])])
            self._pending += 1
            while self._pending > self.max_pending and self._drop_oldest():
                pass
            self._cond.notify_all()

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file (a table) to the run; the file is copied now, so the caller may delete it."""
        local_path = Path(local_path)
        copy_dir = Path(tempfile.mkdtemp(dir=self._spool))
        copy = copy_dir / local_path.name
        try:
            shutil.copy2(local_path, copy)
        except OSError as err:
            print(f"[huginn] warning: artifact {local_path} not logged: {err}", flush=True)
            return
        self._enqueue_artifact(_Artifact(str(local_path), artifact_path, str(copy)))

    def log_drawn_artifact(self, name: str, draw: Callable[[Path], Path | None],
                           artifact_path: str | None = None) -> None:
        """Upload the file `draw(directory)` makes (a plot, a copy); `draw` runs on the logger's drawing thread, so
        matplotlib never runs in the step loop. A `draw` that returns None (nothing to show) or raises logs
        nothing."""
        with self._cond:
            self._append_bounded(self._draws, _Artifact(name, artifact_path, None, draw))

    def _enqueue_artifact(self, artifact: _Artifact) -> None:
        with self._cond:
            self._append_bounded(self._artifacts, artifact)

    def _append_bounded(self, queue: deque, artifact: _Artifact) -> None:
        """Under the lock: `artifact` appended, the oldest dropped when `max_pending_artifacts` wait."""
        if len(queue) >= self.max_pending_artifacts:
            self._discard(queue.popleft())
            self._dropped += 1
            self.dropped_total += 1
        queue.append(artifact)
        self._cond.notify_all()

    @staticmethod
    def _discard(artifact: _Artifact) -> None:
        if artifact.file is not None:
            shutil.rmtree(Path(artifact.file).parent, ignore_errors=True)

    def _draw_loop(self) -> None:
        """The drawing thread: makes each queued artifact's file and hands it to the sender."""
        while True:
            with self._cond:
                while not self._draws and not self._closing:
                    self._cond.wait()
                if not self._draws:
                    self._cond.notify_all()  # the sender waits for the last drawing before it ends
                    return
                artifact, self._drawing = self._draws.popleft(), True
            drawn = self._draw(artifact)
            with self._cond:
                self._drawing = False
                if drawn:
                    self._append_bounded(self._artifacts, artifact)
                self._cond.notify_all()

    def _drawings_done(self) -> bool:
        """Under the lock: closing, and nothing left to draw."""
        return self._closing and not self._draws and not self._drawing

    def _draw(self, artifact: _Artifact) -> bool:
        """Make a drawn artifact's file (drawing thread, outside the lock); False when there is nothing to send."""
        directory = Path(tempfile.mkdtemp(dir=self._spool))
        try:
            path = artifact.draw(directory)
        except Exception as err:  # noqa: BLE001 - a plot must never stop training
            print(f"[huginn] warning: {artifact.name} not logged: {type(err).__name__}: {err}", flush=True)
            path = None
        if path is None:
            shutil.rmtree(directory, ignore_errors=True)
            return False
        artifact.file, artifact.draw = str(path), None
        return True

    def _drop_oldest(self) -> bool:
        for i, entry in enumerate(self._queue):
            if entry is not self._inflight:
                del self._queue[i]
                self._pending -= len(entry)
                self._dropped += len(entry)
                self.dropped_total += len(entry)
                return True
        return False

    # ---- the sender thread
    def _next_batch(self) -> list[list[Metric | RunTag]]:
        entries, size, tags = [], 0, 0
        for entry in self._queue:
            is_tag = isinstance(entry[0], RunTag)
            if entries and (size + len(entry) > self.BATCH or (is_tag and tags == self.TAG_BATCH)):
                break
            entries.append(entry)
            size += len(entry)
            tags += is_tag
        return entries

    def _send_loop(self) -> None:
        backoff = 0.5
        while True:
            with self._cond:
                while not self._queue and not self._artifacts and not self._drawings_done():
                    self._cond.wait()
                if not self._queue and not self._artifacts:
                    return  # closing, everything drawn and sent
                entries = self._next_batch()
                self._inflight = entries[0] if entries else None
                artifact = self._artifacts[0] if not entries else None
            try:
                if entries:
                    values = [value for entry in entries for value in entry]
                    self.client.log_batch(self.run_id, metrics=[v for v in values if isinstance(v, Metric)],
                                          tags=[v for v in values if isinstance(v, RunTag)])
                else:
                    self.client.log_artifact(self.run_id, artifact.file, artifact.artifact_path)
            except Exception as err:  # noqa: BLE001 - the server is down, slow, or refused: retry later
                with self._cond:
                    self._inflight = None
                    if self._failing_since is None:
                        self._failing_since = time.monotonic()
                        print(f"[huginn] MLflow at {redact_uri(self.uri)} not reachable "
                              f"({type(err).__name__}: {redact(str(err))[:200]}); training goes on, metrics are "
                              f"buffered (up to {self.max_pending} values) and retried", flush=True)
                    if self._closing and time.monotonic() > self._close_deadline:
                        return
                    self._cond.wait(timeout=min(backoff, 1.0) if self._closing else backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
                continue
            backoff = 0.5
            with self._cond:
                self._inflight = None
                if entries:
                    for entry in entries:  # still at the front unless dropped meanwhile (then already counted)
                        if self._queue and self._queue[0] is entry:
                            self._queue.popleft()
                            self._pending -= len(entry)
                            self.sent_total += len(entry)
                elif self._artifacts and self._artifacts[0] is artifact:
                    self._discard(self._artifacts.popleft())
                if self._failing_since is not None:
                    outage = time.monotonic() - self._failing_since
                    self._failing_since = None
                    print(f"[huginn] MLflow reachable again after {outage:.0f} s; sending the buffered metrics",
                          flush=True)
                self._report_dropped()

    def _report_dropped(self) -> None:
        if self._dropped:
            print(f"[huginn] warning: MLflow buffer full while {redact_uri(self.uri)} was unreachable: dropped "
                  f"{self._dropped} metric values (the oldest; buffer of {self.max_pending})", flush=True)
            self._dropped = 0

    def pending(self) -> int:
        with self._cond:
            return self._pending + len(self._artifacts) + len(self._draws) + self._drawing

    def close(self, timeout_s: float | None = None) -> None:
        """Send what is buffered, waiting at most `timeout_s` (default flush_timeout_s); never raises."""
        timeout_s = self.flush_timeout_s if timeout_s is None else timeout_s
        with self._cond:
            self._closing = True
            self._close_deadline = time.monotonic() + timeout_s
            self._cond.notify_all()
        self._thread.join(timeout_s + 1.0)  # the sender ends after the drawer's last file
        self._drawer.join(1.0)
        with self._cond:
            self._report_dropped()
            artifacts = len(self._artifacts) + len(self._draws) + self._drawing
            if self._pending or artifacts:
                print(f"[huginn] warning: MLflow at {redact_uri(self.uri)} did not take {self._pending} metric "
                      f"values and {artifacts} artifacts within {timeout_s:.0f} s; they are not logged",
                      flush=True)
        shutil.rmtree(self._spool, ignore_errors=True)
        if self in _LOGGERS:
            _LOGGERS.remove(self)


