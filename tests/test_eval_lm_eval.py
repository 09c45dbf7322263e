"""lm-eval through HFLM on the export, offline, with local multiple-choice and generate-until tasks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from huginn_ray.data.tokenizer import train_tokenizer
from huginn_ray.model import ModelConfig, RecurrentGPT, save_pretrained

pytest.importorskip("lm_eval")
REPO = Path(__file__).resolve().parents[1]

MC = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 3
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.mark.slow
def test_lm_eval_runs_offline_on_the_export_with_num_steps(tmp_path):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_tokenizer([p.read_text() for p in sorted((stdlib / "json").glob("*.py"))], 4096, tmp_path / "tokenizer")
    torch.manual_seed(0)
    save_pretrained(RecurrentGPT(ModelConfig.from_name("raven-tiny", state_init="zero")), tmp_path / "ckpt" / "model")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    with (tasks / "mc.jsonl").open("w") as f:
        for i in range(3):
            f.write(json.dumps({"question": f"def f{i}(x):", "choices": [" return x", " pass"], "answer": 0}) + "\n")
    with (tasks / "gen.jsonl").open("w") as f:
        for i in range(2):
            f.write(json.dumps({"question": f"import json{i}", "answer": " as"}) + "\n")
    (tasks / "tiny_mc.yaml").write_text(MC.format(data=tasks))
    (tasks / "tiny_gen.yaml").write_text(GEN.format(data=tasks))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf_home"), "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "jobs/evaluate.py", "--checkpoint", str(tmp_path / "ckpt"), "--lm-eval", "tiny_mc,tiny_gen",
         "--include-path", str(tasks), "--num-steps", "3", "--out", str(tmp_path / "eval"),
         f"tokenizer={tmp_path / 'tokenizer'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads((tmp_path / "eval" / "lm_eval_results.json").read_text())
    assert report["forward_num_steps"] == [3]  # every forward lm-eval made ran 3 core iterations
    assert "acc,none" in report["results"]["tiny_mc"]
    assert "exact_match,none" in report["results"]["tiny_gen"]
    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"sqlite:///{tmp_path / 'eval' / 'mlflow' / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("huginn-eval").experiment_id])[0]
    assert "lm_eval/tiny_mc/acc_none_steps_3" in run.data.metrics
