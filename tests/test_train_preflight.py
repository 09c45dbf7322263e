"""Bad input is refused before any Ray worker starts (before Ray itself starts), with a message naming it."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from huginn_ray.config import ConfigError
from huginn_ray.data.shards import shard_path
from huginn_ray.data.tokens import parquet_options, row_schema, rows_to_arrow
from huginn_ray.train.config import load_train_config
from huginn_ray.train import checkpoint as ckpt
from huginn_ray.train import init_from
from huginn_ray.train.launch import (PreflightError, check_memory, data_order, largest_rank_micro_batch, preflight,
                                      schedule_steps)
from huginn_ray.train.shard_check import check_shards
from test_train_data import make_dataset, make_tokenizer, write_shard

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs/train/tiny_cpu.yaml"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"), num_shards=2, rows_per_shard=40, seq_len=32)


def tiny(dataset, tmp_path, *extra):
    data_dir, tokenizer = dataset
    return load_train_config(TINY, [f"out_dir={tmp_path}", f"data.data_dir={data_dir}",
                                    f"data.tokenizer_path={tokenizer}", "block_size=32",
                                    "model.overrides.vocab_size=64", "max_steps=20", *extra])  # the data's 20 steps


def train_main():
    spec = importlib.util.spec_from_file_location("train_job", REPO / "jobs" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_valid_input_gives_a_plan(dataset, tmp_path):
    plan = preflight(tiny(dataset, tmp_path, "micro_batch_size=2"))
    assert (plan.global_batch_rows, plan.num_streams) == (4, 2)
    assert plan.schedule_steps == 20  # 40 rows per shard / 2 rows of every shard per step: all the data
    assert plan.precision == "fp32"
    assert (plan.pad_id, plan.eos_id) == (37, 33)


def test_every_worker_count_up_to_the_rows_of_a_step_is_served_and_more_are_refused_by_name(dataset, tmp_path):
    # 3 workers, 2 shards, 8 rows a step, micro_batch_size 2: GA 2, micro-batches of 4 rows split 1, 1, 2
    assert preflight(tiny(dataset, tmp_path, "scaling.num_workers=3", "world_batch_size=8",
                          "max_steps=10")).global_batch_rows == 8
    with pytest.raises(PreflightError, match=r"^scaling.num_workers=9: 9 workers: the data order of 2 shards and a "
                                             r"global batch of 8 rows serves 1 to 8 workers \(at least one row"):
        preflight(tiny(dataset, tmp_path, "scaling.num_workers=9", "world_batch_size=8"))


def test_an_elastic_worker_range_serves_every_count_in_it_and_counts_the_largest_micro_batch(dataset, tmp_path,
                                                                                              capsys):
    # [3, 4]: the global batch is micro_batch_size x max = 8 rows; 3 workers take 1, 1, 2 rows of 4 (GA 2)
    assert preflight(tiny(dataset, tmp_path, "scaling.num_workers=[3, 4]", "max_steps=10")).global_batch_rows == 8
    assert "[huginn] data order" not in capsys.readouterr().out  # no rank gets more than micro_batch_size
    # micro_batch_size 1 of 4 rows a step: 3 workers cannot accumulate, one of them takes 2 rows per micro-batch
    assert preflight(tiny(dataset, tmp_path, "scaling.num_workers=[3, 4]", "micro_batch_size=1",
                          "max_steps=10")).global_batch_rows == 4
    assert ("[huginn] data order: on scaling.num_workers=[3, 4] a rank gets up to 2 rows per micro-batch, more than "
            "micro_batch_size=1") in capsys.readouterr().out
    with pytest.raises(PreflightError, match=r"^scaling.num_workers=\[2, 9\]: 9 workers: the data order of 2 shards "
                                             r"and a global batch of 8 rows serves 1 to 8 workers"):
        preflight(tiny(dataset, tmp_path, "scaling.num_workers=[2, 9]", "world_batch_size=8", "max_steps=10"))


def checkpoint_in(run_dir: Path, step: int, global_batch_rows: int, data_dir: str = "") -> None:
    """A complete checkpoint as far as the preflight looks: its trainer state and marker."""
    directory = run_dir / f"checkpoint_2026-11-24_05-00-{step:02d}.000000"
    directory.mkdir(parents=True)
    state = ckpt.TrainerState(step=step, num_streams=2, global_batch_rows=global_batch_rows, rows_per_stream=step * 2,
                              data_dir=data_dir)
    (directory / "trainer_state.json").write_text(json.dumps(state.__dict__))
    ckpt.write_marker(directory, step, {"trainer_state.json": (directory / "trainer_state.json").stat().st_size})


def test_a_resumed_run_keeps_its_checkpoint_s_global_batch_on_another_worker_count(dataset, tmp_path):
    cfg = tiny(dataset, tmp_path, "scaling.num_workers=1", "micro_batch_size=4")
    checkpoint_in(Path(cfg.run_dir), 6, global_batch_rows=4)
    plan = preflight(cfg)  # 1 worker, micro-batches of 4: the 2-worker run's 4 rows per step
    assert (plan.global_batch_rows, plan.num_streams) == (4, 2)
    with pytest.raises(PreflightError, match=r"^world_batch_size=8, but the run's newest checkpoint \(step 6\) was "
                                             r"trained with a global batch of 4 rows"):
        preflight(tiny(dataset, tmp_path, "scaling.num_workers=1", "micro_batch_size=4", "world_batch_size=8"))


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
    with pytest.raises(PreflightError, match="a global batch of 5 rows"):
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
    ("world_batch_size=7", "a global batch of 7 rows"),
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
    assert data_order(cfg, 4096, None).grad_accum == 1  # one shard per rank, micro-batch 1
    assert schedule_steps(cfg, 4096) == 238_418  # §3.2


def test_frontier_config_serves_a_node_less_and_refuses_0_and_more_workers_than_rows(capsys):
    """511 nodes of 8 GCDs: 4,088 workers take the 4,096 rows of a step, 8 of them 2 rows (the memory plan counts
    2); a checkpoint of 4,096 workers resumes there, and a group of 4,088 to 4,096 is served."""
    frontier = REPO / "configs/train/frontier_nebel_512_nodes.yaml"
    for workers in ("4088", "[4088, 4096]"):
        cfg = load_train_config(frontier, [f"scaling.num_workers={workers}"])
        order = data_order(cfg, 4096, ckpt.TrainerState(step=128, num_streams=4096, global_batch_rows=4096))
        assert (order.grad_accum, order.rows_per_micro_batch) == (1, 4096)
        assert largest_rank_micro_batch(cfg, order) == 2
        assert "a rank gets up to 2 rows per micro-batch, more than micro_batch_size=1" in capsys.readouterr().out
    check_memory(cfg, init_from.model_config(cfg), 2)  # fits: raises otherwise
    with pytest.raises(PreflightError, match=r"^scaling.num_workers=4097: 4097 workers: the data order of 4096 shards "
                                             r"and a global batch of 4096 rows serves 1 to 4096 workers"):
        data_order(load_train_config(frontier, ["scaling.num_workers=4097", "world_batch_size=4096"]), 4096, None)
    for workers in ("0", "[0, 4096]"):
        with pytest.raises(ConfigError, match=r"^scaling.num_workers(\[0\])?: must be in \[1, inf\), got 0"):
            load_train_config(frontier, [f"scaling.num_workers={workers}"])


# Bad shards: every shard's footer is held to the manifest before Ray starts (huginn_ray/train/shard_check.py).
# Each test spoils a fresh copy of the dataset: 2 ranks, train 40 rows in row groups of 16 (16, 16, 8), val 16
# rows, seq_len 32 (rows of 33 ids), int32 ids in [0, 32), manifest vocab_size 64, model vocab_size 64.


@pytest.fixture
def fresh(tmp_path):
    return make_dataset(tmp_path / "fresh", num_shards=2, rows_per_shard=40, seq_len=32)


def rows_of(path: Path) -> np.ndarray:
    return np.array(pq.read_table(path).column("input_ids").to_pylist(), dtype=np.int32)


def refused(dataset, tmp_path, message: str) -> None:
    """preflight raises PreflightError with exactly `message`."""
    with pytest.raises(PreflightError) as err:
        preflight(tiny(dataset, tmp_path))
    assert str(err.value) == message


def test_truncated_shard_is_refused_naming_the_first_bad_file(fresh, tmp_path):
    data_dir = fresh[0]
    for split, rank in (("val", 0), ("train", 1)):  # two bad files: the first in (train, val) x rank order is named
        path = shard_path(data_dir, split, rank)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(PreflightError) as err:
        preflight(tiny(fresh, tmp_path))
    assert str(err.value).startswith(f"{shard_path(data_dir, 'train', 1)}: not a readable parquet file (truncated or "
                                     "corrupt?): ")


def test_missing_shard_is_refused_naming_its_rank(fresh, tmp_path):
    shard_path(fresh[0], "val", 1).unlink()
    refused(fresh, tmp_path, f"missing shard of rank 1: {shard_path(fresh[0], 'val', 1)}")


def test_shard_with_another_row_count_than_the_manifest_is_refused(fresh, tmp_path):
    path = shard_path(fresh[0], "train", 1)
    write_shard(path, rows_of(path)[:39], row_group_size=16)
    refused(fresh, tmp_path, f"{path}: 39 rows, the manifest says 40 (rows_per_shard)")


@pytest.mark.parametrize("column, found", [
    (pa.array([[1] * 33] * 16, pa.list_(pa.int64())), "list<element: int64>"),
    (pa.array(["t1 t2"] * 16), "string"),
])
def test_shard_column_of_another_type_than_the_manifest_s_is_refused(fresh, tmp_path, column, found):
    path = shard_path(fresh[0], "val", 0)
    pq.write_table(pa.table({"input_ids": column}), path)
    refused(fresh, tmp_path, f"{path}: column 'input_ids' is {found}, the manifest's token_dtype needs list<int32>")


def test_shard_rows_of_another_length_are_refused(fresh, tmp_path):
    path = shard_path(fresh[0], "val", 1)
    write_shard(path, np.zeros((16, 34), np.int32), row_group_size=16)  # made with seq_len 33
    refused(fresh, tmp_path, f"{path}: row group 0 holds 544 ids in 16 rows, expected 16 x 33 (seq_len + 1) = 528")


def test_shard_with_empty_or_null_rows_is_refused(fresh, tmp_path):
    path = shard_path(fresh[0], "train", 0)
    rows = rows_of(path).tolist()
    rows[20], rows[21] = [], None  # both in row group 1
    pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32()))}), path, row_group_size=16)
    refused(fresh, tmp_path, f"{path}: row group 1 holds 2 empty or null rows or ids, expected 16 rows of 33 ids "
                             "(seq_len + 1)")


def test_manifest_vocabulary_larger_than_the_model_s_is_refused(fresh, tmp_path):
    manifest = fresh[0] / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "vocab_size": 128}))
    refused(fresh, tmp_path, f"{manifest}: the shards were made with a vocabulary of 128 ids (vocab_size), "
                             "the model has vocab_size=64")


def test_out_of_vocabulary_id_is_caught_by_the_footer_statistics(fresh, tmp_path):
    path = shard_path(fresh[0], "train", 1)
    rows = rows_of(path)
    rows[37, 32] = 64  # row group 2 (rows 32..39), last position: a label only
    write_shard(path, rows, row_group_size=16)
    refused(fresh, tmp_path, f"{path}: row group 2 holds token id 64 (statistics: min {rows[32:].min()}, max 64), "
                             "outside the manifest's vocabulary [0, 64)")


def test_shards_without_statistics_pass_and_are_counted(fresh, tmp_path, capsys):
    path = shard_path(fresh[0], "train", 0)
    pq.write_table(pa.table({"input_ids": pa.array(list(rows_of(path)), pa.list_(pa.int32()))}), path,
                   row_group_size=16, write_statistics=False)
    preflight(tiny(fresh, tmp_path))
    assert re.search(r"shards checked: 4 footers in [0-9.]+ s \(32 threads\); 3 row groups carry no id statistics",
                     capsys.readouterr().out)


def test_shards_of_the_project_s_own_writer_pass(tmp_path):
    """uint16 rows as huginn_ray.data.shards writes them (BYTE_STREAM_SPLIT, zstd), some rows ending in padding."""
    rows = np.arange(24 * 9, dtype=np.uint16).reshape(24, 9) % 300
    rows[5, 4:] = 299  # a padded row
    table = pa.table({"input_ids": rows_to_arrow(rows, "uint16")}, schema=row_schema("uint16"))
    for split in ("train", "val"):
        shard_path(tmp_path, split, 0).parent.mkdir(parents=True)
        pq.write_table(table, shard_path(tmp_path, split, 0), row_group_size=10, **parquet_options(table))
    manifest = {"seq_len": 8, "token_dtype": "uint16", "vocab_size": 300, "num_shards": 1,
                "rows_per_shard": {"train": 24, "val": 24}}
    summary = check_shards(tmp_path, manifest, model_vocab_size=320)
    assert (summary.files, summary.row_groups_without_statistics) == (2, 0)


def test_a_run_keeps_the_shard_version_it_resolved_while_a_new_one_is_published(tmp_path, capsys):
    """`<output_dir>/shards` points to immutable versions: a publish writes shards.v0002 and moves the pointer. The
    preflight resolves the pointer once (RunPlan.data_dir, what every worker of every attempt reads); after a
    publish that run's files are unchanged, a new run gets the new version, and a run resuming from a checkpoint
    keeps the version the checkpoint records until that version is removed (then it is refused by name)."""
    import shutil

    from huginn_ray.data import layout
    from huginn_ray.data.shards import publish

    out = tmp_path / "out"
    pointer = out / "shards"

    def finished_shuffle(name: str, rows: int) -> tuple[Path, dict, Path]:
        """A shuffle's work directory, out/shards.partial, holding shards of `rows` rows each under out/."""
        shards, tokenizer = make_dataset(tmp_path / name, num_shards=2, rows_per_shard=rows, seq_len=32)
        work = out / "shards.partial"
        work.mkdir(parents=True)
        shutil.move(shards, work / "out")
        return work, json.loads((work / "out" / "manifest.json").read_text()), tokenizer

    work, manifest, tokenizer = finished_shuffle("a", 40)
    publish(work, pointer, manifest)
    first = out / "shards.v0001"
    assert pointer.readlink() == Path("shards.v0001") and not work.exists()
    cfg = load_train_config(TINY, [f"out_dir={tmp_path}", f"data.data_dir={pointer}",
                                   f"data.tokenizer_path={tokenizer}", "block_size=32", "model.overrides.vocab_size=64",
                                   "max_steps=20"])
    assert cfg.data.data_dir == str(pointer)  # the pointer, resolved by the preflight only
    plan = preflight(cfg)
    assert plan.data_dir == str(first)
    before = shard_path(plan.data_dir, "train", 1).read_bytes()

    work, manifest, _ = finished_shuffle("b", 60)
    publish(work, pointer, manifest)
    second = out / "shards.v0002"
    assert pointer.readlink() == Path("shards.v0002")
    assert shard_path(plan.data_dir, "train", 1).read_bytes() == before  # the running run's files
    assert pq.read_metadata(shard_path(plan.data_dir, "train", 1)).num_rows == 40
    assert pq.read_metadata(shard_path(pointer, "train", 1)).num_rows == 60
    assert preflight(cfg).data_dir == str(second)  # a new run reads the new version

    # the run resumed by a new job: its newest checkpoint records the version it was trained on
    capsys.readouterr()
    checkpoint_in(Path(cfg.run_dir), 3, global_batch_rows=plan.global_batch_rows, data_dir=plan.data_dir)
    assert preflight(cfg).data_dir == str(first)
    assert f"{pointer} now points to {second}; this run keeps reading {first}, the version it started with" in (
        capsys.readouterr().out)
    assert layout.remove_old_versions(pointer) == [first] and not first.exists() and second.is_dir()
    with pytest.raises(PreflightError, match=re.escape(
            f"data.data_dir: the run's newest checkpoint (step 3) was trained on {first}, which no longer exists "
            f"({pointer} now points to {second})")):
        preflight(cfg)
