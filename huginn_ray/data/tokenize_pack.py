"""Tokenise + pack: staged documents -> rows of seq_len + 1 ids in `packed/`, independent of the cluster.

One Ray Data dataset carries the documents as records, streaming from operator to operator (Ray Data's
backpressure between them, progress in records):

    read_datasource(staged_documents)    the documents (text, doc_id, their batch), one read task per unit
      -> map_batches(TokenizeDocuments)   actor pool, one actor per CPU, the tokenizer loaded once per actor: ids
                                          (a chat conversation: ids and loss mask), hold-out and copy decisions
      -> write_datasink(packed_files)     per pack batch: up-weighting, packing, one parquet file, committed

Work is cut by document identity, not by how a reader happens to split files into blocks: a pack batch is a
staged file's run of `docs_per_pack_batch` consecutive documents (`pack_batches`), named by its first document;
a read unit is one batch, or consecutive small batches of at most `docs_per_pack_batch` documents together
(`read_units`), and every block from the read to the write holds whole batches (Ray Data's splitting of blocks is
off while the stage runs; `whole_batches` refuses a block that holds part of one). The encoder uses the Rust
`tokenizers` batch encoder (the post-processor adds BOS/EOS per document; a special token's string inside a
document is encoded as text, so EOS marks only the end of a document: `load_text_tokenizer`; a pretraining chat
document is rendered from its staged parts, the template's structure as ids: huginn_ray/data/chat.py
`render_document`) and decides per document, from seeded hashes of its text, validation hold-out (so a document
and all its up-weighted copies are on one side) and membership of a partial copy. The writer up-weights, packs
(huginn_ray/data/packing.py) and writes `packed/SSSS-DDDDDDDDDDDDDDDD.parquet` (source index, hex doc_id of the
batch's first document) with columns `input_ids` (list<uint16> for vocabularies <= 65,536 ids, else list<int32>)
and `split` (0 train, 1 val); the batch's statistics are stored in the file's schema metadata.

A chat source's batch (`kind: chat`, staged as one JSON conversation per document) is rendered with the released
chat template (huginn_ray/data/chat.py) instead of encoded, held out and up-weighted by the same rules, and laid out
in rows with the data config's `chat.pack`: one conversation per row, padded (the reference's layout), or whole
conversations packed in order, as many per row as fit. Its file has a third column, `loss_mask` (list<uint8>, 1
where the token is a training target), row-aligned with `input_ids`; its statistics add the conversations'
supervised tokens (loss-mask ones after a row's first token, which is never a target), padding and truncations. The
rows, the files and their names are therefore a function of the staged data, the tokenizer and the settings only,
whatever the number of CPUs.

Memory: an encoder actor declares `pack_task_memory` of its read units (their sources' mean document and their
staged files' largest one, recorded by staging); units of different declarations go to different datasets, run one
after the other, each with its own actor pool. A document longer than `max_document_chars` is refused by name
before anything runs (`check_document_sizes`). A killed actor or writer: the units not yet written run again with
twice the memory (execution.rerun_killed).

Resumable: files are written under a temporary name and renamed when complete, in `packed.partial/`, keyed by the
stage's fingerprint; a rerun reads the statistics of every committed file back from its metadata and reads,
encodes and packs only the missing batches.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.chat import pack_rows, pad_rows, render, render_document
from huginn_ray.data.execution import (block_size, declared_memory, node_memory_cap, quiet_remote_args, rerun_killed,
                                        table_sink, unit_reads)
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
    """Refuse, before the stage reads a document, a document longer than `max_document_chars` characters, naming
    its source, staged file (and the input file it came from), row and doc_id. Staging recorded each file's largest
    document, so only a file that holds one is read (its text lengths)."""
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


BATCH = "batch"
"""The column that names a record's pack batch (its plan entry as JSON) through the stage's operators."""


def read_unit(unit: list[dict]) -> list[pa.Table]:
    """The read of one unit (consecutive pack batches): their documents (`text`, `doc_id`) and batch, one block."""
    tables = []
    for batch in unit:
        table = read_row_range(batch["path"], batch["start"], batch["count"], ["text", "doc_id"])
        if table.num_rows != batch["count"]:
            raise DataError(f"source {batch['source']!r}: {batch['path']} holds {table.num_rows} documents from row "
                            f"{batch['start'] + 1}, its staging marker {batch['count']}: staged again since it "
                            "was planned; rerun the staging stage")
        tables.append(table.append_column(BATCH, pa.array([json.dumps(batch)] * table.num_rows, pa.string())))
    return [pa.concat_tables(tables)]


def read_units(batches: list[dict], docs: int) -> list[list[dict]]:
    """The batches in read units: consecutive batches of at most `docs` documents together (a batch of `docs`
    documents alone), so that small batches (small files) do not each cost a read task, an encoder call and a
    write task."""
    units: list[list[dict]] = []
    for batch in batches:
        if units and sum(b["count"] for b in units[-1]) + batch["count"] <= docs:
            units[-1].append(batch)
        else:
            units.append([batch])
    return units


def staged_documents(units: list[list[dict]]):
    """The stage's read: a Ray Data datasource of the staged documents, one read task and one block per unit of
    whole pack batches (so that a batch's documents reach the encoder and the writer together)."""
    return unit_reads("staged_documents", units, read_unit, rows=lambda unit: sum(b["count"] for b in unit),
                      files=lambda unit: sorted({b["path"] for b in unit}))


def whole_batches(table: pa.Table) -> list[tuple[dict, pa.Table]]:
    """The pack batches a block holds, each with its records, checked whole (Ray Data must not have split the
    read's blocks: run_pack turns their splitting off)."""
    names = table.column(BATCH)
    out, row = [], 0
    while row < table.num_rows:
        batch = json.loads(names[row].as_py())
        records = table.slice(row, batch["count"])
        if records.num_rows != batch["count"] or records.column(BATCH).unique().to_pylist() != [names[row].as_py()]:
            raise RuntimeError(f"tokenize_pack: a block holds part of pack batch {batch['name']} (from row {row}), "
                               f"not its {batch['count']} records together")
        out.append((batch, records))
        row += batch["count"]
    return out


class TokenizeDocuments:
    """The stage's encoder, a callable class on an actor pool: the tokenizer is loaded once per actor. One call =
    one pack batch (a block): each document becomes its ids (a chat conversation: ids and loss mask, rendered with
    the template), checked against the vocabulary, with its hold-out and partial-copy decisions (seeded hashes of
    its text), so that the writer needs no text."""

    def __init__(self, tokenizer_file: str, seed: int, val_fraction: float, vocab_size: int, dtype: str):
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one actor = one CPU: keep the Rust encoder on it
        self.tokenizer = load_text_tokenizer(tokenizer_file)  # a special token's string inside a document is text
        self.seed, self.val_fraction, self.vocab_size, self.dtype = seed, val_fraction, vocab_size, dtype

    def __call__(self, table: pa.Table) -> pa.Table:
        return pa.concat_tables([self.encode(batch, records) for batch, records in whole_batches(table)])

    def encode(self, batch: dict, table: pa.Table) -> pa.Table:
        texts = table.column("text").to_pylist()
        first_doc_id = int(table.column("doc_id")[0].as_py())
        if batch["chat"] is not None:
            docs = [np.asarray(render(json.loads(t), self.tokenizer, batch["chat"]["loss_on"]), np.int32)
                    for t in texts]
        elif batch["templated"]:  # a pretraining chat document, staged as its parts
            docs = [np.asarray(render_document(json.loads(t), self.tokenizer), np.int32) for t in texts]
        else:
            docs = []
            for i in range(0, len(texts), ENCODE_CHUNK):  # Encoding objects cost ~100 bytes per token: keep few
                docs += [np.asarray(e.ids, np.int32)
                         for e in self.tokenizer.encode_batch_fast(texts[i:i + ENCODE_CHUNK])]
        ids = [d[0] for d in docs] if batch["chat"] is not None else docs  # a chat doc: (2, n) ids and loss mask
        try:
            check_ids(np.concatenate(ids) if ids else np.zeros(0, np.int32), self.vocab_size, self.dtype, "")
        except TokenRangeError:  # name the document: nothing of this batch has been written
            for i, d in enumerate(ids):
                check_ids(d, self.vocab_size, self.dtype, f"source {batch['source']!r}: {batch['path']}, document "
                                                          f"doc_id={first_doc_id + i}")
        fractions = copy_fractions(batch["weight"])
        partial = len(fractions) - 1 if fractions[-1] < 1.0 else None
        # every batch's block has the same columns (a chat source's mask; empty lists elsewhere), so that blocks
        # of several sources concatenate
        masks = [d[1] for d in docs] if batch["chat"] is not None else [np.zeros(0, np.uint8)] * len(docs)
        return pa.table({
            "ids": _lists(ids, pa.int32()),
            MASK: _lists(masks, pa.uint8()),
            "val": pa.array([unit_hash(self.seed, "val", t) < self.val_fraction for t in texts]),
            "partial": pa.array([partial is not None and unit_hash(self.seed, f"copy{partial}", t) < fractions[-1]
                                 for t in texts]),
            BATCH: table.column(BATCH)})


def _lists(arrays: list[np.ndarray], type_: pa.DataType) -> pa.LargeListArray:
    """One list per array, without a Python loop over the elements (64-bit offsets: a batch may hold more than
    2^31 ids)."""
    lengths = np.fromiter((len(a) for a in arrays), np.int64, len(arrays))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.concatenate(arrays).astype(type_.to_pandas_dtype()) if arrays else np.zeros(0, np.int32)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values, type_))


