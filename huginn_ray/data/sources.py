"""The source list: which datasets go into the mix, where they come from and how they are weighted.

A source list is a YAML list; each entry carries the fields of the reference's `sources.yaml` (§6.2) plus
where its files come from, either the Hugging Face Hub or a local directory:

    - name: goodwiki                      # directory name under download/ and staging/
      address: euirim/goodwiki            # Hub dataset repo
      revision: main                      # branch, tag or commit (resolved to a commit sha and recorded)
      files: ["*.parquet"]                # fnmatch patterns over repo paths ('*' crosses '/')
      features: [markdown]
      weight: 4.0
      category: wiki
      license: mit
    - name: stdlib-json
      local_dir: "{stdlib}/json"          # {stdlib} = this Python's standard library directory
      files: ["*.py"]
      features: [text]                    # text files: each file is one document, feature "text"
    - name: demo-chat                     # kind chat: conversations with a loss mask (huginn_ray/data/chat.py)
      kind: chat
      local_dir: chat
      features: [question, answer]        # two text columns: the user's turn, Huginn's answer ([messages]: one
      system_prompt: "You are Huginn."    #   column holding a list of {role, content})
      loss_on: assistant                  # or all

Unknown keys and ill-typed values are refused with an error naming the source and the field.
"""

from __future__ import annotations

import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from huginn_ray import storage
from huginn_ray.config import ConfigError, from_dict, parse_yaml
from huginn_ray.data.chat import LOSS_ON

# What a Hub or local source contributes when it names no `files`; a subset narrows this to `{subset}/`.
DEFAULT_FILE_PATTERNS = ["*.parquet", "*.jsonl", "*.jsonl.gz", "*.txt"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


KINDS = ("documents", "packed", "chat")


@dataclass
class Source:
    name: str
    """Unique name; used as a directory name, so letters, digits, '.', '_' and '-' only."""
    features: list[str] = field(default_factory=list)
    """Columns that make up a document (several are joined by newlines; one is renamed to `text`)."""
    kind: str = "documents"
    """'documents': raw text, staged, tokenised and packed. 'packed': already tokenised and packed rows (parquet
    with an `input_ids` column of seq_len + 1 ids, e.g. the released tomg-group-umd/huginn-dataset), which go
    straight to the shuffle; their files are selected by `train_files` and `val_files`. 'chat': conversations
    (JSONL or parquet), rendered with the released chat template into rows with a `loss_mask` column
    (huginn_ray/data/chat.py); a source list is all chat or none."""
    train_files: list[str] = field(default_factory=list)
    """kind 'packed': fnmatch patterns of the training files."""
    val_files: list[str] = field(default_factory=list)
    """kind 'packed': fnmatch patterns of the validation files."""
    address: str = ""
    """Hub dataset repo `owner/name`; required unless `local_dir` is given (then it is provenance only)."""
    revision: str = "main"
    """Hub branch, tag or commit to fetch."""
    files: list[str] = field(default_factory=list)
    """fnmatch patterns selecting files (repo paths or paths below local_dir); default: data files."""
    local_dir: str = ""
    """Read files from this directory instead of the Hub ('{stdlib}' = the Python standard library), or from a
    bucket prefix (`s3://bucket/prefix`): its objects that match the file patterns are copied into the local
    scratch before each run (huginn_ray/data/bucket_sources.py)."""
    subset: str = ""
    """Dataset config / subdirectory: the default file patterns are looked up below `{subset}/`."""
    needs_chat_templating: bool = False
    """Features hold chat messages, rendered with the Huginn chat template as pretraining text (no loss mask)."""
    system_prompt: str = ""
    """kind 'chat': a system message put before every conversation that has none (empty: none)."""
    loss_on: str = "assistant"
    """kind 'chat': the tokens trained on: 'assistant' (Huginn's turns and their end-of-turn marker) or 'all'
    (every token of the conversation); padding never."""
    weight: float = 1.0
    """Up-weighting: floor(weight) full copies plus a seeded random frac(weight) share of documents."""
    every_token_is_sacred: bool = False
    """Packing keeps every token of these documents instead of incinerating the overflow."""
    max_bad_records: float = 0
    """Bad records (undecodable text, wrong types, invalid JSON, bad chat messages or role order:
    huginn_ray/data/formatting.py BAD_RECORD_REASONS) the source may have: a count (0, 10, ...) or a fraction of
    the records read (0 < x < 1). They go to `<output_dir>/quarantine/<source>/` with their file, line or row and
    reason, and are counted in the manifest; one more fails the run naming the file, the line or row and the
    reason. 0 (the default): the first bad record fails the run."""
    requires_software_heritage_aws_download: bool = False
    """The source's file contents live in Software Heritage's S3 bucket, not on the Hub (the-stack-v2). This
    project has no such download: a source with this flag and weight > 0 is refused naming it."""
    category: str = ""
    """Free-form category (code, math, wiki, ...), recorded in manifests."""
    license: str = ""
    """License of the source, recorded in manifests."""
    mirrored_from: str = field(default="", init=False)
    """Not a key of the list: the bucket prefix whose local copy `local_dir` is, once
    bucket_sources.mirror_bucket_inputs has made it (what the manifest records as the source's local_dir)."""

    @property
    def is_local(self) -> bool:
        return bool(self.local_dir)

    @property
    def in_bucket(self) -> bool:
        """local_dir is a bucket prefix (not copied yet)."""
        return storage.is_uri(self.local_dir)

    @property
    def is_packed(self) -> bool:
        return self.kind == "packed"

    @property
    def is_chat(self) -> bool:
        return self.kind == "chat"

    @property
    def file_patterns(self) -> list[str]:
        if self.is_packed:
            return list(self.train_files) + list(self.val_files)
        if self.files:
            return list(self.files)
        prefix = f"{self.subset.strip('/')}/" if self.subset else ""
        return [prefix + pattern for pattern in DEFAULT_FILE_PATTERNS]

    def resolved_local_dir(self) -> Path:
        return Path(self.local_dir.replace("{stdlib}", sysconfig.get_paths()["stdlib"]))


def parse_sources(items: object, origin: str, base_dir: Path | str | None = None) -> list[Source]:
    """Validate a parsed YAML list of sources; `origin` (the file name) appears in every error. A relative local_dir
    is resolved against `base_dir` (the list's directory), and refused when that is a bucket prefix."""
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{origin}: expected a non-empty YAML list of sources")
    sources: list[Source] = []
    for index, item in enumerate(items):
        label = f"source #{index}"
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            label = f"source {item['name']!r}"
        try:
            source = from_dict(Source, item, prefix="")
        except ConfigError as err:
            raise ConfigError(f"{origin}: {label}: {err}") from None
        _check(source, origin, label)
        source.local_dir = _resolved_local_dir(source.local_dir, base_dir, f"{origin}: {label}: local_dir")
        sources.append(source)
    names = [s.name for s in sources]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"{origin}: source name {duplicates[0]!r} is used more than once")
    return sources


