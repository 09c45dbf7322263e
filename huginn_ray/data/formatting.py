"""Turning one raw input file into documents: the `text` column of the staging parquet (§6.3).

Two steps, which staging runs as its read and its map (huginn_ray/data/staging.py): `read_batches` reads a file's
records unformatted, in batches of ROWS_PER_BATCH (`RawBatch`: each record's line or row number and its content);
`format_batch` turns a batch into each record's document or `BadRecord`. `iter_documents` runs both in one process
(the plan's sampling: huginn_ray/data/plan_sources.py).

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
naming it. A batch of JSON lines is parsed by Arrow's JSON reader, reading only the features, when it is clean: a
feature must hold text or null (a chat source's: text, null or a list of messages, typed by the file's first
lines), as json.loads would read it; a batch that Arrow cannot read, or that holds a null or a record that cannot
be formatted, is read line by line with json.loads, which names each bad line and keeps the others.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
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


@dataclass
class FormattedBatch:
    """A batch of records formatted (format_batch)."""
    texts: pa.LargeStringArray
    """Each record's document ("" when empty), null where the record is bad."""
    bad: list[BadRecord]
    """The bad records, in record order: one per null of `texts`."""


def _formatted(results: list[str | BadRecord]) -> FormattedBatch:
    return FormattedBatch(pa.array([None if isinstance(r, BadRecord) else r for r in results], pa.large_string()),
                          [r for r in results if isinstance(r, BadRecord)])


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


def file_format(path: str | Path) -> str:
    """'parquet', 'jsonl' (one JSON object per line, optionally .gz / .zst) or 'text', by the file's name."""
    name = Path(path).name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")):
        return "jsonl"
    return "text"


@dataclass
class RawBatch:
    """Up to ROWS_PER_BATCH consecutive records of one input file as read, before formatting: what staging's read
    passes to its map (huginn_ray/data/staging.py)."""
    numbers: list[int]
    """The 1-based line (JSONL, text) or row (parquet) of each record."""
    records: pa.LargeBinaryArray
    """Each record's content, as Arrow binary values (staging's read passes them to its map as they are, and a
    clean batch of JSON lines reaches Arrow's JSON reader from their buffer without a copy): a JSON line as it is
    in the file, its newline included; a parquet row's feature values, pickled (a value that is not UTF-8 as
    `Undecodable`); a text file's bytes."""
    message_lists: list[str] = field(default_factory=list)
    """JSONL: the features the file holds as message lists (the first non-null value among its first
    ROWS_PER_BATCH records is a list), read as such by Arrow's reader in every batch of the file."""


@dataclass
class Undecodable:
    """A parquet string value whose bytes are not UTF-8 (a bad record: invalid_utf8 or lone_surrogate)."""
    data: bytes

    def error(self) -> RecordError:
        try:
            self.data.decode("utf-8")
        except UnicodeDecodeError as err:
            return _undecodable(self.data, err)
        raise AssertionError("Undecodable holds UTF-8")


def read_batches(path: str | Path, source: Source) -> Iterator[RawBatch]:
    """The records of one input file in batches of ROWS_PER_BATCH, unformatted; a file that cannot be read (or
    lacks a feature's column) is a DataError naming it."""
    path = Path(path)
    readers = {"parquet": _parquet_batches, "jsonl": _jsonl_batches, "text": _text_batches}
    try:
        yield from readers[file_format(path)](path, source)
    except DataError:
        raise
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise DataError(f"source {source.name!r}: cannot read {path}: {type(err).__name__}: {err}") from None


def format_batch(raw: RawBatch, path: str | Path, source: Source) -> FormattedBatch:
    """Each record's document ("" when empty) or BadRecord (named by file, line or row, and reason). JSON lines
    are parsed by Arrow's JSON reader while the batch is clean; a batch that Arrow cannot read, that holds a null
    (Arrow reads a missing field as null) or a record that cannot be formatted is read line by line, which names
    each bad line and keeps the others."""
    path = Path(path)
    formatters = {"parquet": _parquet_records, "jsonl": _jsonl_records, "text": _text_record}
    try:
        return formatters[file_format(path)](raw, path, source)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise DataError(f"source {source.name!r}: cannot read {path}: {type(err).__name__}: {err}") from None