def _arrays(column: pa.ChunkedArray, dtype) -> list[np.ndarray]:
    """A list column back to one array per record (views of its values, no copy)."""
    array = column.combine_chunks()
    offsets = array.offsets.to_numpy()
    values = array.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return [values[offsets[i]:offsets[i + 1]] for i in range(len(array))]


def pack_batch(batch: dict, table: pa.Table, *, row_len: int, seed: int, dtype: str, out_dir: str) -> dict:
    """One pack batch's encoded documents (TokenizeDocuments' records of it) -> up-weighted, packed, written as
    the batch's file, committed; returns its statistics."""
    out = Path(out_dir) / batch["name"]
    ids = _arrays(table.column("ids"), np.int32)
    chat = batch["chat"]
    masks_in = _arrays(table.column(MASK), np.uint8) if chat is not None else None
    held_out = table.column("val").to_numpy(zero_copy_only=False)
    in_partial = table.column("partial").to_numpy(zero_copy_only=False)
    count, first_doc_id = len(ids), batch["first_doc"]

    parts, masks, splits = [], [], []
    copied_docs = pad_tokens = truncated = 0
    for copy, fraction in enumerate(copy_fractions(batch["weight"])):
        member = np.ones(count, bool) if fraction >= 1.0 else in_partial
        order = copy_order(seed, copy, first_doc_id, count)
        for split in (TRAIN, VAL):
            chosen = [i for i in order if member[i] and held_out[i] == (split == VAL)]
            copied_docs += len(chosen)
            if chat is not None:
                layout_rows = pack_rows if chat["pack"] else pad_rows
                rows_chat = layout_rows([(ids[i], masks_in[i]) for i in chosen], row_len, chat["pad_id"])
                rows = rows_chat.input_ids
                masks.append(rows_chat.loss_mask)
                pad_tokens += rows_chat.pad_tokens
                truncated += rows_chat.truncated
            else:
                rows = pack([ids[i] for i in chosen], [batch["sacred"]] * len(chosen), row_len)
            parts.append(rows)
            splits.append(np.full(len(rows), split, np.uint8))
    rows = np.concatenate(parts)
    split_col = np.concatenate(splits)
    stats = {"docs": count, "copied_docs": copied_docs, "doc_tokens": int(sum(len(d) for d in ids)),
             "train_rows": int((split_col == TRAIN).sum()), "val_rows": int((split_col == VAL).sum())}
    columns = {"input_ids": rows_to_arrow(rows, dtype)}
    if chat is not None:
        mask = np.concatenate(masks)
        stats.update(supervised_tokens=int(mask[:, 1:].sum()), pad_tokens=pad_tokens,
                     truncated_conversations=truncated)
        columns[MASK] = rows_to_arrow(mask, "uint8")
    columns["split"] = pa.array(split_col)
    schema = packed_schema(dtype, chat is not None).with_metadata(
        {STATS_KEY: json.dumps(stats, sort_keys=True).encode()})
    packed = pa.table(columns, schema=schema)
    tmp = layout.temp_path(out)
    pq.write_table(packed, tmp, **parquet_options(packed))
    layout.commit_file(tmp, out)
    return {**stats, "file": batch["name"], "source_index": batch["source_index"]}


