"""Tokenise + pack: staged documents -> rows of seq_len + 1 ids in `packed/`, independent of the cluster.

Work is cut by document identity, not by how a reader happens to split files into blocks: one task of the Ray
Data operator `tokenize_pack` (huginn_ray/data/execution.py) per (staged file, run of `docs_per_pack_batch`
consecutive documents of that file). A task reads exactly that row
range of the staged parquet file, encodes it with the Rust `tokenizers` batch encoder (the post-processor adds
BOS/EOS per document; a special token's string inside a document is encoded as text, so EOS marks only the end
of a document: `load_text_tokenizer`; a pretraining chat document is rendered from its staged parts, the
template's structure as ids: huginn_ray/data/chat.py `render_document`), splits held-out validation documents
from training documents (a seeded hash of the text,
so a document and all its up-weighted copies are on one side), up-weights, packs (huginn_ray/data/packing.py),
and writes `packed/SSSS-DDDDDDDDDDDDDDDD.parquet` (source index, hex doc_id of the batch's first document) with
columns `input_ids` (list<uint16> for vocabularies <= 65,536 ids, else list<int32>) and `split` (0 train,
1 val); the batch's statistics are stored in the file's schema metadata.

A chat source's batch (`kind: chat`, staged as one JSON conversation per document) is rendered with the released
chat template (huginn_ray/data/chat.py) instead of encoded, held out and up-weighted by the same rules, and laid out
in rows with the data config's `chat.pack`: one conversation per row, padded (the reference's layout), or whole
conversations packed in order, as many per row as fit. Its file has a third column, `loss_mask` (list<uint8>, 1
where the token is a training target), row-aligned with `input_ids`; its statistics add the conversations'
supervised tokens (loss-mask ones after a row's first token, which is never a target), padding and truncations. The rows, the files and their names are
therefore a function of the staged data, the tokenizer and the settings only, whatever the number of CPUs.

Memory: a task declares `pack_task_memory` from its source's mean document and its staged file's largest one
(recorded by staging); a document longer than `max_document_chars` is refused by name before any task runs
(`check_document_sizes`).

Resumable: files are written under a temporary name and renamed when complete, in `packed.partial/`, keyed by the
stage's fingerprint; a rerun after a crash keeps every committed file (its statistics are read back from its
metadata) and packs only the missing batches.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.chat import pack_rows, pad_rows, render, render_document
from huginn_ray.data.execution import run_tasks
from huginn_ray.data.formatting import DataError
from huginn_ray.data.packing import copy_fractions, copy_order, pack, unit_hash
from huginn_ray.data.shards import TRAIN, VAL
from huginn_ray.data.sources import Source
from huginn_ray.data.tokenizer import load_text_tokenizer
from huginn_ray.data.tokens import (MASK, TokenRangeError, arrow_type, check_ids, parquet_options, rows_to_arrow,
                                    token_dtype)

PACK_VERSION = 4  # 3: special-token strings in documents are encoded as text; 4: copy order by permutation.py
ENCODE_CHUNK = 256
STATS_KEY = b"huginn_ray.pack"
_STAT_KEYS = ("docs", "copied_docs", "doc_tokens", "train_rows", "val_rows")
CHAT_STAT_KEYS = ("supervised_tokens", "pad_tokens", "truncated_conversations")
"""A chat source's statistics besides _STAT_KEYS (its docs are conversations)."""


TASK_OVERHEAD = 256 << 20
"""A pack worker's own footprint (interpreter, pyarrow, the tokenizer), part of every task's memory=."""
BATCH_BYTES_PER_CHAR = 24
"""Memory per character of a batch's documents: their text, ids and packed rows, and the encodings of one
ENCODE_CHUNK of documents of the mean size."""
DOC_BYTES_PER_CHAR = 180
"""Memory per character of the batch's largest document while it is encoded: its `Encoding` (ids, offsets,
tokens, ~290 bytes per token) and ids. Measured 161-173 bytes per character (ru_maxrss growth of encoding one
document of 10 M and 40 M characters of English prose with the demo's 4,096-id tokenizer, 1.76 characters per
token; 2026-11-25, the 2-core machine); a larger vocabulary's tokens cover more characters."""


