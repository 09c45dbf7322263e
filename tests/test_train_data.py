"""The data order and the training reader: every shard a stream shuffled per row group with Random(seed + stream),
popped from the end; a rank's slices of every micro-batch (huginn_ray.train.data_order); seek for an exact resume on
any allowed worker count; collate with and without a loss mask.

`make_dataset` (also used by the Ray tests) writes shards in the layout of the data contract and a real
Hugging Face tokenizer.json with the Huginn special tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from huginn_ray.data.tokenizer import SPECIAL_TOKENS, file_sha256
from huginn_ray.data.shards import shard_path
from huginn_ray.train.data_order import (DataOrder, DataOrderError, StreamSlice, accumulates_gradients,
                                        largest_micro_batch)
from huginn_ray.train.shard_reader import RankReader, Rows, ShardReader, collate, validation_rows

DATA_TOKENS = 32  # ids 0..31 carry data, 32..63 are the special tokens


def make_tokenizer(directory: Path, vocab_size: int = 64) -> Path:
    vocab = {f"t{i}": i for i in range(vocab_size - len(SPECIAL_TOKENS))}
    vocab.update({tok: vocab_size - len(SPECIAL_TOKENS) + i for i, tok in enumerate(SPECIAL_TOKENS)})
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(WordLevel(vocab, unk_token="<|pad|>"))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def arithmetic_rows(rng: np.random.Generator, count: int, row_length: int) -> np.ndarray:
    """Rows (s + d*i) mod 32: learnable, so a loss that falls is meaningful."""
    start = rng.integers(0, DATA_TOKENS, size=(count, 1))
    stride = rng.integers(1, 4, size=(count, 1))
    return ((start + stride * np.arange(row_length)) % DATA_TOKENS).astype(np.int32)


def write_shard(path: Path, rows: np.ndarray, row_group_size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"input_ids": pa.array(list(rows), type=pa.list_(pa.int32()))})
    pq.write_table(table, path, row_group_size=row_group_size)


def write_manifest(data_dir: Path, num_shards: int, seq_len: int, rows: dict, tokenizer_dir: Path) -> None:
    """A manifest that huginn_ray.data.shards.read_manifest accepts (the input fingerprint is a placeholder)."""
    (data_dir / "manifest.json").write_text(json.dumps({
        "num_shards": num_shards, "seq_len": seq_len, "seed": 0, "vocab_size": 64,
        "tokenizer_sha256": file_sha256(tokenizer_dir / "tokenizer.json"),
        "input_fingerprint": "", "rows_per_shard": rows,
        "tokens_per_shard": {split: n * (seq_len + 1) for split, n in rows.items()},
        "dropped_surplus_rows": {split: 0 for split in rows},
    }))


def make_dataset(root: Path, num_shards: int = 2, rows_per_shard: int = 200, seq_len: int = 32,
                 row_group_size: int = 16, val_rows: int = 16) -> tuple[Path, Path]:
    """Shards in the data contract's layout and a tokenizer; returns (shard dir, tokenizer dir)."""
    rng = np.random.default_rng(0)
    data_dir = root / "shards"
    for rank in range(num_shards):
        write_shard(shard_path(data_dir, "train", rank), arithmetic_rows(rng, rows_per_shard, seq_len + 1), row_group_size)
        write_shard(shard_path(data_dir, "val", rank), arithmetic_rows(rng, val_rows, seq_len + 1), row_group_size)
    tokenizer_dir = make_tokenizer(root / "tokenizer")
    write_manifest(data_dir, num_shards, seq_len, {"train": rows_per_shard, "val": val_rows}, tokenizer_dir)
    return data_dir, tokenizer_dir


@pytest.fixture
def shard(tmp_path):
    rows = np.arange(50 * 5, dtype=np.int32).reshape(50, 5)  # row i = [5i .. 5i+4]: identity by first id
    path = tmp_path / "00000.parquet"
    write_shard(path, rows, row_group_size=8)  # 7 row groups, the last one with 2 rows
    return path