def packed_files(settings: dict):
    """The stage's write: a Ray Data datasink that packs each pack batch of its blocks (whole batches of encoded
    documents) and writes it as the batch's file; the files' statistics are in `.results` once the write
    completes."""
    return table_sink("packed_files",
                      lambda tables: [pack_batch(batch, records, **settings) for table in tables
                                      for batch, records in whole_batches(table)],
                      lambda returns: [r for returned in returns for r in returned])


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


def pack_batches(sources: list[Source], staging_root: Path, markers: dict[str, dict], docs_per_batch: int,
                 chat_pack: bool = False, pad_id: int | None = None) -> list[dict]:
    """Every batch of the pack stage, in the packed data's global order: (source, staged file, row range)."""
    batches = []
    for index, source in enumerate(sources):
        if source.weight == 0:
            continue
        chat = {"loss_on": source.loss_on, "pack": chat_pack, "pad_id": pad_id} if source.is_chat else None
        for f in markers[source.name]["files"]:
            file_index = int(Path(f["output"]).stem)
            for start in range(0, f["rows"], docs_per_batch):
                first_doc = (file_index << 32) + start
                batches.append({"name": f"{index:04d}-{first_doc:016x}.parquet", "source_index": index,
                                "source": source.name, "path": str(staging_root / source.name / f["output"]),
                                "start": start, "count": min(docs_per_batch, f["rows"] - start),
                                "first_doc": first_doc, "max_chars": f["max_chars"],
                                "weight": source.weight, "sacred": source.every_token_is_sacred, "chat": chat,
                                "templated": source.needs_chat_templating})
    return batches


