"""MLflow settings: where metrics go, and which config values become params."""

import time
from dataclasses import dataclass, field

import pytest
from mlflow.tracking import MlflowClient

from huginn_ray.train.tracking import (MetricsLogger, artifact_root, close_run, loggable_params, redact, redact_uri,
                                       tracking_uri)
from isolation import MlflowServer, free_port


def test_tracking_uri_config_then_environment_then_embedded_sqlite(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert tracking_uri("http://127.0.0.1:5000", str(tmp_path)) == "http://127.0.0.1:5000"
    assert tracking_uri(None, str(tmp_path)) == "http://127.0.0.1:5999"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert tracking_uri(None, str(tmp_path)) == f"sqlite:///{tmp_path}/mlflow/mlflow.db"
    assert artifact_root(str(tmp_path)) == f"file://{tmp_path}/mlflow/artifacts"


@dataclass
class Hub:
    endpoint: str = "http://127.0.0.1:9000"
    hf_token: str = "hf_secret_value"
    api_key: str = "k"


@dataclass
class Cfg:
    tokenizer_path: str = "/data/tok"
    keep: int = 3
    hub: Hub = field(default_factory=Hub)


def test_params_leave_secrets_out():
    params = loggable_params(Cfg())
    assert params == {"tokenizer_path": "/data/tok", "keep": "3", "hub.endpoint": "http://127.0.0.1:9000"}


def test_credentials_in_uris_are_redacted_in_params_and_text():
    assert redact_uri("https://user:pa55@mlflow.example:443/x?token=abc&page=2") == \
        "https://user:***@mlflow.example:443/x?token=***&page=2"
    assert redact_uri("https://hf_abc@host/repo") == "https://***@host/repo"
    for plain in ("http://127.0.0.1:5000", "sqlite:////abs/mlflow.db", "file:///a/b", "databricks"):
        assert redact_uri(plain) == plain
    assert redact("MLflow: https://u:p@h:5000 (run 1)") == "MLflow: https://u:***@h:5000 (run 1)"

    @dataclass
    class WithUri:
        tracking_uri: str = "https://alice:s3cret@mlflow.example"

    assert loggable_params(WithUri()) == {"tracking_uri": "https://alice:***@mlflow.example"}


# ---- tracking that cannot stop training: a real `mlflow server`, stopped and restarted under a live logger

@pytest.fixture
def fast_failing_client(monkeypatch):
    # what MetricsLogger sets for its process, restored after the test
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")


@pytest.mark.slow
def test_metrics_survive_an_mlflow_server_restart(tmp_path, fast_failing_client, capsys):
    server = MlflowServer(tmp_path)
    server.start()
    try:
        client = MlflowClient(server.uri)
        run_id = client.create_run(client.create_experiment("outage")).info.run_id
        logger = MetricsLogger(server.uri, run_id, max_pending=1000, request_timeout_s=2, max_backoff_s=0.5)
        for step in range(1, 6):
            logger.log({"loss": 10.0 - step, "lr": 0.1}, step)
        deadline = time.monotonic() + 30
        while logger.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert logger.pending() == 0

        server.stop()
        slowest = 0.0
        for step in range(6, 16):  # "training" goes on while the server is down
            t0 = time.perf_counter()
            logger.log({"loss": 10.0 - step, "lr": 0.1}, step)
            if step == 8:
                logger.set_tag("straggler.step_000008", "rank 1 on node-b 0.512 s (2.31x)")
            slowest = max(slowest, time.perf_counter() - t0)
            time.sleep(0.05)
        assert slowest < 0.05, f"log() blocked {slowest:.3f} s on a down server"
        time.sleep(1.0)
        assert logger.pending() == 21  # 10 steps x 2 values and a tag wait in the buffer
        artifact = tmp_path / "val_plot.txt"
        artifact.write_text("a plot\n")
        logger.log_artifact(artifact, "plots")
        artifact.unlink()  # copied when queued

        server.start()  # same port, same store
        logger.close(timeout_s=60)
        history = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
        assert history == {step: 10.0 - step for step in range(1, 16)}
        assert [a.path for a in client.list_artifacts(run_id, "plots")] == ["plots/val_plot.txt"]
        assert client.get_run(run_id).data.tags["straggler.step_000008"] == "rank 1 on node-b 0.512 s (2.31x)"
        out = capsys.readouterr().out
        assert "not reachable" in out and "reachable again" in out and "dropped" not in out

        for status in ("KILLED", "FAILED", "FINISHED"):
            close_run(server.uri, run_id, status)
            assert client.get_run(run_id).info.status == status
    finally:
        server.stop()


def test_a_full_buffer_drops_the_oldest_values_with_one_warning(fast_failing_client, capsys):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    logger = MetricsLogger(down, "0" * 32, max_pending=10, request_timeout_s=1, max_backoff_s=0.2)
    t0 = time.perf_counter()
    for step in range(1, 26):
        logger.log({"loss": float(step)}, step)
    assert time.perf_counter() - t0 < 0.5
    assert logger.pending() == 10
    logger.close(timeout_s=1)
    out = capsys.readouterr().out
    assert out.count("dropped") == 1 and "dropped 15 metric values" in out, out
    assert "did not take 10 metric values" in out
    close_run(down, "0" * 32, "FINISHED", attempts=1)  # an outage at the end is reported, not raised
    assert "could not mark MLflow run" in capsys.readouterr().out