def first_ids(reader, count):
    return [int(row[0]) // 5 for row in reader.next_rows(count).ids] if count else []


def test_rows_are_shuffled_per_row_group_and_popped_from_the_end(shard):
    reader = ShardReader(shard, stream=1, seed=233, row_length=5)
    got = first_ids(reader, 50)
    rng = random.Random(233 + 1)
    expected = []
    for start in range(0, 50, 8):
        order = list(range(start, min(start + 8, 50)))
        rng.shuffle(order)
        expected += order[::-1]
    assert got == expected
    assert sorted(got) == list(range(50))
    with pytest.raises(StopIteration):
        reader.next_rows(1)


def test_row_keys_are_the_stream_and_the_row_index_in_the_file(shard):
    rows = ShardReader(shard, stream=3, seed=0, row_length=5).next_rows(20)
    assert rows.keys.tolist() == [3 * 2**32 + int(first) // 5 for first in rows.ids[:, 0]]
    assert rows.loss_mask is None


@pytest.mark.parametrize("position", [0, 3, 8, 13, 49, 50])
def test_seek_stands_where_an_uninterrupted_read_stands(shard, position):
    uninterrupted = first_ids(ShardReader(shard, stream=2, seed=7, row_length=5), 50)
    resumed = ShardReader(shard, stream=2, seed=7, row_length=5)
    resumed.next_rows(5)  # a seek forgets what was read before
    resumed.seek(position)
    assert resumed.position == position
    assert first_ids(resumed, 50 - position) == uninterrupted[position:]


def test_seek_past_the_shard_names_it(shard):
    with pytest.raises(ValueError, match=r"00000.parquet: cannot resume at row 51, the shard holds 50 rows"):
        ShardReader(shard, stream=0, seed=1, row_length=5).seek(51)


def test_reader_refuses_rows_of_the_wrong_length(shard):
    with pytest.raises(ValueError, match="expected 6"):
        ShardReader(shard, stream=0, seed=1, row_length=6).next_rows(1)


# ---- the data order ---------------------------------------------------------------------------------------------

def test_rank_slices_of_the_data_order():
    # one stream per rank (the Huginn layout): rank k reads stream k alone
    assert DataOrder(4, 8, 2, 4).slices(1) == [StreamSlice(1, 0, 2)]
    # fewer ranks than streams: whole streams
    assert DataOrder(4, 8, 4, 2).slices(1) == [StreamSlice(2, 0, 2), StreamSlice(3, 0, 2)]
    # more ranks than streams: two ranks share a stream's rows of a micro-batch
    assert DataOrder(2, 8, 1, 4).slices(3) == [StreamSlice(1, 1, 2)]
    # a rank's rows across a stream boundary: 4 streams x r = 3 rows per micro-batch, ranks of 4 rows
    order = DataOrder(4, 12, 4, 3)
    assert order.rows_per_stream_per_micro_batch == 3 and order.grad_accum == 1
    assert order.slices(1) == [StreamSlice(1, 1, 3), StreamSlice(2, 0, 2)]


def old_rule_order(S, B, m, W):
    """(GA, each rank's rows) of equal micro-batches, where m x W divides B and S divides m x W; else None."""
    if B % (m * W) or (m * W) % S:
        return None
    return B // (m * W), [list(range(k * m, (k + 1) * m)) for k in range(W)]


def test_every_worker_count_equal_micro_batches_served_keeps_its_rows_and_accumulation():
    """Existing runs and checkpoints: where every rank can get m rows, GA and each rank's rows are unchanged."""
    served = 0
    for S in (1, 2, 3, 4, 6, 8):
        for B in range(S, 8 * S + 1, S):
            for m in (1, 2, 3, 4):
                for W in range(1, B + 1):
                    old = old_rule_order(S, B, m, W)
                    if old is None:
                        continue
                    order = DataOrder(S, B, m, W).check()
                    assert (order.grad_accum, [list(order.rows(k)) for k in range(W)]) == old, (S, B, m, W)
                    assert order.largest_micro_batch == m
                    served += 1
    assert served == 330


def test_unequal_worker_counts_take_floor_k_r_over_w_rows():
    # 4 shards, 8 rows a step, m = 2 on 3 ranks: GA 2, R = 4 rows per micro-batch, rows 1, 1, 2
    order = DataOrder(4, 8, 2, 3).check()
    assert (order.grad_accum, order.rows_per_micro_batch, order.largest_micro_batch) == (2, 4, 2)
    assert [order.slices(k) for k in range(3)] == [[StreamSlice(0, 0, 1)], [StreamSlice(1, 0, 1)],
                                                   [StreamSlice(2, 0, 1), StreamSlice(3, 0, 1)]]
    # m = 1 on 3 ranks: no accumulation gives at most 1 row per rank with a row of every shard; the fewest rows
    # (GA 2, R = 4): rank 2 gets 2 rows, more than m
    order = DataOrder(4, 8, 1, 3).check()
    assert (order.grad_accum, order.largest_micro_batch, [list(order.rows(k)) for k in range(3)]) == (
        2, 2, [[0], [1], [2, 3]])
    # m = 4 on 3 ranks: one micro-batch of 8 rows, 2, 3, 3
    order = DataOrder(4, 8, 4, 3).check()
    assert (order.grad_accum, [list(order.rows(k)) for k in range(3)]) == (1, [[0, 1], [2, 3, 4], [5, 6, 7]])
    assert order.slices(1) == [StreamSlice(1, 0, 2), StreamSlice(2, 0, 1)]
    assert order.slices(2) == [StreamSlice(2, 1, 2), StreamSlice(3, 0, 2)]
    # more ranks than shards, unequal: 2 shards x 3 rows, 4 ranks get 1, 2, 1, 2 rows
    order = DataOrder(2, 6, 1, 4).check()
    assert [order.slices(k) for k in range(4)] == [[StreamSlice(0, 0, 1)], [StreamSlice(0, 1, 3)],
                                                   [StreamSlice(1, 0, 1)], [StreamSlice(1, 1, 3)]]
    # 12 rows of 4 shards on 5 ranks: 2, 2, 3, 2, 3 rows, slices across shard boundaries
    order = DataOrder(4, 12, 2, 5).check()
    assert [list(order.rows(k)) for k in range(5)] == [[0, 1], [2, 3], [4, 5, 6], [7, 8], [9, 10, 11]]
    assert order.slices(1) == [StreamSlice(0, 2, 3), StreamSlice(1, 0, 1)]
    assert order.slices(2) == [StreamSlice(1, 1, 3), StreamSlice(2, 0, 1)]
    # the Frontier layout less a node: 4,096 shards, 4,096 rows, m = 1 on 4,088 ranks; 8 ranks take 2 rows
    order = DataOrder(4096, 4096, 1, 4088).check()
    assert (order.grad_accum, order.largest_micro_batch) == (1, 2)
    assert [k for k in range(4088) if len(order.rows(k)) == 2] == [510, 1021, 1532, 2043, 2554, 3065, 3576, 4087]
    assert order.slices(509) == [StreamSlice(509, 0, 1)]
    assert order.slices(510) == [StreamSlice(510, 0, 1), StreamSlice(511, 0, 1)]
    assert order.slices(511) == [StreamSlice(512, 0, 1)]
    assert order.slices(4087) == [StreamSlice(4094, 0, 1), StreamSlice(4095, 0, 1)]
    # every row of a micro-batch is taken once, on every worker count
    for W in range(1, 13):
        order = DataOrder(4, 12, 2, W).check()
        taken = [(s.stream, row) for k in range(W) for s in order.slices(k) for row in range(s.start, s.stop)]
        assert taken == [(s, row) for s in range(4) for row in range(order.rows_per_stream_per_micro_batch)], W
    # m = 1, 8 rows of 4 shards: 2 rows per rank on 2, 3, 5, 6 or 7 ranks, 1 on 4 or 8
    assert [DataOrder(4, 8, 1, w).largest_micro_batch for w in range(2, 9)] == [2, 2, 1, 2, 2, 2, 1]
    assert largest_micro_batch(4, 8, 1, range(2, 9)) == 2 and largest_micro_batch(4, 8, 1, range(4, 5)) == 1
    # and 2 micro-batches a step on 2 to 4 ranks, 1 on 5 to 8: an elastic run accumulates if any count does
    assert [DataOrder(4, 8, 1, w).grad_accum for w in range(2, 9)] == [2, 2, 2, 1, 1, 1, 1]
    assert [accumulates_gradients(4, 8, 1, counts) for counts in (range(2, 9), range(5, 9), range(4, 5))] == [
        True, False, True]


def test_worker_counts_the_data_order_cannot_serve_are_refused_by_name():
    assert DataOrder(4, 8, 2, 8).check().grad_accum == 1  # up to the rows of a step: one row per rank
    for workers in (0, 9):
        with pytest.raises(DataOrderError, match=rf"^{workers} workers: the data order of 4 shards and a global "
                                                 r"batch of 8 rows serves 1 to 8 workers \(at least one row"):
            DataOrder(4, 8, 2, workers).check()
    with pytest.raises(DataOrderError, match=r"^a global batch of 6 rows cannot take the same rows from each of 4 "
                                             r"shards \(6 % 4 = 2\): world_batch_size must be a multiple"):
        DataOrder(4, 6, 2, 3).check()


def stream_dir(tmp_path, num_streams=4, rows=48):
    """Shards whose row i of shard s is [1000 s + i, ...]: identity by first id."""
    for s in range(num_streams):
        ids = (1000 * s + np.arange(rows, dtype=np.int32))[:, None] + np.zeros((1, 5), dtype=np.int32)
        write_shard(shard_path(tmp_path, "train", s), ids, row_group_size=7)
    return tmp_path


def global_micro_batches(data_dir, order: DataOrder, steps: int) -> list[list[list[int]]]:
    """Per step, per micro-batch: the rows of every rank's micro-batch, concatenated in rank order."""
    readers = [RankReader(order, rank, lambda s: ShardReader(shard_path(data_dir, "train", s), s, 5, 5))
               for rank in range(order.world_size)]
    return [[[int(row[0]) for rank in readers for row in rank.next_micro_batch().ids]
             for _ in range(order.grad_accum)] for _ in range(steps)]


def test_the_rows_of_every_step_do_not_depend_on_the_worker_count(tmp_path):
    data_dir = stream_dir(tmp_path)
    reference = global_micro_batches(data_dir, DataOrder(4, 8, 1, 4), 5)  # 4 ranks, GA 2
    assert {row // 1000 for row in reference[0][0]} == {0, 1, 2, 3}  # every stream in every micro-batch
    for world_size, micro in ((2, 2), (1, 4), (8, 1)):
        order = DataOrder(4, 8 if world_size < 8 else 16, micro, world_size)
        if world_size == 8:  # 16 rows per step: GA 2 of 8 ranks; compare with 4 ranks at the same global batch
            assert global_micro_batches(data_dir, order, 5) == global_micro_batches(data_dir, DataOrder(4, 16, 2, 4), 5)
            continue
        assert global_micro_batches(data_dir, order, 5) == reference, world_size
    # unequal micro-batches: 3 ranks (rows 1, 1, 2 with m = 1 or 2), GA 2 as the reference
    for micro in (1, 2):
        assert global_micro_batches(data_dir, DataOrder(4, 8, micro, 3), 5) == reference, micro
    # another accumulation (GA 1, micro-batches of 4 x 2 rows): the same rows per step, grouped otherwise
    regrouped = global_micro_batches(data_dir, DataOrder(4, 8, 2, 4), 5)
    assert [sorted(sum(step, [])) for step in regrouped] == [sorted(sum(step, [])) for step in reference]
    assert regrouped[0] != [sum(reference[0], [])]
    for world_size in (3, 5, 6, 7):  # GA 1 too, with 2 or 3 rows per rank
        assert global_micro_batches(data_dir, DataOrder(4, 8, 4 if world_size == 3 else 1, world_size), 5) == regrouped


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_reader_resumes_on_another_worker_count(tmp_path, world_size):
    data_dir = stream_dir(tmp_path)
    uninterrupted = global_micro_batches(data_dir, DataOrder(4, 8, 1, 4), 6)
    order = DataOrder(4, 8, 2, world_size)
    readers = [RankReader(order, rank, lambda s: ShardReader(shard_path(data_dir, "train", s), s, 5, 5))
               for rank in range(world_size)]
    for reader in readers:
        reader.seek(3 * order.rows_per_stream_per_step)  # after step 3
    per_rank = [[[int(row[0]) for row in rank.next_micro_batch().ids] for rank in readers] for _ in range(6)]
    assert [[len(rows) for rows in micro] for micro in per_rank] == [[2, 2] if world_size == 2 else [1, 1, 2]] * 6
    resumed = [[sum(per_rank[2 * step + micro], []) for micro in range(2)] for step in range(3)]
    assert resumed == uninterrupted[3:]
    assert all(reader.position == 6 * order.rows_per_stream_per_step for reader in readers)


def test_collate_shifts_and_replaces_pad_by_eos_in_inputs_only():
    rows = np.array([[1, 2, 9, 3, 9], [4, 9, 5, 6, 7]], dtype=np.int32)
    batch = collate(Rows(rows, None, np.array([5, 6])), pad_id=9, eos_id=8)
    inputs, labels = batch.inputs, batch.labels
    assert inputs.dtype == labels.dtype == torch.int64 and batch.keys.tolist() == [5, 6]
    assert inputs.tolist() == [[1, 2, 8, 3], [4, 8, 5, 6]]
    assert labels.tolist() == [[2, 9, 3, 9], [9, 5, 6, 7]]


def test_collate_checks_labels_too_and_replaces_pad_in_inputs_only_with_high_special_ids():
    """Special ids >= 32 (pad 40, eos 33, vocabulary 64); the last id of a row is a label and never an input."""
    rows = np.array([[1, 40, 2, 50, 40], [40, 33, 63, 3, 4]], dtype=np.int32)
    batch = collate(Rows(rows, None, np.zeros(2)), pad_id=40, eos_id=33, vocab_size=64)
    inputs, labels = batch.inputs, batch.labels
    assert inputs.tolist() == [[1, 33, 2, 50], [33, 33, 63, 3]]
    assert labels.tolist() == [[40, 2, 50, 40], [33, 63, 3, 4]]
    rows[1, 4] = 64  # only ever a label
    with pytest.raises(ValueError, match=r"^token id 64 at \(row 1, position 4\) of the batch is outside the "
                                         r"model's vocabulary \[0, 64\)"):
        collate(Rows(rows, None, np.zeros(2)), pad_id=40, eos_id=33, vocab_size=64)


def test_a_loss_mask_column_is_read_and_unsupervised_labels_become_the_ignored_pad_id(tmp_path):
    ids = np.arange(12, dtype=np.int32).reshape(2, 6)
    mask = np.array([[0, 0, 1, 1, 0, 1], [1, 1, 0, 0, 0, 0]], dtype=np.uint8)
    path = tmp_path / "00000.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(list(ids), type=pa.list_(pa.int32())),
                             "loss_mask": pa.array(list(mask), type=pa.list_(pa.uint8()))}), path)
    rows = ShardReader(path, stream=0, seed=0, row_length=6).next_rows(2)
    order = np.argsort(rows.keys)
    assert rows.loss_mask[order].tolist() == mask.tolist() and rows.ids[order].tolist() == ids.tolist()
    batch = collate(rows[order], pad_id=40, eos_id=33)
    # label j is token j + 1, a target where mask[j + 1] is 1
    assert batch.labels.tolist() == [[40, 2, 3, 40, 5], [7, 40, 40, 40, 40]]
    assert batch.inputs.tolist() == [[0, 1, 2, 3, 4], [6, 7, 8, 9, 10]]