def pack_dataset(units: list[list[dict]], memory: int | None, *, encoder: dict, actors: int):
    """The stage's dataset for `units` (read_units), whose encoders declare `memory`: read -> encode (an actor pool
    of at most `actors`); the caller writes it (`.write_datasink(packed_files(...))`)."""
    import ray.data

    actors = max(1, min(actors, len(units)))
    with quiet_remote_args():
        # one read task and one block per unit (override_num_blocks: Ray Data would otherwise split the blocks of a
        # read with fewer tasks than it wants); reads take no CPU, so that the encoders may hold every CPU, and at
        # most `actors` run at once (each task in flight is a worker process)
        return ray.data.read_datasource(staged_documents(units), override_num_blocks=len(units), num_cpus=0,
                                        concurrency=actors).map_batches(
            TokenizeDocuments, fn_constructor_kwargs=encoder, batch_size=None, batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(min_size=1, max_size=actors),
            num_cpus=1, memory=memory, max_restarts=0)


def run_pack(sources: list[Source], markers: dict[str, dict], staging_root: Path, tokenizer_file: Path,
             out_root: Path, *, seq_len: int, seed: int, val_fraction: float, docs_per_batch: int, vocab_size: int,
             fingerprint: str, fingerprint_inputs: dict, extra_marker: dict, max_document_chars: int,
             chat_pack: bool = False) -> dict:
    """Tokenise and pack every source into `out_root` (skipped when complete); returns the pack marker."""
    import ray

    layout.finish_commit(out_root)
    if (marker := layout.current_marker(out_root, fingerprint, fingerprint_inputs, "pack")) is not None:
        print(f"[pack] complete ({marker['train_rows']} train + {marker['val_rows']} val rows), skipped", flush=True)
        return marker

    check_document_sizes(sources, markers, staging_root, max_document_chars)
    dtype = token_dtype(vocab_size)
    work = layout.resumable_work_dir(out_root, fingerprint, "pack", "packed files", inputs=fingerprint_inputs)

    batches = pack_batches(sources, staging_root, markers, docs_per_batch, chat_pack, extra_marker["pad_id"])
    results: dict[str, dict] = {}

    def read_back(names: list[str]) -> None:  # files committed by an earlier run or a killed attempt
        for name in names:
            if name not in results and (work / name).exists():
                stats = json.loads(pq.read_schema(work / name).metadata[STATS_KEY])
                results[name] = {**stats, "file": name, "source_index": int(name[:4])}

    read_back([b["name"] for b in batches])
    reused = len(results)
    units = read_units([b for b in batches if b["name"] not in results], docs_per_batch)
    # memory= per unit (a unit of short documents does not wait for the memory a batch of books needs): its
    # sources' mean document size and its staged files' largest document; one encoder pool per declaration
    mean_chars = {s.name: markers[s.name]["chars"] / max(1, markers[s.name]["rows"]) for s in sources}
    cap = node_memory_cap()
    declared = []
    for unit in units:
        docs = sum(b["count"] for b in unit)
        chars = sum(mean_chars[b["source"]] * b["count"] for b in unit)
        declared.append(declared_memory(pack_task_memory(docs, chars / docs, max(b["max_chars"] for b in unit)), cap))
    encoder = {"tokenizer_file": str(tokenizer_file), "seed": seed, "val_fraction": val_fraction,
               "vocab_size": vocab_size, "dtype": dtype}
    writer = {"row_len": seq_len + 1, "seed": seed, "dtype": dtype, "out_dir": str(work)}
    actors = int(ray.cluster_resources().get("CPU", 1))

    def run(todo: list[int], declared: list[int | None]) -> None:
        classes: dict[int | None, list[list[dict]]] = {}
        for i in todo:
            classes.setdefault(declared[i], []).append(units[i])
        for memory, members in sorted(classes.items(), key=lambda kv: kv[0] or 0):  # one dataset per class
            sink = packed_files(writer)
            try:
                pack_dataset(members, memory, encoder=encoder, actors=actors).write_datasink(
                    sink, ray_remote_args={"num_cpus": 0, "max_retries": 0}, concurrency=min(actors, len(members)))
            finally:
                for r in sink.results:
                    results[r["file"]] = r
                read_back([b["name"] for unit in members for b in unit])

    with block_size(None):  # whole pack batches in every block from read to write: no size splits
        rerun_killed(run, declared, name="tokenize_pack",
                     unfinished=lambda todo: [i for i in todo if any(b["name"] not in results for b in units[i])])
    results_in_order = [results[b["name"]] for b in batches]

    per_source = {s.name: {**{k: 0 for k in _STAT_KEYS}, "weight": s.weight,
                           "every_token_is_sacred": s.every_token_is_sacred} for s in sources}
    for s in sources:
        if s.is_chat:
            per_source[s.name].update({"kind": "chat", "loss_on": s.loss_on, "pack": chat_pack,
                                       **{k: 0 for k in CHAT_STAT_KEYS}})
    files = []
    for r in results_in_order:
        stats = per_source[sources[r["source_index"]].name]
        for key in _STAT_KEYS + (CHAT_STAT_KEYS if "supervised_tokens" in r else ()):
            stats[key] += int(r[key])
        if r["train_rows"] + r["val_rows"]:
            files.append({"file": r["file"], "train_rows": int(r["train_rows"]), "val_rows": int(r["val_rows"])})
    if reused:
        print(f"[pack] {reused}/{len(batches)} batches were already packed by an earlier run", flush=True)
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