def pack_task_memory(count: int, mean_chars: float, max_chars: int) -> int:
    """The memory= of a pack task of `count` documents of `mean_chars` characters on average (its source's), the
    largest of which (its staged file's, recorded by staging) has `max_chars`: one very large document is what
    a mean-sized estimate misses (its Encoding alone grows by DOC_BYTES_PER_CHAR per character)."""
    return int(TASK_OVERHEAD + BATCH_BYTES_PER_CHAR * mean_chars * count + DOC_BYTES_PER_CHAR * max_chars)


def check_document_sizes(sources: list[Source], markers: dict[str, dict], staging_root: Path,
                         max_document_chars: int) -> None:
    """Refuse, before any pack task runs, a document longer than `max_document_chars` characters, naming its source,
    staged file (and the input file it came from), row and doc_id. Staging recorded each file's largest document,
    so only a file that holds one is read (its text lengths)."""
    import pyarrow.compute as pc

    for source in sources:
        if source.weight == 0:
            continue
        for f in markers[source.name]["files"]:
            if f["max_chars"] <= max_document_chars:
                continue
            path = staging_root / source.name / f["output"]
            table = pq.read_table(path, columns=["text", "doc_id"])
            lengths = pc.utf8_length(table.column("text"))
            row = int(pc.index(pc.greater(lengths, max_document_chars), True).as_py())  # the first one
            chars = lengths[row].as_py()
            raise DataError(
                f"source {source.name!r}: document {row + 1} of {path} (from {f['input']}, doc_id="
                f"{table.column('doc_id')[row].as_py()}) has {chars:,} characters, more than "
                f"max_document_chars={max_document_chars:,}: its pack task would need about "
                f"{pack_task_memory(1, 0, chars) / 2**30:.1f} GiB; remove the document from the source, or "
                "raise max_document_chars if the nodes have the memory (documents are refused, not split: a split "
                "would change which of its tokens the packing rule keeps)")


def packed_schema(dtype: str, chat: bool = False) -> pa.Schema:
    return pa.schema([("input_ids", pa.list_(arrow_type(dtype))),
                      *([(MASK, pa.list_(pa.uint8()))] if chat else []), ("split", pa.uint8())])


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str):
    # One Ray task = one CPU: keep the Rust encoder on this task's core.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return load_text_tokenizer(path)  # a special token's string inside a document is text


def read_row_range(path: str | Path, start: int, count: int, columns: list[str]) -> pa.Table:
    """Rows [start, start + count) of a parquet file, reading only the row groups that hold them."""
    pf = pq.ParquetFile(path)
    groups, first_row, row = [], None, 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if row + n > start and row < start + count:
            groups.append(g)
            first_row = row if first_row is None else first_row
        row += n
    if not groups:
        return pf.schema_arrow.empty_table().select(columns)
    table = pf.read_row_groups(groups, columns=columns)
    return table.slice(start - first_row, count)


