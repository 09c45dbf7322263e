"""What the plan (huginn_ray/data/plan.py) knows of each source: its input files and what a sample of them measures.

Files: a source's input files and their bytes come from its local files, the download stage's provenance when it
is already downloaded, or else the Hub's listing (`hub_listings`: file sizes from `dataset_info(files_metadata=True)`,
the same call the download stage makes).

Ratios: a source whose files are on this machine is *sampled* (`sample_source`): up to SAMPLE_BYTES of its input
files, in file order, are formatted exactly as staging does, encoded with the run's tokenizer (`plan_tokenizer`,
when it exists) and packed with the run's packing rule, which gives its text bytes per input byte, tokens per text
byte, packed tokens per document token, staged and packed bytes on disk per token. A source that cannot be sampled
takes the mean of the sampled sources (`mean_ratios`), or DEFAULTS when none was sampled.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.chat import pack_groups, render, render_document
from huginn_ray.data.config import DataConfig
from huginn_ray.data.formatting import iter_documents
from huginn_ray.data.hub_download import PROVENANCE
from huginn_ray.data.packing import pack_row_starts
from huginn_ray.data.sources import Source
from huginn_ray.data.staging import STAGING_SCHEMA, list_local_files
from huginn_ray.data.tokens import parquet_options, rows_to_arrow


def planned(source: Source) -> bool:
    """Whether the plan counts a source's files (a run leaves out sources of weight 0 and those it refuses)."""
    return source.is_packed or (source.weight > 0 and not source.requires_software_heritage_aws_download)


def input_files(cfg: DataConfig, source: Source, listing: dict) -> tuple[list[tuple[str, int, str]], bool, str | None]:
    """(path, bytes, name in the source) of a source's input files, whether they are on this machine, and the Hub
    commit if known."""
    if source.is_local:
        root = source.resolved_local_dir()
        return ([(str(p), p.stat().st_size, p.relative_to(root).as_posix()) for p in list_local_files(source)], True,
                None)
    marker = layout.read_marker(cfg.root / "download" / source.name, PROVENANCE)
    if marker is not None:
        root = cfg.root / "download" / source.name
        return [(str(root / f["path"]), int(f["size"]), f["path"]) for f in marker["files"]], True, marker["commit"]
    commit, files = listing[source.name]
    return [(f.path, f.size, f.path) for f in files], False, commit


def packed_splits(source: Source, files: list[tuple[str, int, str]]) -> dict[str, list[tuple[str, int]]]:
    """A packed source's files per split, by its train_files / val_files patterns (a run refuses a file that
    matches both or a split that matches none: pipeline.packed_source_files)."""
    import fnmatch

    return {split: [(path, size) for path, size, rel in files if any(fnmatch.fnmatch(rel, p) for p in patterns)]
            for split, patterns in (("train", source.train_files), ("val", source.val_files))}


def hub_listings(cfg: DataConfig, sources: list[Source]) -> dict:
    """The Hub's file listing of every source not on this machine (metadata only, with the download's retries)."""
    from huggingface_hub import constants, get_token

    from huginn_ray.data.hub_download import list_repo_files

    todo = [s for s in sources if not s.is_local and (s.weight > 0 or s.is_packed)
            and not s.requires_software_heritage_aws_download
            and layout.read_marker(cfg.root / "download" / s.name, PROVENANCE) is None]
    token = get_token() if todo else None
    return {s.name: list_repo_files(s.address, s.revision, s.file_patterns, constants.ENDPOINT, token, cfg.download)
            for s in todo}


def plan_tokenizer(cfg: DataConfig):
    """The run's tokenizer (None before it is trained) and its vocabulary size (the config's when None)."""
    from huginn_ray.data.tokenizer import TOKENIZER_FILE, load_text_tokenizer, special_token_ids

    path = cfg.tokenizer_dir / TOKENIZER_FILE
    if not path.is_file():
        return None, cfg.tokenizer.vocab_size
    return load_text_tokenizer(path), special_token_ids(cfg.tokenizer_dir)["vocab_size"]


SAMPLE_BYTES = 8 << 20
"""Per source: input bytes read to measure its ratios (whole files, in file order, at least one), and text bytes
kept of them to encode and pack (the first documents: a large first file is read, not encoded, past them)."""


@dataclass(frozen=True)
class Ratios:
    """What one source's sample measured (or the defaults for a source that was not sampled)."""

    text_per_input_byte: float
    """UTF-8 bytes of document text per byte of input file (compressed formats > 1)."""
    tokens_per_text_byte: float
    """Token ids (BOS/EOS included) per byte of text."""
    packed_per_token: float
    """Packed row tokens per document token for one copy (what incineration and batch leftovers keep)."""
    chars_per_text_byte: float
    """Characters per UTF-8 byte (the pack task's memory formula counts characters)."""
    staged_per_text_byte: float
    """Bytes of the staging parquet files (one per input file, footers included) per byte of text."""
    packed_file_per_token: float
    """Bytes of packed parquet per token (BYTE_STREAM_SPLIT + zstd, one batch's rows per file), less the
    per-file part."""
    shard_per_token: float
    """Bytes of shard parquet per token (row groups of shuffle.row_group_size), less the per-file part."""
    parquet_file_bytes: float
    """The per-file part of a packed or shard parquet file (footer, schema, statistics)."""
    docs_per_text_byte: float
    """Documents per byte of text."""


DEFAULTS = Ratios(text_per_input_byte=1.0, tokens_per_text_byte=0.25, packed_per_token=0.9,
                  chars_per_text_byte=1.0, staged_per_text_byte=0.5, packed_file_per_token=1.8,
                  shard_per_token=1.8, parquet_file_bytes=1500, docs_per_text_byte=1 / 4096)
