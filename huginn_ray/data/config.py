"""The data-preparation config: one YAML file drives tokenizer training and `jobs/prepare_data.py`.

    cfg = load_data_config("configs/data/demo.yaml", ["output_dir=/tmp/out", "num_shards=8"])

Relative paths in the file (`sources`) are resolved against the directory of the YAML file, so a config
works from any working directory (and under `ray job submit --working-dir .`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from huginn_ray import storage
from huginn_ray.config import AT_LEAST_1, NON_NEGATIVE, POSITIVE, ConfigError, Range, check_ranges, load_config


@dataclass
class DownloadConfig:
    max_in_flight: int = 8
    """Hub files fetched at the same time (one Ray task each); also the objects of inputs in a bucket copied at
    the same time (threads of the driver: huginn_ray/data/bucket_sources.py)."""
    max_attempts: int = 8
    """Requests per listing, and calls of `hf_hub_download` per file, for the failures huggingface_hub does not
    retry itself (huginn_ray/data/hub_download.py); then the run fails naming the repo and file."""


@dataclass
class TokenizerConfig:
    path: str = ""
    """Directory holding tokenizer.json + tokenizer_config.json; empty means `<output_dir>/tokenizer`. A bucket
    prefix (`s3://...`) is copied into `mirror/.tokenizer/` of the local root (output_dir, or scratch_dir) before
    each run (huginn_ray/data/bucket_sources.py) and read from there."""
    vocab_size: int = 65536
    """Total vocabulary: BPE merges + manual tokens + 32 special tokens at the top ids."""
    manual_tokens: bool = True
    """Append the manual tokens of the reference (whitespace runs, chr(0..686), emoji, math symbols, ...)."""
    rows_per_source: int = 131072
    """Documents taken from each source for the training corpus (reference LIMITER = 2^17)."""
    max_chars_per_doc: int = 32768
    """Each corpus document is cut to this many characters."""
    max_token_length: int = 32
    """Longest BPE token in bytes."""


@dataclass
class ShuffleConfig:
    reducer_mib: int = 256
    """Rows one reducer task gathers and writes (its memory is ~3x this); sets the number of reducers."""
    map_mib: int = 256
    """Rows one map task reads, sorts by destination and writes as one intermediate file (memory ~3x this)."""
    row_group_size: int = 64
    """Rows per parquet row group in the shards (the reader's shuffle-buffer granularity)."""


@dataclass
class ChatRowsConfig:
    pack: bool = False
    """How conversations of `kind: chat` sources become rows of seq_len + 1 ids: false, one per row, padded (the
    reference's layout); true, whole conversations in order, as many per row as fit, each with its own loss mask.
    Either way a conversation longer than a row is truncated to it (counted in the manifest)."""


@dataclass
class HubEvalSet:
    """An evaluation set on the Hugging Face Hub, an entry of `decontaminate.against`:

        against: [{hub: openai/gsm8k, config: main, split: test}]

    Its files are the repo's `<config>/<split>-*.parquet` at `revision` (the layout `datasets`' `push_to_hub`
    writes, and GSM8k's on the Hub); each run resolves the revision to a commit and fetches them into
    `<output_dir>/eval_sets/` (huginn_ray/data/decontaminate.py)."""

    hub: str
    """Dataset repo id, e.g. `openai/gsm8k`."""
    config: str = "default"
    """The dataset's configuration (subset): the repo folder holding its files, e.g. `main` for GSM8k; `default`
    is the folder `data/` (what `push_to_hub` names a dataset's only configuration)."""
    split: str = "test"
    """The split read: files named `<config folder>/<split>-*.parquet`."""
    revision: str = "main"
    """Branch, tag or commit; resolved to a commit when a run starts, recorded with the n-gram set (and part of its
    digest, so a moved branch is a changed evaluation set)."""
    fields: list[str] = field(default_factory=lambda: ["question"])
    """Columns whose values (strings) are checked, each value one evaluation item (GSM8k's `question`; add `answer`
    to check its worked solutions too)."""

    @property
    def patterns(self) -> list[str]:
        """The repo paths of the split's files."""
        return [f"{'data' if self.config == 'default' else self.config}/{self.split}-*.parquet"]


@dataclass
class LocalEvalSet:
    """An evaluation set in a local file, an entry of `decontaminate.against` (a plain path is one with the default
    fields):

        against: [{path: ../eval/gsm8k_test.jsonl, fields: [question, answer]}]"""

    path: str
    """JSONL or parquet records holding the fields as strings; relative to the config file."""
    fields: list[str] = field(default_factory=lambda: ["question"])
    """Fields whose values are checked, each value one evaluation item (GSM8k's `question` by default)."""


@dataclass
class DecontaminateConfig:
    mode: Literal["none", "drop", "report"] = "none"
    """'drop': training documents that share an n-gram with an evaluation set are left out (and listed);
    'report': listed and kept; 'none': not checked. The list: `<output_dir>/filtered/decontamination.jsonl`."""
    ngram: int = 13
    """Words per n-gram (GPT-3 and Llama 2 use 13); an evaluation item of `min_ngram` to `ngram` words is one gram
    of all its words."""
    min_ngram: int = 8
    """The fewest words a gram has (GPT-3's floor): an evaluation item shorter than this is never matched (a number,
    a letter, `True`: words every corpus holds), only listed with its count in `filtered/ngrams.json`."""
    max_drop_fraction: float = 0.001
    """The guard: one gram found in more than this fraction of a source's documents, and in more than
    `min_guarded_drops` of them, is common text, not contamination: with mode drop the run stops before the filter
    stage writes anything, naming the gram, its evaluation item and the count; with mode report it is listed."""
    min_guarded_drops: int = 10
    """The guard stops a run only for a gram found in more documents than this (a small source with one honest
    match is not stopped)."""
    against: list[str | LocalEvalSet | HubEvalSet] = field(default_factory=list)
    """Evaluation sets: a local file (a path, or a mapping `LocalEvalSet` to choose its fields; relative to the
    config file; JSONL or parquet records, GSM8k's test format) or a Hub dataset (a mapping, `HubEvalSet`)."""


@dataclass
class NearDedupConfig:
    """MinHash LSH near-duplicate removal, used with `dedup: near` (huginn_ray/data/near_dedup.py)."""

    shingle: int = 5
    """Words per shingle: documents are compared as sets of `shingle` consecutive words."""
    threshold: float = 0.8
    """Jaccard similarity of two documents' shingle sets (estimated from their MinHash signatures) at which the
    later one is a near duplicate of the first."""
    bands: int = 14
    """LSH bands: two documents whose signatures agree in all rows of any one band are compared (FineWeb: 14)."""
    rows: int = 8
    """Hash functions per band (FineWeb: 8); a signature holds bands x rows values, 4 bytes each."""
    seed: int = 1
    """Seeds the hash functions; another seed finds (almost) the same near duplicates."""


@dataclass
class LocalRayConfig:
    num_cpus: int | None = None
    """CPUs of a Ray instance this job starts itself (ignored when connecting to a running cluster)."""
    object_store_mib: int | None = None
    """Object store size of a Ray instance this job starts itself; spilling to disk covers the rest."""
    temp_dir: str | None = None
    """Ray temp dir of a Ray instance this job starts itself (keep it short: socket paths < 107 chars)."""


@dataclass
class DataConfig:
    output_dir: str
    """Root of everything this pipeline writes: download/, staging/, tokenizer/, packed/, shards/. A bucket
    (`s3://...`): the stages run in `scratch_dir` and the published shards (and the tokenizer) are uploaded here
    (huginn_ray/data/bucket_publish.py)."""
    sources: str
    """YAML list of sources (see huginn_ray/data/sources.py); relative to this config file, or an object
    (`s3://...`)."""
    scratch_dir: str = ""
    """With output_dir in a bucket: the local directory the stages run in (a rerun resumes from it; every node of
    the Ray cluster must see it: a local Ray, or a shared file system); empty: `<system temp dir>/huginn_data/
    <hash of output_dir>`. Ignored for a local output_dir."""
    seq_len: int = 4096
    """Model context; every packed row holds seq_len + 1 token ids."""
    num_shards: int = 4096
    """Train shards and validation shards written (one per training rank)."""
    seed: int = 233
    """Seeds document order, up-weighting, the validation hold-out and the global shuffle."""
    val_fraction: float = 0.05
    """Share of documents held out for validation (chosen by a seeded hash of the document text)."""
    docs_per_pack_batch: int = 4096
    """Documents tokenised and packed together (leftovers shorter than a row are dropped per batch)."""
    max_document_chars: int = 1 << 25
    """Longest document (in characters) the pack stage takes: a longer one is refused before packing, naming its
    source, file and row. A pack task's memory grows by ~180 bytes per character of its largest document
    (huginn_ray/data/tokenize_pack.py, pack_task_memory): 32 Mi characters, about 6 GiB."""
    drop_val_duplicates: bool = True
    """Packed sources: validation rows whose bytes also occur in a training row are counted and left out of the
    validation shards (false: counted and kept)."""
    download: DownloadConfig = field(default_factory=DownloadConfig)
    """How Hub files are fetched."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Where the tokenizer lives and how jobs/train_tokenizer.py trains it."""
    shuffle: ShuffleConfig = field(default_factory=ShuffleConfig)
    """Global shuffle into per-rank shards."""
    chat: ChatRowsConfig = field(default_factory=ChatRowsConfig)
    """Rows of chat sources (`kind: chat`); ignored by other sources."""
    decontaminate: DecontaminateConfig = field(default_factory=DecontaminateConfig)
    """Training documents that share an n-gram with an evaluation set (huginn_ray/data/decontaminate.py)."""
    dedup: Literal["none", "exact", "near"] = "none"
    """'exact': of documents with the same text, across all sources, only the first (in source-list, file, row
    order) is kept (huginn_ray/data/doc_dedup.py); 'near': exact, then of documents whose word shingles are
    `near_dedup.threshold` similar, only the first (huginn_ray/data/near_dedup.py)."""
    near_dedup: NearDedupConfig = field(default_factory=NearDedupConfig)
    """MinHash LSH settings of `dedup: near`."""
    local_ray: LocalRayConfig = field(default_factory=LocalRayConfig)
    """Settings of a Ray instance the job starts itself."""

    def __post_init__(self) -> None:
        positive = {"seq_len": self.seq_len, "num_shards": self.num_shards,
                    "docs_per_pack_batch": self.docs_per_pack_batch, "max_document_chars": self.max_document_chars,
                    "download.max_in_flight": self.download.max_in_flight,
                    "download.max_attempts": self.download.max_attempts,
                    "shuffle.reducer_mib": self.shuffle.reducer_mib, "shuffle.map_mib": self.shuffle.map_mib,
                    "shuffle.row_group_size": self.shuffle.row_group_size,
                    "tokenizer.rows_per_source": self.tokenizer.rows_per_source,
                    "tokenizer.max_chars_per_doc": self.tokenizer.max_chars_per_doc}
        for key, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{key}: must be positive, got {value}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction: must be in (0, 1), got {self.val_fraction}")
        check_ranges(self, DATA_RANGES)
        if self.decontaminate.min_ngram > self.decontaminate.ngram:
            raise ConfigError(f"decontaminate.min_ngram: {self.decontaminate.min_ngram} is more than "
                              f"decontaminate.ngram ({self.decontaminate.ngram})")
        if self.decontaminate.mode != "none" and not self.decontaminate.against:
            raise ConfigError(f"decontaminate.against: mode {self.decontaminate.mode!r} needs at least one "
                              "evaluation file")
        for i, entry in enumerate(self.decontaminate.against):
            if isinstance(entry, HubEvalSet):
                check_hub_eval_set(entry, f"decontaminate.against[{i}]")
            elif isinstance(entry, LocalEvalSet) and (not entry.fields or not all(entry.fields)):
                raise ConfigError(f"decontaminate.against[{i}].fields: must list at least one field name, got "
                                  f"{entry.fields!r}")
        if not self.output_dir:
            raise ConfigError("output_dir: must be set")

    @property
    def tokenizer_dir(self) -> Path:
        """The local tokenizer directory the stages read: tokenizer.path, its copy under `mirror_dir` when that is
        a bucket prefix, else `<root>/tokenizer`."""
        if storage.is_uri(self.tokenizer.path):
            return self.mirror_dir / ".tokenizer"  # a source name starts with a letter or digit: no clash
        return Path(self.tokenizer.path) if self.tokenizer.path else self.root / "tokenizer"

    @property
    def mirror_dir(self) -> Path:
        """Where the inputs in a bucket are copied (huginn_ray/data/bucket_sources.py): `<name>/` per source."""
        return self.root / "mirror"

    @property
    def in_bucket(self) -> bool:
        """output_dir is object storage: the stages run in `root`, a local scratch directory."""
        return storage.is_uri(self.output_dir)

    @property
    def root(self) -> Path:
        """The local directory the stages read and write: output_dir, or for a bucket output_dir the scratch."""
        if not self.in_bucket:
            return Path(self.output_dir)
        if self.scratch_dir:
            return Path(self.scratch_dir)
        key = hashlib.sha256(self.output_dir.rstrip("/").encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / "huginn_data" / key


def check_hub_eval_set(entry: HubEvalSet, key: str) -> None:
    """Refuse a malformed Hub evaluation set naming its key: a repo id the Hub would refuse, a config or split that
    is not one plain path part, no field."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(entry.hub)
    except HFValidationError as err:
        raise ConfigError(f"{key}.hub: {entry.hub!r} is not a Hub repo id: {err}") from None
    for name in ("config", "split", "revision"):
        value = getattr(entry, name)
        if not value or (name != "revision" and any(c in value for c in "/*?[]")):
            raise ConfigError(f"{key}.{name}: {value!r} must be a non-empty name"
                              f"{'' if name == 'revision' else ' without / or wildcards'}")
    if not entry.fields or any(not f for f in entry.fields):
        raise ConfigError(f"{key}.fields: must list at least one column name, got {entry.fields!r}")


# allowed ranges of the numeric fields not checked above
DATA_RANGES: dict[str, Range] = {
    "seed": NON_NEGATIVE,
    "tokenizer.vocab_size": Range(33),  # more than the 32 special tokens at the top (train_tokenizer checks the rest)
    "tokenizer.max_token_length": AT_LEAST_1,
    "decontaminate.ngram": AT_LEAST_1,
    "decontaminate.min_ngram": AT_LEAST_1,
    "decontaminate.max_drop_fraction": Range(0.0, 1.0),
    "decontaminate.min_guarded_drops": NON_NEGATIVE,
    "near_dedup.shingle": AT_LEAST_1,
    "near_dedup.bands": AT_LEAST_1,
    "near_dedup.rows": AT_LEAST_1,
    "near_dedup.seed": NON_NEGATIVE,
    "near_dedup.threshold": Range(0, 1, lo_open=True),
    "local_ray.num_cpus": AT_LEAST_1,
    "local_ray.object_store_mib": POSITIVE,
}


def load_data_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> DataConfig:
    path = Path(path).resolve()
    cfg = load_config(DataConfig, path, overrides)
    base = path.parent
    against = [str(_resolve(p, base)) if isinstance(p, str) else
               dataclasses.replace(p, path=str(_resolve(p.path, base))) if isinstance(p, LocalEvalSet) else p
               for p in cfg.decontaminate.against]
    for i, p in enumerate(against):
        if not isinstance(p, HubEvalSet) and not Path(getattr(p, "path", p)).is_file():
            raise ConfigError(f"decontaminate.against[{i}]{'' if isinstance(p, str) else '.path'}: no such file: "
                              f"{getattr(p, 'path', p)}")
    cfg = dataclasses.replace(
        cfg,
        decontaminate=dataclasses.replace(cfg.decontaminate, against=against),
        sources=_resolve(cfg.sources, base),
        output_dir=_resolve(os.path.expanduser(cfg.output_dir), Path.cwd()),
        scratch_dir=_resolve(os.path.expanduser(cfg.scratch_dir), Path.cwd()) if cfg.scratch_dir else "",
        tokenizer=dataclasses.replace(
            cfg.tokenizer,
            path=_resolve(cfg.tokenizer.path, Path.cwd()) if cfg.tokenizer.path else "",
        ),
    )
    if storage.is_uri(cfg.scratch_dir):
        raise ConfigError(f"scratch_dir: {cfg.scratch_dir} — must be a local directory (the stages need POSIX files)")
    return cfg


def _resolve(value: str, base: Path) -> str:
    """A URI kept as a URI; a local path: absolute kept as given, relative resolved against `base`."""
    try:
        if storage.is_uri(value) or not Path(value).is_absolute():
            return storage.resolve_location(value, base)
    except storage.StorageError as err:
        raise ConfigError(str(err)) from None
    return str(Path(value))