def _resolved_local_dir(local_dir: str, base_dir: Path | str | None, key: str) -> str:
    """A bucket URI kept (`file://` made a local path); a relative local path made absolute against `base_dir`,
    refused by `key` when `base_dir` is a bucket prefix (a source list read from a bucket)."""
    if not local_dir or "{stdlib}" in local_dir or (not storage.is_uri(local_dir) and Path(local_dir).is_absolute()):
        return local_dir
    if storage.is_uri(local_dir):
        try:
            return storage.resolve_location(local_dir, "/")
        except storage.StorageError as err:
            raise ConfigError(f"{key}: {err}") from None
    if base_dir is not None and storage.is_uri(str(base_dir)):
        raise ConfigError(f"{key}: {local_dir!r} is relative, and the source list is in a bucket: give an absolute "
                          f"local path or a bucket URI")
    return local_dir if base_dir is None else str((Path(base_dir) / local_dir).resolve())


def load_sources(path: str | Path) -> list[Source]:
    """The source list in a local file or an object (`s3://...`)."""
    path = str(path)
    if storage.is_uri(path):
        try:
            storage.check_location(path, "sources")
            text = storage.read_text(path)
        except storage.StorageError as err:
            raise ConfigError(str(err)) from None
        except FileNotFoundError:
            raise ConfigError(f"source list not found: {path}") from None
        return parse_sources(parse_yaml(text), path, base_dir=path.rsplit("/", 1)[0])
    if not Path(path).is_file():
        raise ConfigError(f"source list not found: {path}")
    return parse_sources(parse_yaml(Path(path).read_text()), path, base_dir=Path(path).parent)


def _check(source: Source, origin: str, label: str) -> None:
    def fail(field_name: str, message: str) -> None:
        raise ConfigError(f"{origin}: {label}: field {field_name!r}: {message}")

    if not _NAME.match(source.name):
        fail("name", f"{source.name!r} may hold only letters, digits, '.', '_' and '-'")
    if source.kind not in KINDS:
        fail("kind", f"must be one of {', '.join(KINDS)}, got {source.kind!r}")
    if source.is_packed:
        for key in ("train_files", "val_files"):
            if not getattr(source, key):
                fail(key, "a packed source needs patterns for its training and its validation files")
        for key, default in (("features", []), ("files", []), ("needs_chat_templating", False), ("weight", 1.0),
                             ("every_token_is_sacred", False), ("subset", "")):
            if getattr(source, key) != default:
                fail(key, "does not apply to a packed source (its rows are used as they are)")
    else:
        if source.train_files or source.val_files:
            fail("train_files" if source.train_files else "val_files", "only a packed source (kind: packed) has it")
        if not source.features or any(not f for f in source.features):
            fail("features", "must list at least one non-empty column name")
    if source.is_chat:
        if len(source.features) not in (1, 2):
            fail("features", f"a chat source names one column holding a list of messages ([messages]) or two text "
                             f"columns ([question, answer]), got {source.features}")
        if source.needs_chat_templating or source.every_token_is_sacred:
            fail("needs_chat_templating" if source.needs_chat_templating else "every_token_is_sacred",
                 "does not apply to a chat source (its conversations become masked rows)")
        if source.loss_on not in LOSS_ON:
            fail("loss_on", f"must be one of {', '.join(LOSS_ON)}, got {source.loss_on!r}")
    else:
        for key, default in (("system_prompt", ""), ("loss_on", "assistant")):
            if getattr(source, key) != default:
                fail(key, "only a chat source (kind: chat) has it")
    if source.weight < 0:
        fail("weight", f"must be >= 0, got {source.weight}")
    if not (source.max_bad_records == 0 or 0 < source.max_bad_records < 1 or (
            source.max_bad_records >= 1 and float(source.max_bad_records).is_integer())):
        fail("max_bad_records", f"must be a count (0, 1, 2, ...) or a fraction of the records (0 < x < 1), "
                                f"got {source.max_bad_records:g}")
    if source.is_packed and source.max_bad_records:
        fail("max_bad_records", "does not apply to a packed source (a bad row fails the run, named)")
    if not source.local_dir and not source.address:
        fail("address", "a Hub repo (owner/name) is required unless local_dir is given")
    if source.address and not source.local_dir and source.address.count("/") != 1:
        fail("address", f"{source.address!r} is not of the form owner/name")
