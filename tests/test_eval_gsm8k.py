"""The paper's GSM8k recipe: the pinned task against lm-eval's gsm8k_cot, and jobs/evaluate.py --gsm8k --sweep
offline on the shipped 4-problem sample with a tiny export (the accuracy is meaningless; settings, the prompt
lm-eval built, and the sweep's CSV, plot and MLflow entries are checked), through Ray Data replicas and through a
running jobs/serve.py (lm-eval's local-completions, requests batched by the server's engine): the same
accuracies (not the same responses: the export's initial noise is drawn otherwise, huginn_ray/eval/server_lm.py)."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from huginn_ray.data.tokenizer import train_tokenizer
from huginn_ray.eval.gsm8k import GSM8K_RECIPE, SAMPLE_DATA, TASK_YAML, check_task_data
from huginn_ray.model import ModelConfig, RecurrentGPT, save_pretrained
from isolation import free_port

pytest.importorskip("lm_eval")
REPO = Path(__file__).resolve().parents[1]
SYSTEM = "You are a helpful assistant that can assist users with mathematical reasoning."


def test_pinned_task_is_lm_evals_gsm8k_cot_with_local_data():
    import lm_eval

    theirs = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k-cot.yaml").read_text())
    ours = yaml.safe_load(TASK_YAML.read_text())
    if theirs.get("metadata", {}).get("version") != 3.0:
        pytest.skip(f"installed lm-eval's gsm8k_cot is version {theirs.get('metadata')}, the pin is 3.0")
    local = {"task", "dataset_path", "dataset_name", "dataset_kwargs", "tag", "generation_kwargs"}
    assert {k: v for k, v in ours.items() if k not in local} == {k: v for k, v in theirs.items() if k not in local}
    assert ours["generation_kwargs"] == {**theirs["generation_kwargs"], "max_gen_toks": 256}
    assert (ours["dataset_path"], ours["task"], ours["num_fewshot"]) == ("json", GSM8K_RECIPE.task, 8)
    assert (GSM8K_RECIPE.num_steps, GSM8K_RECIPE.system_instruction) == (32, SYSTEM)
    assert GSM8K_RECIPE.apply_chat_template and GSM8K_RECIPE.fewshot_as_multiturn
    assert check_task_data(SAMPLE_DATA) == 4


def test_bad_task_data_is_refused_by_line(tmp_path):
    data = tmp_path / "test.jsonl"
    data.write_text('{"question": "1 + 1?", "answer": "2\\n#### 2"}\n{"question": "2 + 2?", "answer": "4"}\n')
    with pytest.raises(ValueError, match=r"test.jsonl:2: needs a string 'question' and an 'answer' ending in"):
        check_task_data(data)
    with pytest.raises(ValueError, match="GSM8k data file not found"):
        check_task_data(tmp_path / "missing.jsonl")


@pytest.mark.slow
def test_gsm8k_depth_sweep_runs_offline_with_the_recipes_settings_through_replicas_and_through_the_server(tmp_path):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_tokenizer([p.read_text() for p in sorted((stdlib / "json").glob("*.py"))], 4096, tmp_path / "tokenizer")
    torch.manual_seed(0)  # block_size 512: the 8-shot prompt (~1,500 tokens here) is cut from the left to 496
    save_pretrained(RecurrentGPT(ModelConfig.from_name("raven-tiny", block_size=512)), tmp_path / "ckpt" / "model")
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update({"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"),
                "TRANSFORMERS_OFFLINE": "1", "HUGINN_API_KEY": "eval-key-" + uuid.uuid4().hex})

    def sweep(out, *where):
        result = subprocess.run(
            [sys.executable, "jobs/evaluate.py", "--checkpoint", str(tmp_path / "ckpt"), "--gsm8k", str(SAMPLE_DATA),
             "--sweep", "4,8", "--limit", "2", "--out", str(out), *where,
             f"tokenizer={tmp_path / 'tokenizer'}", "max_gen_toks=16"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        return result.stdout, json.loads((out / "gsm8k_depth_sweep.json").read_text())

    out = tmp_path / "eval"
    printed, report = sweep(out, "--replicas", "2")
    assert "[huginn] 2 model replica(s) on cpu, float32" in printed
    settings = report["settings"]
    assert settings["system_instruction"] == SYSTEM and settings["apply_chat_template"] and settings["fewshot_as_multiturn"]
    assert (settings["samples"], settings["max_gen_toks"], settings["depths"]) == (2, 16, [4, 8])
    assert (settings["replicas"], settings["device"], settings["dtype"]) == (2, "cpu", "float32")
    # through jobs/serve.py (its API key from $HUGINN_API_KEY, as evaluate.py's): the requests, 4 at once, share
    # the engine's batch, at each depth the accuracies are the replicas' (the responses are not: other noise)
    url, printed, served = through_server(tmp_path, env, lambda url: sweep(tmp_path / "eval_server", "--server", url,
                                                                          "num_concurrent=4"))
    assert f"[huginn] generating through the server at {url} (4 requests at once)" in printed
    assert (served["settings"]["num_concurrent"], served["settings"]["exit_criterion"]) == (4, None)
    for depth in ("4", "8"):
        responses = report["depths"][depth]["responses"][GSM8K_RECIPE.task]
        assert len(responses) == 2 and all(isinstance(text, str) for text in responses)
        assert len(served["depths"][depth]["responses"][GSM8K_RECIPE.task]) == 2
        assert served["depths"][depth]["results"] == report["depths"][depth]["results"]
        assert served["depths"][depth]["forward_num_steps"] == [int(depth)]  # every token: that many iterations
    assert report["depths"]["4"]["responses"] != report["depths"]["8"]["responses"]  # the depth reached the model
    for depth in ("4", "8"):
        run = report["depths"][depth]
        assert run["forward_num_steps"] == [int(depth)]  # every forward of the generation ran that depth
        assert run["n_shot"] == {GSM8K_RECIPE.task: 8}
        config = run["configs"][GSM8K_RECIPE.task]
        assert config["generation_kwargs"] == {"do_sample": False, "until": ["Q:", "</s>", "<|im_end|>"],
                                               "max_gen_toks": 16}
        assert [f["name"] for f in config["filter_list"]] == ["strict-match", "flexible-extract"]
        prompt = run["first_prompts"][GSM8K_RECIPE.task]  # the chat template with the system prompt, 8 shots
        assert prompt.startswith(f"<|begin_text|><|begin_header|>system<|end_header|>\n\n{SYSTEM}<|end_turn|>"
                                 "<|begin_header|>user<|end_header|>\n\nQ: There are 15 trees in the grove.")
        assert prompt.count("<|begin_header|>Huginn<|end_header|>\n\n") == 9  # 8 answers + the generation prompt
        assert prompt.endswith("How much in dollars does she make every day at the farmers' market?\nA:<|end_turn|>"
                               "<|begin_header|>Huginn<|end_header|>\n\n")
    rows = list(csv.DictReader((out / "gsm8k_depth_sweep.csv").open()))
    assert [(int(r["depth"]), int(r["samples"])) for r in rows] == [(4, 2), (8, 2)]
    assert [float(r["strict_match"]) for r in rows] == [
        report["depths"][d]["results"][GSM8K_RECIPE.task]["exact_match,strict-match"] for d in ("4", "8")]
    assert (out / "gsm8k_depth_sweep.png").stat().st_size > 1000
    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"sqlite:///{out / 'mlflow' / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("huginn-eval").experiment_id])[0]
    assert run.data.metrics["gsm8k/flexible_extract_depth_8"] == float(rows[1]["flexible_extract"])
    assert {a.path for a in client.list_artifacts(run.info.run_id, "gsm8k")} == {
        "gsm8k/gsm8k_depth_sweep.json", "gsm8k/gsm8k_depth_sweep.csv", "gsm8k/gsm8k_depth_sweep.png"}


def through_server(tmp_path, env, run):
    """(url, evaluate.py's output, its report) of `run(url)` against jobs/serve.py serving the checkpoint on
    loopback with the API key in env; the server stops on SIGINT."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([sys.executable, str(REPO / "jobs" / "serve.py"), "--checkpoint", str(tmp_path / "ckpt"),
                               "--tokenizer", str(tmp_path / "tokenizer"), "--port", str(port), "--replicas", "1",
                               "--max-rows", "4", "--device", "cpu"],
                              env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 300
        while "[huginn] serving" not in (tmp_path / "serve.log").read_text():
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.3)
        return (url, *run(url))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def test_server_requests_carry_the_recipes_fields_and_the_ray_data_paths_seeds(tmp_path):
    from huginn_ray.eval.server_lm import Server, server_generation_lm
    from huginn_ray.model.export import export

    train_tokenizer(["def main(): return 1\n" * 50, "Q: how many?\nA: The answer is 6.\n" * 50], 4096,
                    tmp_path / "tokenizer")
    torch.manual_seed(0)
    hf_dir = export(RecurrentGPT(ModelConfig.from_name("raven-tiny", vocab_size=4096)), tmp_path / "hf",
                    tmp_path / "tokenizer")
    lm = server_generation_lm(hf_dir, Server("http://127.0.0.1:9", 4, "k3y", "kl", 0.01), seed=5)
    assert (lm.base_url, lm.header, lm._concurrent, lm.max_length) == (
        "http://127.0.0.1:9/v1/completions", {"Authorization": "Bearer k3y"}, 4, 256)
    lm.depth, lm.index = 8, {(7, 8, 9): 2}
    payload = lm._create_payload([[7, 8, 9]], generate=True, seed=1234, eos="<|end_text|>",
                                 gen_kwargs={"until": ["Q:"], "max_gen_toks": 16, "do_sample": False})
    assert payload == {"prompt": [[7, 8, 9]], "model": "huginn", "max_tokens": 16, "temperature": 0,
                       "stop": ["Q:", "<|end_text|>", "<|end_turn|>"], "seed": 5 + 2, "num_steps": 8,
                       "return_token_ids": True, "exit_criterion": "kl", "exit_threshold": 0.01}
    # the reply's text: its tokens decoded without special tokens, cut at the first `until` string (HFLM's)
    ids = lm.tokenizer.encode("The answer is 6.\nQ: how", add_special_tokens=False)
    end_turn = lm.tokenizer.convert_tokens_to_ids("<|end_turn|>")
    [text] = lm.parse_generations({"choices": [{"index": 0, "text": "", "token_ids": [end_turn, *ids],
                                                "core_iterations": [8, 3, 8]}]})
    assert lm._cut(text, {"until": ["Q:"]}) == "The answer is 6.\n" and lm.depths_run == {8: {3, 8}}
    with pytest.raises(ValueError, match="--server must be an http"):
        Server("127.0.0.1:8000")
