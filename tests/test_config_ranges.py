"""Every numeric config field with a valid range is checked when the config loads, naming the dotted key and the
allowed range (a zero chunk size would hang every worker at startup; a negative grad_clip flips gradients)."""

from pathlib import Path

import pytest

from huginn_ray.config import ConfigError
from huginn_ray.data.config import load_data_config
from huginn_ray.train.config import TRAIN_RANGES, TrainConfig, load_train_config

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "train" / "tiny_cpu.yaml"


@pytest.mark.parametrize("override, message", [
    ("grad_sync.chunk_mib=0", r"grad_sync.chunk_mib: must be in \(0, 16384\], got 0.0"),
    ("grad_clip=-1", r"grad_clip: must be in \(0, inf\), got -1.0"),
    ("grad_clip=0", r"grad_clip: must be in \(0, inf\)"),
    ("pg_timeout_s=0", r"pg_timeout_s: must be in \[1, inf\), got 0"),
    ("cpu_threads=0", r"cpu_threads: must be in \[1, inf\), got 0"),
    ("scaling.cpus_per_worker=0", r"scaling.cpus_per_worker: must be in \(0, inf\), got 0.0"),
    ("eval_depths=[1, -1]", r"eval_depths\[1\]: must be in \[1, inf\), got -1"),
    ("eval_depths=[0]", r"eval_depths\[0\]: must be in \[1, inf\)"),
    ("optim.lr=-1e-3", r"optim.lr: must be in \[0, inf\)"),
    ("optim.lr=0", r"optim.lr=0: ELLISAdam divides by its lr \(init_lr\); use optim.name=AdamW"),
    ("optim.lr=.nan", r"optim.lr: must be in \[0, inf\), got nan"),
    ("optim.betas=[0.9, 1.0]", r"optim.betas\[1\]: must be in \[0, 1\)"),
    ("optim.eps=0", r"optim.eps"),
    ("optim.weight_decay=-0.1", r"optim.weight_decay: must be in \[0, inf\)"),
    ("schedule.warmup_steps=-1", r"schedule.warmup_steps"),
    ("schedule.min_lr=-1e-5", r"schedule.min_lr"),
    ("warmup_timeout_s=0", r"warmup_timeout_s"),
    ("warmup_allreduce_mib=-1", r"warmup_allreduce_mib"),
    ("max_failures=-2", r"max_failures: must be in \[-1, inf\)"),
    ("world_batch_size=0", r"world_batch_size"),
    ("block_size=0", r"block_size"),
    ("max_tokens=0", r"max_tokens"),
    ("checkpoint.keep=0", r"checkpoint.keep"),
    ("mlflow.max_pending_metrics=0", r"mlflow.max_pending_metrics"),
    ("peak_flops_per_device=0", r"peak_flops_per_device"),
    ("seed=18446744073709551616", r"seed: must be in \[0, 1.84467e\+19\], got 18446744073709551616"),
    ("fault_injection={kill_rank_at_step: 3, kill_rank: 2}",
     r"fault_injection.kill_rank: must be in \[0, 1\] \(scaling.num_workers=2\)"),
    ("fault_injection={hang_rank_at_step: 3, hang_rank: 2}",
     r"fault_injection.hang_rank: must be in \[0, 1\] \(scaling.num_workers=2\)"),
    ("fault_injection.hang_rank_at_step=0", r"fault_injection.hang_rank_at_step: must be in \[1, inf\)"),
    ("scaling.num_workers=[0, 4]", r"scaling.num_workers\[0\]: must be in \[1, inf\), got 0"),
    ("scaling.num_workers=[4, 2]", r"scaling.num_workers: a worker count or \[min, max\] with min <= max, got \[4, 2\]"),
    ("scaling.num_workers=[2, 3, 4]", r"scaling.num_workers: a worker count or \[min, max\]"),
    # a rank that an elastic group of min workers lacks
    (("scaling.num_workers=[2, 4]", "fault_injection={kill_rank_at_step: 3, kill_rank: 2}"),
     r"fault_injection.kill_rank: must be in \[0, 1\] \(scaling.num_workers=\[2, 4\]\)"),
])
def test_out_of_range_train_values_are_refused_by_dotted_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(str(TINY), [override] if isinstance(override, str) else override)


def test_an_elastic_worker_range_loads_as_min_and_max():
    scaling = load_train_config(str(TINY), ["scaling.num_workers=[2, 4]"]).scaling
    assert (scaling.num_workers, scaling.min_workers, scaling.max_workers) == ([2, 4], 2, 4)
    scaling = load_train_config(str(TINY), ["scaling.num_workers=3"]).scaling
    assert (scaling.num_workers, scaling.min_workers, scaling.max_workers) == (3, 3, 3)


def test_every_numeric_train_field_has_a_range():
    import dataclasses
    import typing

    def numeric_keys(cls, prefix=""):
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            optional = [arg for arg in typing.get_args(tp) if dataclasses.is_dataclass(arg)]  # `Section | None`
            tp = optional[0] if optional else tp
            if dataclasses.is_dataclass(tp):
                yield from numeric_keys(tp, f"{prefix}{f.name}.")
            elif any(t in (int, float) for t in (tp, *typing.get_args(tp), *[
                    a for arg in typing.get_args(tp) for a in typing.get_args(arg)])):
                yield prefix + f.name

    assert sorted(set(numeric_keys(TrainConfig)) - set(TRAIN_RANGES)) == []


def test_the_shipped_train_configs_pass():
    for path in (REPO / "configs" / "train").glob("*.yaml"):
        load_train_config(str(path))


@pytest.mark.parametrize("override, message", [
    ("download.max_attempts=0", r"download.max_attempts: must be positive, got 0"),
    ("local_ray.num_cpus=0", r"local_ray.num_cpus: must be in \[1, inf\)"),
    ("local_ray.object_store_mib=0", r"local_ray.object_store_mib"),
    ("tokenizer.max_token_length=0", r"tokenizer.max_token_length"),
    ("tokenizer.vocab_size=32", r"tokenizer.vocab_size: must be in \[33, inf\)"),
    ("seed=-1", r"seed: must be in \[0, inf\)"),
])
def test_out_of_range_data_values_are_refused_by_dotted_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_data_config(REPO / "configs" / "data" / "demo.yaml", [override])