def tokenize_and_pack(task: dict, *, tokenizer_file: str, row_len: int, seed: int, val_fraction: float,
                      vocab_size: int, dtype: str, out_dir: str) -> dict:
    """Ray task: one batch of staged documents (a row range of one staged file) -> one packed parquet file."""
    out = Path(out_dir) / task["name"]
    if out.exists():  # committed by an earlier (crashed) run of the same plan
        stats = json.loads(pq.read_schema(out).metadata[STATS_KEY])
        return {**stats, "file": task["name"], "source_index": task["source_index"], "reused": True}
    batch = read_row_range(task["path"], task["start"], task["count"], ["text", "doc_id"])
    texts = batch.column("text").to_pylist()
    first_doc_id = int(batch.column("doc_id")[0].as_py())
    tokenizer = _tokenizer(tokenizer_file)
    if task["chat"] is not None:
        docs = [np.asarray(render(json.loads(t), tokenizer, task["chat"]["loss_on"]), np.int32) for t in texts]
    elif task["templated"]:  # a pretraining chat document, staged as its parts
        docs = [np.asarray(render_document(json.loads(t), tokenizer), np.int32) for t in texts]
    else:
        docs = []
        for i in range(0, len(texts), ENCODE_CHUNK):  # Encoding objects cost ~100 bytes per token: keep few alive
            docs += [np.asarray(e.ids, np.int32) for e in tokenizer.encode_batch_fast(texts[i:i + ENCODE_CHUNK])]
    ids = [d[0] for d in docs] if task["chat"] is not None else docs  # a chat doc: (2, n) ids and loss mask
    try:
        check_ids(np.concatenate(ids) if ids else np.zeros(0, np.int32), vocab_size, dtype, "")
    except TokenRangeError:  # name the document: nothing of this batch has been written
        for i, d in enumerate(ids):
            check_ids(d, vocab_size, dtype, f"source {task['source']!r}: {task['path']}, document "
                                            f"doc_id={first_doc_id + i}")
    held_out = np.array([unit_hash(seed, "val", t) < val_fraction for t in texts])

    parts, masks, splits = [], [], []
    copied_docs = pad_tokens = truncated = 0
    for copy, fraction in enumerate(copy_fractions(task["weight"])):
        member = np.ones(len(texts), bool) if fraction >= 1.0 else \
            np.array([unit_hash(seed, f"copy{copy}", t) < fraction for t in texts])
        order = copy_order(seed, copy, first_doc_id, len(texts))
        for split in (TRAIN, VAL):
            chosen = [docs[i] for i in order if member[i] and held_out[i] == (split == VAL)]
            copied_docs += len(chosen)
            if task["chat"] is not None:
                layout_rows = pack_rows if task["chat"]["pack"] else pad_rows
                chat = layout_rows([(d[0], d[1]) for d in chosen], row_len, task["chat"]["pad_id"])
                rows = chat.input_ids
                masks.append(chat.loss_mask)
                pad_tokens += chat.pad_tokens
                truncated += chat.truncated
            else:
                rows = pack(chosen, [task["sacred"]] * len(chosen), row_len)
            parts.append(rows)
            splits.append(np.full(len(rows), split, np.uint8))
    rows = np.concatenate(parts)
    split_col = np.concatenate(splits)
    stats = {"docs": len(texts), "copied_docs": copied_docs, "doc_tokens": int(sum(len(d) for d in ids)),
             "train_rows": int((split_col == TRAIN).sum()), "val_rows": int((split_col == VAL).sum())}
    columns = {"input_ids": rows_to_arrow(rows, dtype)}
    if task["chat"] is not None:
        mask = np.concatenate(masks)
        stats.update(supervised_tokens=int(mask[:, 1:].sum()), pad_tokens=pad_tokens,
                     truncated_conversations=truncated)
        columns[MASK] = rows_to_arrow(mask, "uint8")
    columns["split"] = pa.array(split_col)
    schema = packed_schema(dtype, task["chat"] is not None).with_metadata(
        {STATS_KEY: json.dumps(stats, sort_keys=True).encode()})
    table = pa.table(columns, schema=schema)
    tmp = layout.temp_path(out)
    pq.write_table(table, tmp, **parquet_options(table))
    layout.commit_file(tmp, out)
    return {**stats, "file": task["name"], "source_index": task["source_index"], "reused": False}


def pack_fingerprint(sources: list[Source], staging_markers: dict[str, dict], tokenizer_sha256: str,
                     seq_len: int, seed: int, val_fraction: float, docs_per_batch: int,
                     chat_pack: bool) -> tuple[str, dict]:
    """The pack stage's fingerprint and its inputs (layout.stage_fingerprint: with the libraries' versions)."""
    return layout.stage_fingerprint({
        "version": PACK_VERSION, "tokenizer": tokenizer_sha256, "seq_len": seq_len, "seed": seed,
        "val_fraction": val_fraction, "docs_per_batch": docs_per_batch,
        "sources": [(s.name, s.weight, s.every_token_is_sacred, staging_markers[s.name]["fingerprint"],
                     *([s.loss_on, chat_pack] if s.is_chat else [])) for s in sources],
    })


def pack_tasks(sources: list[Source], staging_root: Path, markers: dict[str, dict], docs_per_batch: int,
               chat_pack: bool = False, pad_id: int | None = None) -> list:
    """Every batch of the pack stage, in the packed data's global order: (source, staged file, row range)."""
    tasks = []
    for index, source in enumerate(sources):
        if source.weight == 0:
            continue
        chat = {"loss_on": source.loss_on, "pack": chat_pack, "pad_id": pad_id} if source.is_chat else None
        for f in markers[source.name]["files"]:
            file_index = int(Path(f["output"]).stem)
            for start in range(0, f["rows"], docs_per_batch):
                first_doc = (file_index << 32) + start
                tasks.append({"name": f"{index:04d}-{first_doc:016x}.parquet", "source_index": index,
                              "source": source.name, "path": str(staging_root / source.name / f["output"]),
                              "start": start, "count": min(docs_per_batch, f["rows"] - start),
                              "max_chars": f["max_chars"],
                              "weight": source.weight, "sacred": source.every_token_is_sacred, "chat": chat,
                              "templated": source.needs_chat_templating})
    return tasks


