"""The tokenizer's training corpus, assembled with Ray Data from the staged sources (§6.1).

Per source: the staged documents in a seeded random block order, the first `rows_per_source` of them, each cut
to `max_chars_per_doc` characters. The reference's fastText English filter is not applied.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc


def _cap_chars(batch: pa.Table, max_chars: int) -> pa.Table:
    return pa.table({"text": pc.utf8_slice_codeunits(batch.column("text"), 0, max_chars)})


def corpus_texts(staged: dict[str, list[Path]], rows_per_source: int, max_chars: int, seed: int) -> Iterator[str]:
    import ray.data

    parts = []
    for name, files in staged.items():
        if not files:
            continue
        parts.append(ray.data.read_parquet([str(f) for f in files]).select_columns(["text"])
                     .randomize_block_order(seed=seed).limit(rows_per_source))
    if not parts:
        raise ValueError("no staged documents to train the tokenizer on")
    ds = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
    ds = ds.map_batches(_cap_chars, fn_kwargs={"max_chars": max_chars}, batch_format="pyarrow")
    for batch in ds.iter_batches(batch_size=1024, batch_format="pyarrow"):
        yield from batch.column("text").to_pylist()