def iter_documents(path: str | Path, source: Source) -> Iterator[Batch]:
    """The documents of one input file, in batches with the file's bad records (named by line or row) and
    counts, read and formatted in this process (what staging does on its workers: huginn_ray/data/staging.py)."""
    for raw in read_batches(path, source):
        formatted = format_batch(raw, path, source)
        texts = formatted.texts.to_pylist()
        yield Batch([t for t in texts if t], len(texts), sum(1 for t in texts if t == ""), formatted.bad)


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


def _parquet_batches(path: Path, source: Source) -> Iterator[RawBatch]:
    """Parquet rows in batches of ROWS_PER_BATCH, each row's feature values pickled."""
    pf = pq.ParquetFile(path)
    missing = [f for f in source.features if f not in pf.schema_arrow.names]
    if missing:
        raise DataError(f"source {source.name!r}: {path} has no column {missing[0]!r} "
                        f"(columns: {', '.join(pf.schema_arrow.names)})")
    first_row = 0
    for batch in pf.iter_batches(batch_size=ROWS_PER_BATCH, columns=source.features):
        columns = [_python_values(batch.column(f)) for f in source.features]
        yield RawBatch(list(range(first_row + 1, first_row + batch.num_rows + 1)),
                       binary_records([pickle.dumps(list(values)) for values in zip(*columns)]))
        first_row += batch.num_rows


def _python_values(column: pa.Array) -> list:
    """A column's values as Python reads them; a string that is not UTF-8 as Undecodable (its bytes)."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        values = []
        for scalar in column:
            try:
                values.append(scalar.as_py())
            except UnicodeDecodeError as err:
                values.append(Undecodable(err.object))
        return values


def _parquet_records(raw: RawBatch, path: Path, source: Source) -> FormattedBatch:
    out: list[str | BadRecord] = []
    for number, record in zip(raw.numbers, raw.records.to_pylist()):
        values = pickle.loads(record)
        try:
            undecodable = next((v for v in values if isinstance(v, Undecodable)), None)
            if undecodable is not None:
                raise undecodable.error()
            out.append(_checked(format_record(values, source)))
        except RecordError as err:
            shown = {f: v.data.decode("utf-8", "backslashreplace") if isinstance(v, Undecodable) else v
                     for f, v in zip(source.features, values)}
            out.append(BadRecord(str(path), "row", number, err.reason, str(err),
                                 json.dumps(shown, ensure_ascii=False, default=str)))
    return _formatted(out)


def _jsonl_batches(path: Path, source: Source) -> Iterator[RawBatch]:
    """The non-blank lines of a JSONL file in batches of ROWS_PER_BATCH, with their line numbers."""
    numbers, records, message_lists = [], [], None
    with io.BufferedReader(_open_binary(path)) as lines:
        for line_no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            numbers.append(line_no)
            records.append(line)
            if len(records) == ROWS_PER_BATCH:
                message_lists = _message_list_features(records, source) if message_lists is None else message_lists
                yield RawBatch(numbers, binary_records(records), message_lists)
                numbers, records = [], []
    if records:
        message_lists = _message_list_features(records, source) if message_lists is None else message_lists
        yield RawBatch(numbers, binary_records(records), message_lists)


def binary_records(records: list[bytes]) -> pa.LargeBinaryArray:
    """A batch's records as RawBatch holds them."""
    return pa.array(records, pa.large_binary())