"""Used when no source could be sampled: ~4 bytes per token (English BPE), 2 bytes per uint16 id x 0.9."""

EMPTY = Ratios(*([0.0] * len(Ratios.__dataclass_fields__)))
"""A sampled source whose files hold no document."""

TEXT_PER_INPUT_BYTE = {".parquet": 2.5, ".gz": 3.5, ".zst": 4.0}
"""Text bytes per compressed input byte for unsampled sources (typical zstd/snappy/gzip ratios on text)."""


def pack_batches(lengths: list[int], file_starts: list[int], docs_per_batch: int) -> list[list[int]]:
    """The document lengths in the pack stage's batches: each file's documents in runs of `docs_per_batch`
    (tokenize_pack.py: a row never spans two staged files, so a file shorter than a row packs to nothing)."""
    ends = file_starts[1:] + [len(lengths)]
    return [lengths[i:min(i + docs_per_batch, end)]
            for start, end in zip(file_starts, ends) for i in range(start, end, docs_per_batch)]


def sample_source(source: Source, files: list[tuple[str, int]], tokenizer, row_len: int, docs_per_batch: int,
                  dtype: str, row_group_size: int, chat_pack: bool = False) -> Ratios | None:
    """Format, encode and pack the first SAMPLE_BYTES of a source's files as the pipeline does (None: no text).
    A chat source's conversations are rendered with the chat template and laid out one per row or packed
    (`chat_pack`), in file order (the run lays out each split of a batch in a seeded order)."""
    texts: list[str] = []
    file_starts: list[int] = []  # where each file's documents start in `texts`: the run packs per staged file
    input_bytes = staged_bytes = read_text_bytes = text_bytes = 0
    for path, size in files:
        if input_bytes and input_bytes + size > SAMPLE_BYTES:
            break
        docs = []
        for batch in iter_documents(path, source):  # bad records are left out (staging applies the limit)
            for doc in batch.texts:
                n = len(doc.encode("utf-8", "surrogatepass"))
                read_text_bytes += n  # every document read counts for the text per input byte
                if text_bytes < SAMPLE_BYTES:
                    docs.append(doc)
                    text_bytes += n
        staged = io.BytesIO()  # one staging file per input file, as staging writes them
        pq.write_table(pa.table({"text": pa.array(docs, pa.large_string()), "source": [source.name] * len(docs),
                                 "doc_id": pa.array(range(len(docs)), pa.int64())}, schema=STAGING_SCHEMA), staged)
        staged_bytes += staged.tell()
        file_starts.append(len(texts))
        texts += docs
        input_bytes += size
    if not text_bytes:
        return None
    if source.is_chat:
        encoded = [render(json.loads(t), tokenizer, source.loss_on)[0] for t in texts]
        lengths = [len(ids) for ids in encoded]
        rows = sum(len(pack_groups(batch, row_len)) for batch in pack_batches(lengths, file_starts, docs_per_batch)
                   ) if chat_pack else len(lengths)
    else:
        if source.needs_chat_templating:  # staged as parts: the template's structure as ids, the text as text
            encoded = [render_document(json.loads(t), tokenizer) for t in texts]
            lengths = [len(ids) for ids in encoded]
        else:
            encoded = [e.ids for e in tokenizer.encode_batch_fast(texts[:256])]
            lengths = [len(e.ids) for e in tokenizer.encode_batch_fast(texts)]
        rows = sum(len(pack_row_starts(batch, [source.every_token_is_sacred] * len(batch), row_len))
                   for batch in pack_batches(lengths, file_starts, docs_per_batch))
    tokens = sum(lengths)
    ids = np.concatenate([np.asarray(e) for e in encoded[:256]])
    sample_rows = np.resize(ids, (max(1, len(ids) // row_len), row_len))  # real ids in rows, as packing cuts them

    def written_size(rows: np.ndarray, **options) -> int:
        table = pa.table({"input_ids": rows_to_arrow(rows, dtype), "split": pa.array(np.zeros(len(rows), np.uint8))})
        buf = io.BytesIO()
        pq.write_table(table, buf, **parquet_options(table), **options)
        return buf.tell()

    # zstd's gain depends on how many rows a file (packed: one batch) or row group (shards) holds, so the sample
    # is written in those units; the per-file part is what an empty file takes
    per_file = written_size(sample_rows[:0])
    batch_rows = max(1, round(docs_per_batch * tokens / len(texts) * rows * row_len / max(1, tokens) / row_len))
    chunks = [sample_rows[i:i + batch_rows] for i in range(0, len(sample_rows), batch_rows)]
    per_token = sum(written_size(c) - per_file for c in chunks) / sample_rows.size
    shard_per_token = (written_size(sample_rows, row_group_size=row_group_size) - per_file) / sample_rows.size
    return Ratios(text_per_input_byte=read_text_bytes / max(1, input_bytes), tokens_per_text_byte=tokens / text_bytes,
                  packed_per_token=rows * row_len / max(1, tokens),
                  chars_per_text_byte=sum(len(t) for t in texts) / text_bytes,
                  staged_per_text_byte=staged_bytes / text_bytes, packed_file_per_token=per_token,
                  shard_per_token=shard_per_token, parquet_file_bytes=per_file,
                  docs_per_text_byte=len(texts) / text_bytes)


def mean_ratios(ratios: list[Ratios]) -> Ratios:
    """The mean of the sampled sources' ratios (DEFAULTS when none was sampled)."""
    if not ratios:
        return DEFAULTS
    return Ratios(*(float(np.mean([getattr(r, f) for r in ratios])) for f in Ratios.__dataclass_fields__))
