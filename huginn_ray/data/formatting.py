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

Empty documents are skipped. Any problem is a DataError naming the file (and the line or feature). JSON lines
are read by Arrow's JSON reader: a feature must hold text or null (a chat source's: text, null or a list of
messages), as json.loads would read it.
"""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.json as pj
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
        # a null key counts as absent: Arrow's JSON and parquet readers fill the keys a message lacks with null
        role = message.get("role") if message.get("role") is not None else message.get("from")
        content = message.get("content") if message.get("content") is not None else message.get("value")
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
    """Arrow's streaming JSON reader, reading only the features (typed: text, or chat message lists), in
    batches of ROWS_PER_BATCH rows. A line it cannot read is found by a second, line-by-line scan that names it
    (`_json_line_error`); that scan also runs once when a feature held null, since Arrow's reader reads a
    missing field as null and a line without a feature is an error."""
    schema = _json_schema(path, source)
    rows, saw_null = 0, False
    try:
        for batch in _rebatched(_json_blocks(path, schema), ROWS_PER_BATCH):
            saw_null = saw_null or any(column.null_count for column in batch.columns)
            yield from _formatted(batch, source, path, schema, rows + batch.num_rows)
            rows += batch.num_rows
    except pa.ArrowInvalid as err:
        raise _json_line_error(path, source, schema) or DataError(
            f"source {source.name!r}: {path}: Arrow's JSON reader failed ({err}) although every line parses "
            "on its own") from None
    error = _json_line_error(path, source, schema) if saw_null else None
    if error is not None:
        raise error


MESSAGE_KEYS = ("role", "content", "from", "value")  # what the chat template reads of a message
JSON_BLOCK_BYTES = 16 << 20  # the JSON reader's block; one longer line gets a block of its own size (see below)


def _message_list_type():
    return pa.list_(pa.struct([(key, pa.string()) for key in MESSAGE_KEYS]))


def _json_schema(path: Path, source: Source):
    """The features' Arrow types: text, except a chat source's (either kind) feature whose first non-null value
    among the file's first ROWS_PER_BATCH lines is a list (of messages): that one is read as the message list
    type (message keys other than role/content/from/value are not read: the chat templates use no others)."""
    types = {f: pa.large_string() for f in source.features}
    if source.needs_chat_templating or source.is_chat:
        untyped = set(source.features)
        with _open_text(path) as lines:
            for line in itertools.islice((line for line in lines if line.strip()), ROWS_PER_BATCH):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    break  # the reader fails on it and the scan names it
                for f in [f for f in untyped if isinstance(row, dict) and row.get(f) is not None]:
                    untyped.discard(f)
                    if isinstance(row[f], list):
                        types[f] = _message_list_type()
                if not untyped:
                    break
    return pa.schema(list(types.items()))


def _json_blocks(path: Path, schema):
    """Record batches of the features from Arrow's streaming JSON reader (one thread: a task is one CPU).

    A line longer than the block fails Arrow's reader ("straddles two block boundaries"); the file is then
    read again with a block that holds the longest line, skipping the rows already returned. A file of blank
    lines only, which Arrow's reader refuses ("Empty JSON stream"), has no rows."""
    done, block_bytes = 0, JSON_BLOCK_BYTES
    while True:
        try:
            with _open_binary(path) as raw:
                reader = pj.open_json(raw, read_options=pj.ReadOptions(use_threads=False, block_size=block_bytes),
                                      parse_options=pj.ParseOptions(explicit_schema=schema,
                                                                    unexpected_field_behavior="ignore"))
                skip = done
                for block in reader:
                    if skip < block.num_rows:
                        done += block.num_rows - skip
                        yield block.slice(skip)
                    skip = max(0, skip - block.num_rows)
            return
        except pa.ArrowInvalid as err:
            with io.BufferedReader(_open_binary(path)) as raw:
                lengths = [len(line) for line in raw if line.strip()] if "straddle" in str(err) or (
                    "Empty JSON stream" in str(err)) else [0]
            if not lengths:
                return  # no line but blank ones: no rows
            if max(lengths) < block_bytes:
                raise
            block_bytes = 1 << max(lengths).bit_length()


def _rebatched(blocks: Iterator, size: int) -> Iterator:
    """Tables of exactly `size` rows (the last one shorter) from Arrow's blocks, so that the staged row groups
    do not depend on the reader's block size."""
    rest = None
    for block in blocks:
        table = pa.Table.from_batches([block])
        table = table if rest is None else pa.concat_tables([rest, table])
        while table.num_rows >= size:
            yield table.slice(0, size)
            table = table.slice(size)
        rest = table
    if rest is not None and rest.num_rows:
        yield rest


def _json_line_error(path: Path, source: Source, schema) -> DataError | None:
    """The first line that Arrow's reader cannot read as the features' types, as an error naming the line and
    what is wrong; None when every line is fine."""
    lists = {f.name for f in schema if f.type != "large_string"}
    with _open_text(path) as lines:
        for line_no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"source {source.name!r}: {path}, line {line_no}"
            try:
                row = json.loads(line, object_pairs_hook=_unique_keys)
            except json.JSONDecodeError as err:
                return DataError(f"{where}: invalid JSON: {err}")
            except KeyError as err:
                return DataError(f"{where}: field {err.args[0]!r} appears twice")
            missing = [f for f in source.features if not isinstance(row, dict) or f not in row]
            if missing:
                return DataError(f"{where}: no field {missing[0]!r}")
            for f in source.features:
                value, expected = row[f], (list if f in lists else str)
                if value is not None and not isinstance(value, expected):
                    wanted = "a list of messages (as in the file's first lines)" if expected is list else "text"
                    return DataError(f"{where}: field {f!r} holds {type(value).__name__}, not {wanted}")
                if expected is list and not all(isinstance(m, dict) and all(
                        m.get(k) is None or isinstance(m[k], str) for k in MESSAGE_KEYS) for m in value or []):
                    return DataError(f"{where}: field {f!r}: a chat message must be a mapping whose "
                                     f"{'/'.join(MESSAGE_KEYS)} are strings")
    return None


def _unique_keys(pairs: list[tuple]) -> dict:
    keys = set()
    for key, _ in pairs:
        if key in keys:
            raise KeyError(key)
        keys.add(key)
    return dict(pairs)


def _open_binary(path: Path):
    lower = path.name.lower()
    compression = "gzip" if lower.endswith(".gz") else "zstd" if lower.endswith(".zst") else None
    return pa.input_stream(str(path), compression=compression)


def _open_text(path: Path):
    return io.TextIOWrapper(io.BufferedReader(_open_binary(path)), encoding="utf-8", errors="strict")


def _formatted(batch, source: Source, path: Path, schema, end_row: int) -> Iterator[list[str]]:
    try:
        texts = format_rows({f: batch.column(f).to_pylist() for f in source.features}, source)
    except TypeError as err:  # a line the scan names (a missing field reads as null) first, else the batch
        raise _json_line_error(path, source, schema) or DataError(
            f"source {source.name!r}: {path}, lines up to {_line_of_row(path, end_row)}: {err}") from None
    if texts:
        yield texts


def _line_of_row(path: Path, row: int) -> int:
    """The line number of the `row`-th (1-based) non-blank line."""
    with _open_text(path) as lines:
        seen = 0
        for line_no, line in enumerate(lines, 1):
            seen += bool(line.strip())
            if seen == row:
                return line_no
    return 0


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