def _joined_lines(records: pa.LargeBinaryArray) -> pa.Buffer:
    """The batch's JSON lines as one buffer, each ending in a newline: a slice of the records' own value buffer
    (consecutive lines of the file, each with its newline), except where a line lacks its newline (a file's last
    line may), which is copied with one added."""
    _, offsets, values = records.buffers()
    bounds = np.frombuffer(offsets, np.int64)[records.offset:records.offset + len(records) + 1]
    if (np.frombuffer(values, np.uint8)[bounds[1:] - 1] == ord("\n")).all():  # (lines are non-blank: length >= 1)
        return values.slice(int(bounds[0]), int(bounds[-1] - bounds[0]))
    return pa.py_buffer(b"".join(line if line.endswith(b"\n") else line + b"\n" for line in records.to_pylist()))


def _message_list_features(records: list[bytes], source: Source) -> list[str]:
    """The features of a chat source (either kind) whose first non-null value among the file's first records is
    a list (of messages): Arrow's reader reads them as the message list type (message keys other than
    role/content/from/value are not read: the chat templates use no others); every other feature as text."""
    if not (source.needs_chat_templating or source.is_chat):
        return []
    lists, untyped = [], set(source.features)
    for line in records:
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue  # a bad record: the line-by-line reading names it
        for f in [f for f in untyped if isinstance(row, dict) and row.get(f) is not None]:
            untyped.discard(f)
            if isinstance(row[f], list):
                lists.append(f)
        if not untyped:
            break
    return sorted(lists)


def _jsonl_records(raw: RawBatch, path: Path, source: Source) -> FormattedBatch:
    """A batch of JSON lines through Arrow's JSON reader (one thread: a task is one CPU), reading only the
    features, typed as text or message lists; line by line (`_json_record`) when the batch is not clean. A clean
    batch of a source whose document is its one text feature keeps Arrow's column as the documents (checked to be
    UTF-8, as Python's decoding of the values would check it)."""
    schema = pa.schema([(f, _message_list_type() if f in raw.message_lists else pa.large_string())
                        for f in source.features])
    data = _joined_lines(raw.records)
    try:
        table = pj.read_json(pa.BufferReader(data),
                             read_options=pj.ReadOptions(use_threads=False, block_size=data.size + 1),
                             parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"))
        if table.num_rows == len(raw.records) and not any(column.null_count for column in table.columns):
            if _document_is_feature(source):
                texts = table.column(0).combine_chunks()
                texts.validate(full=True)
                return FormattedBatch(texts, [])
            columns = [table.column(f).to_pylist() for f in source.features]
            return _formatted([format_record(list(values), source) for values in zip(*columns)])
    except (pa.ArrowInvalid, UnicodeDecodeError, RecordError):
        pass
    out: list[str | BadRecord] = []
    for line_no, line in zip(raw.numbers, raw.records.to_pylist()):
        try:
            out.append(_json_record(line, source, set(raw.message_lists)))
        except RecordError as err:
            out.append(BadRecord(str(path), "line", line_no, err.reason, str(err),
                                 line.rstrip(b"\r\n").decode("utf-8", "backslashreplace")))
    return _formatted(out)


def _document_is_feature(source: Source) -> bool:
    """A source whose document is its one feature's text as it is (format_record)."""
    return len(source.features) == 1 and not (source.is_chat or source.needs_chat_templating)


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


def _message_list_type():
    return pa.list_(pa.struct([(key, pa.string()) for key in MESSAGE_KEYS]))


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


def _text_batches(path: Path, source: Source) -> Iterator[RawBatch]:
    """A text file is one record (line 1: a bad one is named by the line of its first undecodable byte)."""
    if source.features != ["text"]:
        raise DataError(f"source {source.name!r}: {path} is a text file, so features must be [text], "
                        f"got {source.features}")
    yield RawBatch([1], binary_records([path.read_bytes()]))


def _text_record(raw: RawBatch, path: Path, source: Source) -> FormattedBatch:
    (data,) = raw.records.to_pylist()
    try:
        return _formatted([data.decode("utf-8")])
    except UnicodeDecodeError as err:
        bad = _undecodable(data, err)
        return _formatted([BadRecord(str(path), "line", data.count(b"\n", 0, err.start) + 1, bad.reason, str(bad),
                                     data.decode("utf-8", "backslashreplace"))])
