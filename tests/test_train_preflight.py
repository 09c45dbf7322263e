"""Bad input is refused before any Ray worker starts (before Ray itself starts), with a message naming it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import ray

from huginn_ray.config import ConfigError
from huginn_ray.train.config import load_train_config
from huginn_ray.train.launch import PreflightError, batch_arithmetic, preflight
from test_train_data import make_dataset, make_tokenizer

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs/train/tiny_cpu.yaml"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"), num_shards=2, rows_per_shard=40, seq_len=32)


def tiny(dataset, tmp_path, *extra):
    data_dir, tokenizer = dataset
    return load_train_config(TINY, [f"out_dir={tmp_path}", f"data.data_dir={data_dir}",
                                    f"data.tokenizer_path={tokenizer}", "block_size=32",
                                    "model.overrides.vocab_size=64", *extra])


def train_main():
    spec = importlib.util.spec_from_file_location("train_job", REPO / "jobs" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_valid_input_gives_a_plan(dataset, tmp_path):
    plan = preflight(tiny(dataset, tmp_path, "micro_batch_size=2", "max_steps=50"))
    assert plan["world_size"] == 2 and plan["grad_accum"] == 1
    assert plan["max_steps"] == 20  # 40 rows per shard / 2 rows per step: the data ends first
    assert plan["schedule_steps"] == 50
    assert plan["precision"] == "fp32"
    assert (plan["pad_id"], plan["eos_id"]) == (37, 33)


def test_shard_count_not_fitting_world_size_is_refused(dataset, tmp_path):
    with pytest.raises(PreflightError, match=r"2 shards but the run has 3 workers"):
        preflight(tiny(dataset, tmp_path, "scaling.num_workers=3"))


def test_tokenizer_larger_than_model_vocabulary_is_refused(dataset, tmp_path):
    big = make_tokenizer(tmp_path / "big_tokenizer", vocab_size=128)
    with pytest.raises(PreflightError, match=r"tokenizer_path.*128 ids.*vocab_size is 64"):
        preflight(tiny(dataset, tmp_path, f"data.tokenizer_path={big}"))


def test_tokenizer_other_than_the_shards_one_is_refused(dataset, tmp_path):
    other = make_tokenizer(tmp_path / "other_tokenizer", vocab_size=60)
    with pytest.raises(PreflightError, match=f"{other}/tokenizer.json is not the tokenizer the shards"):
        preflight(tiny(dataset, tmp_path, f"data.tokenizer_path={other}"))


def test_missing_data_directory_is_refused(dataset, tmp_path):
    with pytest.raises(PreflightError, match=f"directory not found: {tmp_path / 'nowhere'}"):
        preflight(tiny(dataset, tmp_path, f"data.data_dir={tmp_path / 'nowhere'}"))


def test_sequence_length_mismatch_is_refused(dataset, tmp_path):
    with pytest.raises(PreflightError, match="block_size=64 but the shards .* seq_len=32"):
        preflight(tiny(dataset, tmp_path, "block_size=64"))


def test_world_batch_size_must_divide(dataset, tmp_path):
    with pytest.raises(PreflightError, match="world_batch_size=5"):
        preflight(tiny(dataset, tmp_path, "world_batch_size=5", "micro_batch_size=1"))


@pytest.mark.parametrize("override, named", [
    ("optim.lrr=1e-3", "optim.lrr"),
    ("grad_sync.kind=ring", "grad_sync.kind"),
    ("max_steps=many", "max_steps"),
    ("fault_injection.kill_rank=one", "fault_injection.kill_rank"),
])
def test_unknown_key_or_wrong_type_is_refused_naming_it(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_train_config(TINY, [override])


@pytest.mark.parametrize("override, expected", [
    ("scaling.num_workers=3", "3 workers"),
    ("optim.bogus=1", "optim.bogus"),
])
def test_train_job_exits_before_starting_ray(dataset, tmp_path, capsys, monkeypatch, override, expected):
    data_dir, tokenizer = dataset
    ray_calls = []
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: ray_calls.append((args, kwargs)))
    code = train_main()(["--config", str(TINY), f"out_dir={tmp_path}", f"data.data_dir={data_dir}",
                         f"data.tokenizer_path={tokenizer}", "block_size=32", "model.overrides.vocab_size=64",
                         override])
    assert code == 2
    assert expected in capsys.readouterr().err
    assert ray_calls == []


def test_frontier_config_holds_the_original_run():
    cfg = load_train_config(REPO / "configs/train/frontier_nebel_512_nodes.yaml")
    assert cfg.scaling.num_workers == 4096 and cfg.scaling.use_gpu
    assert cfg.model.name == "nebel-raven-3.5b" and cfg.optim.name == "ELLISAdam"
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.betas) == (4e-5, 4e-5, [0.9, 0.95])
    assert (cfg.schedule.warmup_steps, cfg.schedule.cooldown_steps) == (4096, 4096)
    assert cfg.checkpoint.save_step_interval == 128 and cfg.eval_step_interval == 128
    assert batch_arithmetic(cfg) == (1, 238_418)  # §3.2
