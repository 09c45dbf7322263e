"""Rows longer than a staged file: the plan packs per file as the pack stage does, and the shuffle refuses too
few rows by seq_len before it reads anything."""

import pytest

from huginn_ray.data.formatting import DataError
from huginn_ray.data.pipeline import check_rows_for_shards
from huginn_ray.data.plan_sources import pack_batches


def test_plan_batches_never_span_two_files():
    lengths = [5, 6, 7, 8, 9, 10, 11]
    # three files: documents 0-2, 3 (alone), 4-6; batches of at most two documents
    assert pack_batches(lengths, [0, 3, 4], 2) == [[5, 6], [7], [8], [9, 10], [11]]
    assert pack_batches(lengths, [0, 3, 3, 4], 4) == [[5, 6, 7], [8], [9, 10, 11]]  # an empty file adds nothing


def marker(train_rows: int) -> dict:
    return {"seq_len": 131072, "sources": {"a": {"train_rows": train_rows, "doc_tokens": 600_000},
                                           "b": {"train_rows": 0, "doc_tokens": 22_311}}}


def test_too_few_rows_for_the_shards_are_refused_naming_seq_len():
    check_rows_for_shards(marker(2), 2)
    with pytest.raises(DataError) as err:
        check_rows_for_shards(marker(0), 2)
    assert str(err.value).startswith("seq_len=131072: the pack stage cut 0 train rows from 622,311 document tokens, "
                                      "fewer than num_shards=2. A row's 131,073 tokens come from one pack batch")