def test_validation_rows_are_the_first_rows_of_the_val_shards_sliced_like_training(tmp_path):
    data_dir, _ = make_dataset(tmp_path, num_shards=2, rows_per_shard=20, val_rows=40, row_group_size=16)
    tables = [pq.read_table(shard_path(data_dir, "val", s)).column("input_ids").to_pylist() for s in (0, 1)]
    rows = validation_rows(data_dir, DataOrder(2, 4, 2, 2), rank=1, eval_iters=10, row_length=33)
    assert rows.ids.tolist() == tables[1][:20]  # one shard per rank: the first rows of its own
    assert rows.keys.tolist() == [2**32 + i for i in range(20)]
    # one rank, micro-batches of 2 rows from each shard: validation micro-batch e holds rows 2e, 2e + 1 of both
    rows = validation_rows(data_dir, DataOrder(2, 4, 4, 1), rank=0, eval_iters=10, row_length=33)
    assert rows.ids.tolist() == [row for e in range(10) for s in (0, 1) for row in tables[s][2 * e:2 * e + 2]]
    # 3 ranks, rows 1, 1, 2 of each validation micro-batch of 2 rows from each shard
    order = DataOrder(2, 4, 1, 3)
    assert validation_rows(data_dir, order, rank=1, eval_iters=10, row_length=33).ids.tolist() == [
        tables[0][2 * e + 1] for e in range(10)]
    assert validation_rows(data_dir, order, rank=2, eval_iters=10, row_length=33).ids.tolist() == [
        row for e in range(10) for row in tables[1][2 * e:2 * e + 2]]
