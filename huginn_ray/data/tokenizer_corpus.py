"""The tokenizer's training corpus, sampled per source at file level from the staged data (§6.1).

Per source: the staged files in a seeded random order (seeded by the run seed and the source name), read row
group by row group, each file's rows in a seeded random order, until `rows_per_source` documents are taken, so a
source contributes about as many bytes as it keeps, not all of its staged rows. Each document is cut to
`max_chars_per_doc` characters. Chat sources contribute their message contents joined by newlines (as §6.1
does), not the chat-templated text the model trains on; so do `kind: chat` sources, whose staged documents are
conversations in JSON. The reference's fastText English filter is not applied.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

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


def _rng(seed: int, name: str, salt: int) -> np.random.Generator:
    return np.random.default_rng([seed, salt, int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")])


def source_sample(name: str, files: list[Path], rows_per_source: int, max_chars: int, seed: int,
                  chat: bool, conversations: bool = False) -> Iterator[str]:
    """Up to `rows_per_source` documents of one source, reading only the files (and row groups) it needs."""
    taken = 0
    for file_index in _rng(seed, name, 0).permutation(len(files)):
        pf = pq.ParquetFile(files[file_index])
        for group in range(pf.num_row_groups):
            texts = pf.read_row_group(group, columns=["text"]).column("text").to_pylist()
            for i in _rng(seed, f"{name}/{file_index}/{group}", 1).permutation(len(texts)):
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
