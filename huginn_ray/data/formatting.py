"""Turning one raw input file into documents: the `text` column of the staging parquet (§6.3).

Formats by file name: `*.parquet`; `*.jsonl` / `*.json` (one JSON object per line, optionally `.gz` or `.zst`);
anything else is a text file that becomes a single document (feature `text`). Rules for a row:

- `kind: chat` sources: each row is one conversation, kept as JSON (a list of {role, content}, the source's system
  prompt first) for the pack stage to render with a loss mask (huginn_ray/data/chat.py): from one column holding
  the messages, or from two text columns, the user's question and Huginn's answer;
- pretraining chat sources (`needs_chat_templating`): a feature holding a list of messages becomes messages;
  when all features are text (question, answer, ...), they become one user message each and the last one the
  assistant's (Huginn's) turn; the document is kept as its parts in JSON (text and `[role, content]` messages,
  huginn_ray/data/chat.py `template_parts`), so that the pack stage renders the template's structure as token
  ids and every text as text;
- one feature: its value is the document;
- several features: their values joined by newlines.

A record (a non-blank JSON line, a parquet row, a text file) gives one document, an empty one (filtered and
counted: FILTERS), or is bad: `BadRecord` names its file, its 1-based line (JSONL, text) or row (parquet) and
the reason (BAD_RECORD_REASONS); staging quarantines it under the source's `max_bad_records`
(huginn_ray/data/staging.py). A file that cannot be read at all, or lacks a feature's column, is a DataError
naming it. JSON lines are read by Arrow's JSON reader while the file is clean: a feature must hold text or null
(a chat source's: text, null or a list of messages), as json.loads would read it; from the first batch that is
not, the file is read line by line.
"""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.json as pj
import pyarrow.parquet as pq

from huginn_ray.data.chat import ASSISTANT, ROLE_NAMES, check_messages, document_text, template_parts
from huginn_ray.data.sources import Source

ROWS_PER_BATCH = 1024


class DataError(ValueError):
    """Bad input data; the message names the file (and line / feature / source)."""


def chat_template(messages: list) -> str:
    """A pretraining chat document's JSON for its messages (`template_parts`): staged as parts, so the pack stage
    renders the template's structure as token ids and the contents as text (huginn_ray/data/chat.py)."""
    return json.dumps(template_parts(messages), ensure_ascii=False)


BAD_RECORD_REASONS = {
    "invalid_utf8": "bytes that are not UTF-8",
    "lone_surrogate": "a UTF-16 surrogate without its pair (in the bytes or as a JSON escape)",
    "invalid_json": "a JSON line that does not parse",
    "duplicate_field": "a JSON object with a key twice",
    "missing_field": "a feature the record does not have",
    "wrong_type": "a feature that is not text (or, for chat, not a list of messages)",
    "bad_message": "a chat message the template cannot render (no role or content, unknown role)",
    "bad_role_order": "a conversation (kind chat) whose roles are not: system (optional, first), then user and "
                      "assistant taking turns from user, with at least one assistant message",
}
"""Why a record is bad: it is quarantined (`max_bad_records`), never silently dropped."""
FILTERS = {"empty": "a record whose document is empty (no text in its features)"}
"""Why a good record gives no document: counted per source, not quarantined."""


class RecordError(ValueError):
    """One record that cannot become a document; `reason` is a key of BAD_RECORD_REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass
class BadRecord:
    """A quarantined record: where it is, why, and its content as read (undecodable bytes as \\x escapes)."""
    file: str
    unit: str
    """'line' (JSONL, text files) or 'row' (parquet)."""
    number: int
    """1-based line or row in the file."""
    reason: str
    detail: str
    record: str

    @property
    def where(self) -> str:
        return f"{self.file}, {self.unit} {self.number}"


@dataclass
class Batch:
    """What a batch of one file's records gave."""
    texts: list[str]
    """The documents, in record order."""
    read: int
    """Records read (non-blank JSON lines, parquet rows, text files)."""
    empty: int = 0
    """Good records whose document is empty (filter `empty`)."""
    bad: list[BadRecord] = field(default_factory=list)


def check_role_order(messages: list[dict]) -> None:
    """A training conversation: system (optional, first), then user and assistant taking turns from user, at
    least one assistant message (Huginn's turns are what `loss_on: assistant` trains on)."""
    roles = [ROLE_NAMES[m["role"]] for m in messages]
    turns = roles[1:] if roles and roles[0] == "system" else roles
    expected = ["user" if k % 2 == 0 else ASSISTANT for k in range(len(turns))]
    if turns != expected or ASSISTANT not in turns:
        raise RecordError("bad_role_order", f"roles {roles} are not system (optional), then user and assistant "
                                            "taking turns from user, with at least one assistant message")


