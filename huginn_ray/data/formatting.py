"""Turning one raw input file into documents: the `text` column of the staging parquet (§6.3).

Formats by file name: `*.parquet`; `*.jsonl` / `*.json` (one JSON object per line, optionally `.gz` or `.zst`);
anything else is a text file that becomes a single document (feature `text`). Rules for a row:

- `kind: chat` sources: each row is one conversation, kept as JSON (a list of {role, content}, the source's system
  prompt first) for the pack stage to render with a loss mask (huginn_ray/data/chat.py): from one column holding
  the messages, or from two text columns, the user's question and Huginn's answer;
- pretraining chat sources (`needs_chat_templating`): a feature holding a list of messages is rendered with the chat template;
  when all features are text (question, answer, ...), they become one user message each and the last one the
  assistant's (Huginn's) turn, rendered with the same template;
- one feature: its value is the document;
- several features: their values joined by newlines.

Empty documents are skipped. Any problem is a DataError naming the file (and the line or feature).
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

from huginn_ray.data.chat import check_messages
from huginn_ray.data.sources import Source

ASSISTANT_NAMES = {"gpt", "assistant"}  # renamed to Huginn, as in the reference
ROWS_PER_BATCH = 1024


class DataError(ValueError):
    """Bad input data; the message names the file (and line / feature / source)."""


def chat_template(messages: list) -> str:
    """`<|begin_header|>{role}<|end_header|>\\n\\n{content|trim}<|end_turn|>` per message; BOS/EOS come later."""
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"a chat message must be a mapping, got {type(message).__name__}")
        role = message.get("role", message.get("from"))
        content = message.get("content", message.get("value"))
        if not isinstance(role, str) or not isinstance(content, str):
            raise TypeError("a chat message needs string 'role'/'content' (or 'from'/'value')")
        if role.lower() in ASSISTANT_NAMES:
            role = "Huginn"
        parts.append(f"<|begin_header|>{role}<|end_header|>\n\n{content.strip()}<|end_turn|>")
    return "".join(parts)


def conversations(columns: dict[str, list], source: Source) -> list[str]:
    """A chat source's rows as conversations in JSON, [{"role": ..., "content": ...}, ...]; a row the template
    cannot render is refused naming it (its number in the batch) and the message."""
    features = source.features
    out = []
    for i in range(len(columns[features[0]])):
        if len(features) == 1:
            messages = columns[features[0]][i]
        else:
            question, answer = (columns[f][i] for f in features)
            for name, value in zip(features, (question, answer)):
                if not isinstance(value, str):
                    raise TypeError(f"row {i}: feature {name!r} holds {type(value).__name__}, not text")
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        try:
            check_messages(messages)
        except ValueError as err:
            raise TypeError(f"row {i}: feature {features[0]!r}: {err}") from None
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if source.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": source.system_prompt})
        out.append(json.dumps(messages, ensure_ascii=False))
    return out


def format_rows(columns: dict[str, list], source: Source) -> list[str]:
    """Documents from a batch of rows given as {feature: values}; empty documents are dropped."""
    if source.is_chat:
        return conversations(columns, source)
    features = source.features
    n = len(columns[features[0]])
    texts = []
    for i in range(n):
        values = [columns[f][i] for f in features]
        if source.needs_chat_templating and all(isinstance(v, str) or v is None for v in values):
            # chat source given as text columns (question, answer, ...): the last column is Huginn's turn,
            # the ones before it the user's (one message each)
            present = [v for v in values if v]
            messages = [{"role": "user", "content": v} for v in present[:-1]]
            if present:
                messages.append({"role": "assistant", "content": present[-1]})
            text = chat_template(messages)
        elif source.needs_chat_templating:
            text = "\n".join(v if isinstance(v, str) else chat_template(v) for v in values if v is not None)
        elif len(values) == 1:
            text = values[0]
            if text is not None and not isinstance(text, str):
                raise TypeError(f"feature {features[0]!r} holds {type(text).__name__}, not text")
        else:
            text = "\n".join("" if v is None else str(v) for v in values)
        if text:
            texts.append(text)
    return texts


def iter_documents(path: str | Path, source: Source) -> Iterator[list[str]]:
    """Yield the documents of one input file in batches; errors name the file."""
    path = Path(path)
    name = path.name.lower()
    try:
        if name.endswith(".parquet"):
            yield from _parquet_documents(path, source)
        elif name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")):
            yield from _jsonl_documents(path, source)
        else:
            yield from _text_documents(path, source)
    except DataError:
        raise
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise DataError(f"source {source.name!r}: cannot read {path}: {type(err).__name__}: {err}") from None


def _parquet_documents(path: Path, source: Source) -> Iterator[list[str]]:
    pf = pq.ParquetFile(path)
    missing = [f for f in source.features if f not in pf.schema_arrow.names]
    if missing:
        raise DataError(f"source {source.name!r}: {path} has no column {missing[0]!r} "
                        f"(columns: {', '.join(pf.schema_arrow.names)})")
    for batch in pf.iter_batches(batch_size=ROWS_PER_BATCH, columns=source.features):
        texts = format_rows({f: batch.column(f).to_pylist() for f in source.features}, source)
        if texts:
            yield texts


def _jsonl_documents(path: Path, source: Source) -> Iterator[list[str]]:
    lower = path.name.lower()
    if lower.endswith(".gz"):
        raw = gzip.open(path, "rb")
    elif lower.endswith(".zst"):  # zstd through pyarrow's codec: no extra dependency
        import pyarrow as pa

        raw = pa.input_stream(str(path), compression="zstd")
    else:
        raw = open(path, "rb")
    with raw, io.TextIOWrapper(raw, encoding="utf-8", errors="strict") as lines:
        rows: list[dict] = []
        line_no = 0
        for line_no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"source {source.name!r}: {path}, line {line_no}: invalid JSON: {err}") from None
            missing = [f for f in source.features if not isinstance(row, dict) or f not in row]
            if missing:
                raise DataError(f"source {source.name!r}: {path}, line {line_no}: no field {missing[0]!r}")
            rows.append(row)
            if len(rows) == ROWS_PER_BATCH:
                yield from _formatted(rows, source, path, line_no)
                rows = []
        if rows:
            yield from _formatted(rows, source, path, line_no)


def _formatted(rows: list[dict], source: Source, path: Path, line_no: int) -> Iterator[list[str]]:
    try:
        texts = format_rows({f: [r[f] for r in rows] for f in source.features}, source)
    except TypeError as err:
        raise DataError(f"source {source.name!r}: {path}, lines up to {line_no}: {err}") from None
    if texts:
        yield texts


def _text_documents(path: Path, source: Source) -> Iterator[list[str]]:
    if source.features != ["text"]:
        raise DataError(f"source {source.name!r}: {path} is a text file, so features must be [text], "
                        f"got {source.features}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"source {source.name!r}: {path} is not valid UTF-8 text: {err}") from None
    if text:
        yield [text]