def run_pack(sources: list[Source], markers: dict[str, dict], staging_root: Path, tokenizer_file: Path,
             out_root: Path, *, seq_len: int, seed: int, val_fraction: float, docs_per_batch: int, vocab_size: int,
             fingerprint: str, fingerprint_inputs: dict, extra_marker: dict, max_document_chars: int,
             chat_pack: bool = False) -> dict:
    """Tokenise and pack every source into `out_root` (skipped when complete); returns the pack marker."""
    layout.finish_commit(out_root)
    if (marker := layout.current_marker(out_root, fingerprint, fingerprint_inputs, "pack")) is not None:
        print(f"[pack] complete ({marker['train_rows']} train + {marker['val_rows']} val rows), skipped", flush=True)
        return marker

    check_document_sizes(sources, markers, staging_root, max_document_chars)
    dtype = token_dtype(vocab_size)
    work = layout.resumable_work_dir(out_root, fingerprint, "pack", "packed files", inputs=fingerprint_inputs)

    tasks = pack_tasks(sources, staging_root, markers, docs_per_batch, chat_pack, extra_marker["pad_id"])
    # memory= per task, from its own batch (a batch of short documents does not wait for the memory a batch of
    # books needs): its source's mean document size and its staged file's largest document
    mean_chars = {s.name: markers[s.name]["chars"] / max(1, markers[s.name]["rows"]) for s in sources}
    memory = [pack_task_memory(t["count"], mean_chars[t["source"]], t["max_chars"]) for t in tasks]
    kwargs = {"tokenizer_file": str(tokenizer_file), "row_len": seq_len + 1, "seed": seed,
              "val_fraction": val_fraction, "vocab_size": vocab_size, "dtype": dtype, "out_dir": str(work)}
    results = run_tasks(tokenize_and_pack, [(t,) for t in tasks], name="tokenize_pack", common=kwargs,
                        memory=memory)

    per_source = {s.name: {**{k: 0 for k in _STAT_KEYS}, "weight": s.weight,
                           "every_token_is_sacred": s.every_token_is_sacred} for s in sources}
    for s in sources:
        if s.is_chat:
            per_source[s.name].update({"kind": "chat", "loss_on": s.loss_on, "pack": chat_pack,
                                       **{k: 0 for k in CHAT_STAT_KEYS}})
    files = []
    for r in results:
        stats = per_source[sources[r["source_index"]].name]
        for key in _STAT_KEYS + (CHAT_STAT_KEYS if "supervised_tokens" in r else ()):
            stats[key] += int(r[key])
        if r["train_rows"] + r["val_rows"]:
            files.append({"file": r["file"], "train_rows": int(r["train_rows"]), "val_rows": int(r["val_rows"])})
    reused = sum(1 for r in results if r["reused"])
    if reused:
        print(f"[pack] {reused}/{len(results)} batches were already packed by an earlier run", flush=True)
    files.sort(key=lambda f: f["file"])
    marker = {
        "fingerprint": fingerprint, "fingerprint_inputs": fingerprint_inputs, "seq_len": seq_len, "seed": seed,
        "token_dtype": dtype, "files": files,
        "sources": per_source,
        "train_rows": sum(f["train_rows"] for f in files), "val_rows": sum(f["val_rows"] for f in files),
        **extra_marker,
    }
    layout.commit_work_dir(work, out_root, marker)
    for name, stats in per_source.items():
        if stats.get("kind") == "chat":
            print(f"[pack] {name}: {stats['docs']} conversations ({stats['copied_docs']} after weighting), "
                  f"{stats['doc_tokens']} tokens -> {stats['train_rows']} train + {stats['val_rows']} val rows "
                  f"({'packed' if chat_pack else 'one per row'}): {stats['supervised_tokens']} supervised, "
                  f"{stats['pad_tokens']} padding tokens; {stats['truncated_conversations']} conversations longer "
                  "than a row, truncated", flush=True)
            continue
        print(f"[pack] {name}: {stats['docs']} docs ({stats['copied_docs']} after weighting), "
              f"{stats['doc_tokens']} tokens -> "
              f"{stats['train_rows']} train + {stats['val_rows']} val rows", flush=True)
    return marker