def conversation(values: list, source: Source) -> str:
    """A chat source's record as a conversation in JSON, [{"role": ..., "content": ...}, ...]."""
    features = source.features
    if len(features) == 1:
        messages = values[0]
    else:
        for name, value in zip(features, values):
            if not isinstance(value, str):
                raise RecordError("wrong_type", f"feature {name!r} holds {type(value).__name__}, not text")
        messages = [{"role": "user", "content": values[0]}, {"role": "assistant", "content": values[1]}]
    try:
        check_messages(messages)
    except ValueError as err:
        raise RecordError("bad_message", f"feature {features[0]!r}: {err}") from None
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if source.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": source.system_prompt})
    check_role_order(messages)
    return json.dumps(messages, ensure_ascii=False)


def format_record(values: list, source: Source) -> str:
    """One record's document ("" when empty) from its features' values; a bad record raises RecordError."""
    if source.is_chat:
        return conversation(values, source)
    features = source.features
    if source.needs_chat_templating and all(isinstance(v, str) or v is None for v in values):
        # chat source given as text columns (question, answer, ...): the last column is Huginn's turn,
        # the ones before it the user's (one message each)
        present = [v for v in values if v]
        messages = [{"role": "user", "content": v} for v in present[:-1]]
        if present:
            messages.append({"role": "assistant", "content": present[-1]})
        return chat_template(messages) if messages else ""
    if source.needs_chat_templating:  # text features and message lists, joined by newlines
        parts: list = []
        for name, value in zip(features, values):
            if value is None:
                continue
            if not isinstance(value, (str, list)):
                raise RecordError("wrong_type", f"feature {name!r} holds {type(value).__name__}, not text or "
                                                "a list of messages")
            try:
                parts += (["\n"] if parts else []) + ([value] if isinstance(value, str) else template_parts(value))
            except TypeError as err:
                raise RecordError("bad_message", f"feature {name!r}: {err}") from None
        return json.dumps(parts, ensure_ascii=False) if document_text(parts) else ""
    if len(values) == 1:
        if values[0] is not None and not isinstance(values[0], str):
            raise RecordError("wrong_type", f"feature {features[0]!r} holds {type(values[0]).__name__}, not text")
        return values[0] or ""
    return "\n".join("" if v is None else str(v) for v in values)


def format_rows(columns: dict[str, list], source: Source) -> list[str]:
    """Documents from a batch of rows given as {feature: values}; empty documents are dropped, the first bad
    record raises RecordError (the readers then read the batch record by record, `Batch.bad`)."""
    features = source.features
    texts = [format_record([columns[f][i] for f in features], source) for i in range(len(columns[features[0]]))]
    return [t for t in texts if t]


def iter_documents(path: str | Path, source: Source) -> Iterator[Batch]:
    """The documents of one input file, in batches with the file's bad records (named by line or row) and
    counts; an unreadable file (or one without a feature's column) is a DataError naming it."""
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


def _undecodable(data: bytes, err: UnicodeError) -> RecordError:
    """invalid_utf8, or lone_surrogate for a surrogate's 3-byte form (ED A0..BF xx, CESU-8 / WTF-8)."""
    at = data[err.start:err.start + 2]
    reason = "lone_surrogate" if len(at) == 2 and at[0] == 0xED and 0xA0 <= at[1] <= 0xBF else "invalid_utf8"
    return RecordError(reason, f"not UTF-8 at byte offset {err.start}: {data[err.start:err.start + 4]!r}")


