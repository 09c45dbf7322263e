"""The training reader's read-ahead (huginn_ray.train.shard_reader.StepPrefetcher): the same rows in the same
order as reading synchronously, a position that counts the rows consumed (not the ones read ahead), so a resume
is exact, and a read error raised by the step that would have trained on those rows.

Real parquet shards and the real ShardReader / RankReader; pinning (`pin=True`) needs a CUDA device and is
exercised by bench/gpu_check.py on one.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from huginn_ray.train.data_order import DataOrder
from huginn_ray.train.shard_reader import RankReader, ShardReader, StepPrefetcher, collate
from test_train_data import shard, write_shard  # noqa: F401 - shard: 50 rows of 5 ids, 7 row groups

MICRO_BATCH, MICRO_BATCHES = 3, 2  # 6 rows per step: 8 whole steps in a shard of 50 rows
PAD, EOS = 7, 3


def rank_reader(path, micro_batch=MICRO_BATCH, micro_batches=MICRO_BATCHES) -> RankReader:
    order = DataOrder(1, micro_batch * micro_batches, micro_batch, 1)
    return RankReader(order, 0, lambda stream: ShardReader(path, stream, seed=11, row_length=5))


def prefetcher(path) -> StepPrefetcher:
    return StepPrefetcher(rank_reader(path), MICRO_BATCHES, lambda rows: collate(rows, PAD, EOS), pin=False)


def step_ids(batches) -> list[list[int]]:
    """A step's rows by identity, micro-batch by micro-batch: row i's labels start at id 5i + 1."""
    return [[int(first) // 5 for first in batch.labels[:, 0]] for batch in batches]


def synchronous_steps(path, steps: int) -> list[list[list[int]]]:
    """What the loop read before the prefetcher: one micro-batch after the other on the critical path."""
    reader = rank_reader(path)
    return [[[int(r[1]) // 5 for r in reader.next_micro_batch().ids] for _ in range(MICRO_BATCHES)]
            for _ in range(steps)]


def test_the_same_rows_in_the_same_order_as_a_synchronous_read_then_the_shard_ends(shard):
    reading = prefetcher(shard)
    got = [step_ids(reading.next_step()) for _ in range(8)]
    assert got == synchronous_steps(shard, 8)
    with pytest.raises(StopIteration, match="all 50 rows read"):  # 2 rows left, a step needs 6
        reading.next_step()


@pytest.mark.parametrize("consumed", [0, 1, 3, 7])
def test_the_position_is_the_consumed_rows_and_a_resume_continues_exactly(shard, consumed):
    uninterrupted = synchronous_steps(shard, 8)
    reading = prefetcher(shard)
    head = [step_ids(reading.next_step()) for _ in range(consumed)]
    if consumed:  # the next step's rows are read ahead: the reader itself stands further on
        reading.pending.result()
        assert reading.reader.position == (consumed + 1) * MICRO_BATCH * MICRO_BATCHES
    assert reading.position == consumed * MICRO_BATCH * MICRO_BATCHES  # exactly the consumed rows
    resumed = prefetcher(shard)
    resumed.seek(reading.position)
    assert head + [step_ids(resumed.next_step()) for _ in range(8 - consumed)] == uninterrupted


def test_seeking_mid_run_drops_what_was_read_ahead(shard):
    uninterrupted = synchronous_steps(shard, 8)
    reading = prefetcher(shard)
    reading.next_step()
    after_one = reading.position
    reading.next_step(), reading.next_step()
    reading.seek(after_one)  # a rewind, with step 4's rows read ahead
    assert [step_ids(reading.next_step()) for _ in range(7)] == uninterrupted[1:]


def test_a_bad_row_group_stops_the_step_that_reaches_it_not_the_one_that_read_ahead(tmp_path):
    path = tmp_path / "00000.parquet"
    rows = [list(range(5 * i, 5 * i + 5)) for i in range(16)]
    rows[10] = rows[10] + [0]  # row group 1 (rows 8..15) holds a row of 6 ids
    pq.write_table(pa.table({"input_ids": pa.array(rows, type=pa.list_(pa.int32()))}), path, row_group_size=8)
    reading = StepPrefetcher(rank_reader(path, 4, 1), 1, lambda r: collate(r, PAD, EOS), pin=False)
    reading.next_step()
    reading.next_step()  # the rest of row group 0; row group 1 is read ahead meanwhile and fails
    assert reading.pending.exception() is not None
    with pytest.raises(ValueError, match=r"00000.parquet: row group 1, row 2 has 6 values in input_ids, expected 5"):
        reading.next_step()
