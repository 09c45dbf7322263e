"""MLflow settings: where metrics go, and which config values become params."""

from dataclasses import dataclass, field

from huginn_ray.train.tracking import artifact_root, loggable_params, tracking_uri


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
