"""The tokenizer's training corpus, sampled per source at file level from the staged data (§6.1).

Per source: the staged files in a seeded order, read row group by row group, each row group's rows in a seeded
order, until `rows_per_source` documents are taken, so a source contributes about as many bytes as it keeps, not
all of its staged rows. Both orders are the project's keyed-hash permutations (huginn_ray/data/permutation.py:
`FeistelPermutation` under the run seed, its stage naming the source, and the file and row group for a row
order), not a library random stream, so the sample is defined by this code alone; tests/test_data_units.py pins
one. Each document is cut to
`max_chars_per_doc` characters. Chat sources contribute their message contents joined by newlines (as §6.1
does), not the chat-templated text the model trains on; so do `kind: chat` sources, whose staged documents are
conversations in JSON. The reference's fastText English filter is not applied.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from huginn_ray.data.permutation import FeistelPermutation


def message_contents(staged: str) -> str:
    """A pretraining chat source's staged document (its parts in JSON: text strings and `[role, content]`
    messages) -> its message contents joined by newlines; a document without messages gives its text."""
    parts = json.loads(staged)
    contents = [part[1] for part in parts if not isinstance(part, str)]
    return "\n".join(contents) if contents else "".join(parts)


def conversation_contents(staged: str) -> str:
    """A `kind: chat` source's staged conversation (a JSON list of {role, content}) -> its contents joined by
    newlines."""
    return "\n".join(message["content"] for message in json.loads(staged))


def sample_order(n: int, seed: int, stage: str) -> np.ndarray:
    """The seeded order of n items (files of a source, rows of a row group) the sample takes them in."""
    return FeistelPermutation(n, seed, stage)(np.arange(n))


def source_sample(name: str, files: list[Path], rows_per_source: int, max_chars: int, seed: int,
                  chat: bool, conversations: bool = False) -> Iterator[str]:
    """Up to `rows_per_source` documents of one source, reading only the files (and row groups) it needs."""
    taken = 0
    for file_index in sample_order(len(files), seed, f"tokenizer_corpus:{name}"):
        pf = pq.ParquetFile(files[file_index])
        for group in range(pf.num_row_groups):
            texts = pf.read_row_group(group, columns=["text"]).column("text").to_pylist()
            for i in sample_order(len(texts), seed, f"tokenizer_corpus:{name}:{file_index}:{group}"):
                text = (conversation_contents(texts[i]) if conversations else
                        message_contents(texts[i]) if chat else texts[i])
                yield text[:max_chars]
                taken += 1
                if taken >= rows_per_source:
                    return


def corpus_texts(staged: dict[str, list[Path]], rows_per_source: int, max_chars: int, seed: int,
                 chat_sources: frozenset[str] = frozenset(),
                 conversation_sources: frozenset[str] = frozenset()) -> Iterator[str]:
    if not any(staged.values()):
        raise ValueError("no staged documents to train the tokenizer on")
    for name, files in staged.items():
        if files:
            yield from source_sample(name, files, rows_per_source, max_chars, seed, name in chat_sources,
                                     name in conversation_sources)