def _checked(text: str) -> str:
    """A document that UTF-8 can hold: a lone surrogate (a JSON `\\ud800` escape) is a bad record."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RecordError("lone_surrogate", f"a lone surrogate {text[err.start]!r} at character {err.start}") \
            from None
    return text


def _parquet_documents(path: Path, source: Source) -> Iterator[Batch]:
    """Parquet rows in batches of ROWS_PER_BATCH; a batch with a bad row is read again row by row."""
    pf = pq.ParquetFile(path)
    missing = [f for f in source.features if f not in pf.schema_arrow.names]
    if missing:
        raise DataError(f"source {source.name!r}: {path} has no column {missing[0]!r} "
                        f"(columns: {', '.join(pf.schema_arrow.names)})")
    first_row = 0
    for batch in pf.iter_batches(batch_size=ROWS_PER_BATCH, columns=source.features):
        try:
            texts = format_rows({f: batch.column(f).to_pylist() for f in source.features}, source)
            yield Batch(texts, batch.num_rows, batch.num_rows - len(texts))
        except (RecordError, UnicodeDecodeError):
            yield _parquet_rows(path, batch, first_row, source)
        first_row += batch.num_rows


def _parquet_rows(path: Path, batch, first_row: int, source: Source) -> Batch:
    out = Batch([], batch.num_rows)
    for i in range(batch.num_rows):
        scalars = [batch.column(f)[i] for f in source.features]
        try:
            values = []
            for scalar in scalars:
                try:
                    values.append(scalar.as_py())
                except UnicodeDecodeError as err:
                    raise _undecodable(err.object, err) from None
            text = _checked(format_record(values, source))
        except RecordError as err:
            record = {f: _raw_value(s) for f, s in zip(source.features, scalars)}
            out.bad.append(BadRecord(str(path), "row", first_row + i + 1, err.reason, str(err),
                                     json.dumps(record, ensure_ascii=False, default=str)))
            continue
        if text:
            out.texts.append(text)
        else:
            out.empty += 1
    return out


def _raw_value(scalar):
    """A parquet value for the quarantine: as Python reads it, or its bytes with \\x escapes when undecodable."""
    try:
        return scalar.as_py()
    except UnicodeDecodeError:
        return scalar.cast(pa.binary()).as_py().decode("utf-8", "backslashreplace")


def _jsonl_documents(path: Path, source: Source) -> Iterator[Batch]:
    """Arrow's streaming JSON reader, reading only the features (typed: text, or chat message lists), in
    batches of ROWS_PER_BATCH rows, while every line is fine. From the first batch that Arrow's reader cannot
    read, that holds a null (Arrow reads a missing field as null; a line without a feature is a bad record) or
    a record that cannot be formatted, the rest of the file is read line by line (`_json_lines`), which names
    each bad line and keeps the others."""
    schema = _json_schema(path, source)
    done = 0
    try:
        for batch in _rebatched(_json_blocks(path, schema), ROWS_PER_BATCH):
            if any(column.null_count for column in batch.columns):
                break
            try:
                texts = format_rows({f: batch.column(f).to_pylist() for f in source.features}, source)
            except RecordError:
                break
            yield Batch(texts, batch.num_rows, batch.num_rows - len(texts))
            done += batch.num_rows
        else:
            return
    except (pa.ArrowInvalid, UnicodeDecodeError):
        pass
    yield from _json_lines(path, source, schema, skip=done)


def _json_lines(path: Path, source: Source, schema, skip: int) -> Iterator[Batch]:
    """The records after the first `skip` non-blank lines, line by line, in batches of ROWS_PER_BATCH records."""
    lists = {f.name for f in schema if f.type != "large_string"}
    out = Batch([], 0)
    with io.BufferedReader(_open_binary(path)) as raw:
        for line_no, line in enumerate(raw, 1):
            if not line.strip():
                continue
            if skip:
                skip -= 1
                continue
            out.read += 1
            try:
                text = _json_record(line, source, lists)
            except RecordError as err:
                out.bad.append(BadRecord(str(path), "line", line_no, err.reason, str(err),
                                         line.rstrip(b"\r\n").decode("utf-8", "backslashreplace")))
            else:
                if text:
                    out.texts.append(text)
                else:
                    out.empty += 1
            if out.read == ROWS_PER_BATCH:
                yield out
                out = Batch([], 0)
    if out.read:
        yield out


def _json_record(line: bytes, source: Source, lists: set[str]) -> str:
    """One JSON line's document, or RecordError: what json.loads reads, checked as Arrow's reader types it."""
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _undecodable(line, err) from None
    try:
        row = json.loads(decoded, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as err:
        raise RecordError("invalid_json", f"invalid JSON: {err}") from None
    except KeyError as err:
        raise RecordError("duplicate_field", f"field {err.args[0]!r} appears twice") from None
    missing = [f for f in source.features if not isinstance(row, dict) or f not in row]
    if missing:
        raise RecordError("missing_field", f"no field {missing[0]!r}")
    for f in source.features:
        value, expected = row[f], (list if f in lists else str)
        if value is not None and not isinstance(value, expected):
            wanted = "a list of messages (as in the file's first lines)" if expected is list else "text"
            raise RecordError("wrong_type", f"field {f!r} holds {type(value).__name__}, not {wanted}")
        if expected is list and not all(isinstance(m, dict) and all(
                m.get(k) is None or isinstance(m[k], str) for k in MESSAGE_KEYS) for m in value or []):
            raise RecordError("bad_message", f"field {f!r}: a chat message must be a mapping whose "
                                             f"{'/'.join(MESSAGE_KEYS)} are strings")
    return _checked(format_record([row[f] for f in source.features], source))


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
        with io.BufferedReader(_open_binary(path)) as lines:
            for line in itertools.islice((line for line in lines if line.strip()), ROWS_PER_BATCH):
                try:
                    row = json.loads(line.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    continue  # a bad record: the line-by-line reading names it
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


def _text_documents(path: Path, source: Source) -> Iterator[Batch]:
    """A text file is one record, one document; undecodable bytes are named by their line."""
    if source.features != ["text"]:
        raise DataError(f"source {source.name!r}: {path} is a text file, so features must be [text], "
                        f"got {source.features}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        bad = _undecodable(data, err)
        yield Batch([], 1, bad=[BadRecord(str(path), "line", data.count(b"\n", 0, err.start) + 1, bad.reason,
                                          str(bad), data.decode("utf-8", "backslashreplace"))])
        return
    yield Batch([text] if text else [], 1, 0 if text else 1)
