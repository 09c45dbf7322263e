"""Per-rank shard reading: shuffle per row group with Random(seed + rank), pop from the end, exact resume, collate.

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
from huginn_ray.train.shard_reader import ShardReader, collate, validation_rows

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
    return [int(reader.next_row()[0]) // 5 for _ in range(count)]


def test_rows_are_shuffled_per_row_group_and_popped_from_the_end(shard):
    reader = ShardReader(shard, seed=233 + 1, row_length=5)
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
        reader.next_row()


@pytest.mark.parametrize("stop_after", [0, 3, 8, 13, 49])
def test_resumed_reader_reads_exactly_the_remaining_rows(shard, stop_after):
    uninterrupted = first_ids(ShardReader(shard, seed=7, row_length=5), 50)
    first = ShardReader(shard, seed=7, row_length=5)
    head = first_ids(first, stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # survives a text round trip
    resumed = ShardReader(shard, seed=7, row_length=5)
    resumed.load_state_dict(state)
    assert head + first_ids(resumed, 50 - stop_after) == uninterrupted


def test_reader_refuses_state_of_another_shard(shard, tmp_path):
    other = tmp_path / "00001.parquet"
    write_shard(other, np.zeros((10, 5), dtype=np.int32), row_group_size=4)
    state = ShardReader(other, seed=1, row_length=5).state_dict()
    with pytest.raises(ValueError, match="00001.parquet"):
        ShardReader(shard, seed=1, row_length=5).load_state_dict(state)


def test_reader_refuses_rows_of_the_wrong_length(shard):
    with pytest.raises(ValueError, match="expected 6"):
        ShardReader(shard, seed=1, row_length=6).next_row()


def test_collate_shifts_and_replaces_pad_by_eos_in_inputs_only():
    rows = np.array([[1, 2, 9, 3, 9], [4, 9, 5, 6, 7]], dtype=np.int32)
    inputs, labels = collate(rows, pad_id=9, eos_id=8)
    assert inputs.dtype == labels.dtype == torch.int64
    assert inputs.tolist() == [[1, 2, 8, 3], [4, 8, 5, 6]]
    assert labels.tolist() == [[2, 9, 3, 9], [9, 5, 6, 7]]


def test_collate_checks_labels_too_and_replaces_pad_in_inputs_only_with_high_special_ids():
    """Special ids >= 32 (pad 40, eos 33, vocabulary 64); the last id of a row is a label and never an input."""
    rows = np.array([[1, 40, 2, 50, 40], [40, 33, 63, 3, 4]], dtype=np.int32)
    inputs, labels = collate(rows, pad_id=40, eos_id=33, vocab_size=64)
    assert inputs.tolist() == [[1, 33, 2, 50], [33, 33, 63, 3]]
    assert labels.tolist() == [[40, 2, 50, 40], [33, 63, 3, 4]]
    rows[1, 4] = 64  # only ever a label
    with pytest.raises(ValueError, match=r"^token id 64 at \(row 1, position 4\) of the batch is outside the "
                                         r"model's vocabulary \[0, 64\)"):
        collate(rows, pad_id=40, eos_id=33, vocab_size=64)


def test_validation_rows_are_the_first_rows_of_the_rank_s_val_shard(tmp_path):
    data_dir, _ = make_dataset(tmp_path, num_shards=2, rows_per_shard=20, val_rows=40, row_group_size=16)
    rows = validation_rows(data_dir, rank=1, count=20, row_length=33)
    table = pq.read_table(shard_path(data_dir, "val", 1)).column("input_ids").to_pylist()
    assert rows.tolist() == table[:20]
