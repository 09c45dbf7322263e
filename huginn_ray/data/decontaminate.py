"""Decontamination: which training documents share an n-gram with an evaluation set.

    files, origins = eval_files(cfg.decontaminate.against, cfg.root, cfg.download)  # on the driver
    ngrams = build_ngram_set(files, n=13, origins=origins, min_ngram=8)             # once, on the driver
    match = first_match(document_words(text, chat=False), ngrams.hashes, ngrams.items, ngrams.lengths)  # a scan task
    guarded = guard_common_grams(ngrams, files, matches, dropping=True)            # the driver, before any write

Evaluation sets are local files (`config.LocalEvalSet`, or a plain path; GSM8k's test format) or Hub datasets
(`config.HubEvalSet`), each with the fields of its records that are checked (`fields`; GSM8k's `question` by
default): each value is one evaluation item. A Hub set is fetched with huggingface_hub as the download stage
fetches sources (huginn_ray/data/hub_download.py: HF_ENDPOINT, HF_TOKEN, retries, size and hash verified, a verified file trusted
by its record): every Hub set is first resolved to a commit and listed (metadata only; a missing repo, revision
or split is refused by name before anything is fetched), then its files are fetched into
`<output_dir>/eval_sets/<repo>@<commit>/`, where a rerun at the same commit finds them.

Normalisation, close to the GPT-3 (Brown et al. 2020, appendix C) and Llama 2 (Touvron et al. 2023, §4.6) reports:
lowercase, punctuation (every character that is neither a word character nor whitespace, and `_`) made a space,
split on whitespace, so that a question glued to its prompt (`Q:Janet's ducks`) still gives its words (`q janet s
ducks`); an n-gram is n consecutive words. An evaluation item of `min_ngram` (GPT-3's floor, 8) to n words
counts as one gram of all its words, so documents are also checked for grams of that length; an item shorter than
`min_ngram` words (a number, a multiple-choice letter, `True`) is never matched: every corpus holds those words. Such
items are listed, with their count, in the set's report (`ngrams.json`, `short_items`).

The guard (`guard_common_grams`): a document records its first gram found. One gram found in more than
`max_drop_fraction` of a source's documents and in more than `min_guarded_drops` of them is common text (a
boilerplate sentence an evaluation item quotes), not contamination. The filter stage's scan is the counting pass:
it writes only its own intermediate tables, and the driver checks the counts before the stage writes a filtered
file; with mode drop the run stops there, naming the gram, its evaluation item and the count; with mode report the
gram is listed (and printed) and its documents kept.

Hashes, so the set is small and the check vectorised: a word's hash is the 64-bit blake2b of its UTF-8 bytes;
a gram's hash is the polynomial `sum(word_hash[j] * P^(len-1-j)) mod 2^64` over its words, computed for all
positions of a document at once with NumPy. A document matches when one of its grams' hashes is in the set (a
false match needs a 64-bit collision). The set is a pair of arrays sorted by hash (the hash, and the evaluation
item it comes from), written under the data root (`ngrams.npy`), from which each scan task of the filter stage
loads it (huginn_ray/data/doc_filter.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from huginn_ray.data.config import DownloadConfig, HubEvalSet, LocalEvalSet
from huginn_ray.data.formatting import DataError

if TYPE_CHECKING:
    from huginn_ray.data.sources import Source

POLY = np.uint64(0x9E3779B97F4A7C15)
"""The polynomial's base (odd, so no gram's hash loses its first words' bits)."""
_NOT_WORD = re.compile(r"[^\w\s]|_")
EVAL_FIELDS = ("question",)
"""The fields of an evaluation file's records whose text is checked when its set names none (GSM8k's question)."""
MIN_NGRAM = 8
"""The fewest words of a gram (GPT-3's floor; `decontaminate.min_ngram`)."""
EVAL_CACHE = "eval_sets"
"""Under the data root: the Hub evaluation sets' files, `<repo>@<commit>/<path in the repo>`."""


def normalise(text: str) -> list[str]:
    """Lowercased words of `text`, punctuation as a space (`"Q:Janet's ducks, 16."` -> `["q", "janet", "s", "ducks",
    "16"]`)."""
    return _NOT_WORD.sub(" ", text.lower()).split()


_WORD_HASHES: dict[str, int] = {}
WORD_CACHE_SIZE = 1 << 20
"""Word hashes a process keeps (word frequencies are Zipfian: most lookups hit); about 150 MiB when full."""


def word_hash(word: str) -> int:
    """64-bit blake2b of a word's UTF-8 bytes."""
    return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")


def word_hashes(words: list[str]) -> np.ndarray:
    """word_hash of every word (uint64), through this process's cache."""
    cache = _WORD_HASHES
    hashes = [cache.get(w) for w in words]
    for i, h in enumerate(hashes):
        if h is None:
            if len(cache) >= WORD_CACHE_SIZE:
                cache.clear()
            hashes[i] = cache[words[i]] = word_hash(words[i])
    return np.array(hashes, np.uint64)


def _polynomial(w: np.ndarray, n: int) -> np.ndarray:
    count = len(w) - n + 1
    if count <= 0:
        return np.zeros(0, np.uint64)
    acc = np.zeros(count, np.uint64)
    with np.errstate(over="ignore"):  # mod 2^64 is the point
        for j in range(n):
            acc = acc * POLY + w[j:j + count]
    return acc


def gram_hashes(words: list[str], n: int) -> np.ndarray:
    """Hashes of every run of n consecutive words (len(words) - n + 1 of them; none when there are fewer)."""
    return _polynomial(word_hashes(words), n)


@dataclass(frozen=True)
class DropGuard:
    """When one gram's matches are common text rather than contamination (`guard_common_grams`)."""

    max_fraction: float = 0.001
    """More than this fraction of a source's documents (`decontaminate.max_drop_fraction`) ..."""
    min_drops: int = 10
    """... and more than this many of them (`decontaminate.min_guarded_drops`)."""


@dataclass(frozen=True)
class NgramSet:
    """The evaluation sets' grams: `hashes` sorted (uint64), `items[i]` the evaluation item of hashes[i], `lengths`
    the gram lengths to check (n, and the word counts of items of `min_ngram` to n words), `sources` per item its
    file, 1-based line or row and field, `origins` per evaluation set where it came from (`eval_files`),
    `short_items` the items shorter than `min_ngram` words (never matched), `guard` the rule the filter stage applies
    to the matches."""

    n: int
    hashes: np.ndarray
    items: np.ndarray
    lengths: tuple[int, ...]
    sources: list[str]
    origins: tuple[dict, ...] = ()
    min_ngram: int = MIN_NGRAM
    short_items: tuple[str, ...] = ()
    guard: DropGuard = DropGuard()

    @property
    def digest(self) -> str:
        """sha256 of the set's content, the Hub sets' commits and the guard: part of every downstream fingerprint
        (a changed guard decides again whether the run stops)."""
        commits = [origin["commit"] for origin in self.origins if "commit" in origin]
        h = hashlib.sha256(json.dumps([self.n, list(self.lengths), commits, self.min_ngram,
                                       [self.guard.max_fraction, self.guard.min_drops]]).encode())
        h.update(self.hashes.tobytes())
        return h.hexdigest()


@dataclass(frozen=True)
class EvalFile:
    """One file of an evaluation set as the n-gram set reads it: where it is, how its items name it (the local
    path; a Hub file: `<repo>@<commit 12>/<path in the repo>`) and the fields whose values are items."""

    path: Path
    label: str
    fields: tuple[str, ...] = EVAL_FIELDS


def _hub_sets(against: list) -> list[tuple[str, HubEvalSet]]:
    return [(f"decontaminate.against[{i}]", e) for i, e in enumerate(against) if isinstance(e, HubEvalSet)]


def resolve_hub_eval_sets(against: list, download: DownloadConfig) -> list[tuple[str, list]]:
    """(commit, files) of every Hub set of `against`, in order: its revision resolved and its split's files listed
    (metadata only, with the download's retries), at HF_ENDPOINT with HF_TOKEN. A repo or revision the Hub does
    not have, or a split without files, is refused naming the entry before anything is fetched."""
    from huggingface_hub import constants, get_token

    from huginn_ray.data.hub_download import DownloadError, list_repo_files

    hub_sets = _hub_sets(against)
    token = get_token() if hub_sets else None
    resolved = []
    for key, entry in hub_sets:
        try:
            commit, files = list_repo_files(entry.hub, entry.revision, entry.patterns, constants.ENDPOINT, token,
                                            download)
        except DownloadError as err:
            raise DataError(f"{key}: Hub dataset {entry.hub!r} (revision {entry.revision!r}): {err}") from None
        if not files:
            raise DataError(f"{key}: Hub dataset {entry.hub}@{commit[:12]} has no file {entry.patterns[0]} "
                            f"(config {entry.config!r}, split {entry.split!r})")
        resolved.append((commit, files))
    return resolved


def eval_files(against: list, root: Path, download: DownloadConfig, fetch: bool = True
               ) -> tuple[list[EvalFile], tuple[dict, ...]] | None:
    """The files of every evaluation set of `against` on this machine, and per set its origin (a local file: its
    path; a Hub set: repo, config, split, revision, the resolved commit, and its files with size and hash).
    Hub sets are resolved first (`resolve_hub_eval_sets`), then fetched into `<root>/eval_sets/<repo>@<commit>/`
    (verified; a file verified there before is trusted; then the library's `*.incomplete` files that a killed
    fetch left there are deleted). With `fetch` false nothing is fetched or written, and
    None is returned when a Hub set is not there yet (`--plan`)."""
    from huginn_ray.data.hub_download import check_inside, fetch_file, remove_incomplete, verified_before

    resolved = iter(resolve_hub_eval_sets(against, download))
    endpoint, token = None, None
    files, origins = [], []
    for entry in against:
        if not isinstance(entry, HubEvalSet):
            local = entry if isinstance(entry, LocalEvalSet) else LocalEvalSet(entry, list(EVAL_FIELDS))
            files.append(EvalFile(Path(local.path), local.path, tuple(local.fields)))
            origins.append({"path": local.path})
            continue
        commit, hub_files = next(resolved)
        folder = root / EVAL_CACHE / f"{entry.hub}@{commit}"
        for hub_file in hub_files:
            check_inside(folder, hub_file.path, entry.hub)
            if not fetch:
                if not verified_before(folder, hub_file):
                    return None
                continue
            if endpoint is None:
                from huggingface_hub import constants, get_token

                endpoint, token = constants.ENDPOINT, get_token()
            folder.mkdir(parents=True, exist_ok=True)
            fetch_file(entry.hub, commit, hub_file, str(folder), endpoint, token, download)
        if fetch:
            remove_incomplete(folder)  # every file of the set is verified: what a killed fetch left is garbage
        files += [EvalFile(folder / f.path, f"{entry.hub}@{commit[:12]}/{f.path}", tuple(entry.fields))
                  for f in hub_files]
        origins.append({"hub": entry.hub, "config": entry.config, "split": entry.split, "revision": entry.revision,
                        "commit": commit, "files": [{"path": f.path, "size": f.size, "hash": f.sha256 or f.git_sha1}
                                                    for f in hub_files]})
    return files, tuple(origins)


def read_eval_items(file: EvalFile) -> list[tuple[str, str]]:
    """(where, text) of every value of the fields of an evaluation file: JSONL or parquet records holding them
    as strings (GSM8k's test format: `question` and `answer`). A file or record without them is refused by
    name."""
    path, label, fields = file.path, file.label, list(file.fields)
    if not path.is_file():
        raise DataError(f"decontaminate.against: no such file: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        missing = [f for f in fields if f not in table.column_names]
        if missing:
            raise DataError(f"decontaminate.against: {label}: no column {missing[0]!r} (expected {fields}; it has "
                            f"{table.column_names})")
        records = [(f"row {i + 1}", r) for i, r in enumerate(table.select(fields).to_pylist())]
    elif path.name.endswith(".jsonl"):
        records = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            if line.strip():
                try:
                    records.append((f"line {i + 1}", json.loads(line)))
                except json.JSONDecodeError as err:
                    raise DataError(f"decontaminate.against: {label}, line {i + 1}: invalid JSON: {err}") from None
    else:
        raise DataError(f"decontaminate.against: {label}: expected a .jsonl or .parquet file of {fields}")
    items = []
    for where, record in records:
        for field in fields:
            value = record.get(field) if isinstance(record, dict) else None
            if not isinstance(value, str):
                raise DataError(f"decontaminate.against: {label}, {where}: field {field!r} must be a string, "
                                f"got {type(value).__name__}")
            items.append((f"{label}, {where}, {field}", value))
    if not items:
        raise DataError(f"decontaminate.against: {label}: no records")
    return items


def build_ngram_set(files: list[EvalFile], n: int, origins: tuple[dict, ...] = (), min_ngram: int = MIN_NGRAM,
                    guard: DropGuard = DropGuard()) -> NgramSet:
    """Every n-gram of every item of the evaluation files (an item of min_ngram to n words: itself; a shorter one:
    none, listed in `short_items`)."""
    hashes, items, lengths, sources, short = [], [], {n}, [], []
    for file in files:
        for where, text in read_eval_items(file):
            words = normalise(text)
            if len(words) < min_ngram:
                short.append(where)
                continue
            size = min(n, len(words))
            lengths.add(size)
            grams = gram_hashes(words, size)
            hashes.append(grams)
            items.append(np.full(len(grams), len(sources), np.uint32))
            sources.append(where)
    all_hashes = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
    all_items = np.concatenate(items) if items else np.zeros(0, np.uint32)
    order = np.lexsort((all_items, all_hashes))  # by hash, then item: the same set for the same files
    return NgramSet(n, all_hashes[order], all_items[order], tuple(sorted(lengths)), sources, origins, min_ngram,
                    tuple(short), guard)


def save_ngram_set(ngrams: NgramSet, directory: Path) -> None:
    """`ngrams.npy` (hash, item) and `ngrams.json` (n, min_ngram, lengths, item sources, the items too short to be
    matched and their count, the guard, the sets' origins, digest) under `directory`."""
    from huginn_ray.data import layout

    directory.mkdir(parents=True, exist_ok=True)
    tmp = layout.temp_path(directory / "ngrams.npy")
    with open(tmp, "wb") as f:
        np.save(f, np.stack([ngrams.hashes, ngrams.items.astype(np.uint64)], axis=1))
    layout.commit_file(tmp, directory / "ngrams.npy")
    layout.write_json(directory / "ngrams.json", {
        "n": ngrams.n, "min_ngram": ngrams.min_ngram, "lengths": list(ngrams.lengths), "grams": len(ngrams.hashes),
        "items": ngrams.sources, "short_items": {"count": len(ngrams.short_items), "items": list(ngrams.short_items)},
        "guard": {"max_drop_fraction": ngrams.guard.max_fraction, "min_guarded_drops": ngrams.guard.min_drops},
        "origins": list(ngrams.origins), "digest": ngrams.digest})


def document_words(text: str, chat: bool) -> list[list[str]]:
    """The normalised words of a staged document, one list per piece of content checked on its own: the text
    itself, or for chat sources (staged as JSON) each message's content and each text part, so that role names
    and JSON syntax never join the words of two messages."""
    if not chat:
        return [normalise(text)]
    pieces = []
    for part in json.loads(text):
        if isinstance(part, str):  # a pretraining chat document's text part
            pieces.append(part)
        elif isinstance(part, dict):  # a conversation's message (kind: chat)
            pieces.append(part.get("content") or "")
        else:  # a pretraining chat document's [role, content]
            pieces.append(part[1])
    return [normalise(p) for p in pieces]


@dataclass(frozen=True)
class Match:
    """A document's first gram found in the evaluation set: its words and the evaluation item it came from."""

    gram: str
    item: int


def first_match(pieces: list[list[str]], hashes: np.ndarray, items: np.ndarray,
                lengths: tuple[int, ...]) -> Match | None:
    """The document's first gram in the set (first piece, then the shortest length, then the first position), else
    None."""
    if not len(hashes):
        return None
    for words in pieces:
        w = word_hashes(words)
        for size in lengths:
            grams = _polynomial(w, size)
            if not len(grams):
                continue
            at = np.searchsorted(hashes, grams)
            hit = np.flatnonzero(hashes[np.minimum(at, len(hashes) - 1)] == grams)
            if len(hit):
                i = int(hit[0])
                return Match(" ".join(words[i:i + size]), int(items[at[i]]))
    return None


def guard_common_grams(ngrams: NgramSet, files: list[tuple[Source, dict]], matches: list[list[dict]],
                       dropping: bool) -> list[dict]:
    """The grams the guard catches (`DropGuard`): per source, a gram that is the first match of more than
    `max_fraction` of its documents and of more than `min_drops` of them, with its evaluation item and counts,
    most documents first. `files`: (source, staged file with its `rows`) in the filter stage's order, `matches` per
    file its documents' first matches (`gram`, `item`). With `dropping` a caught gram stops the run (a DataError
    naming each); else they are returned to be listed."""
    documents: Counter = Counter()
    found: dict[str, Counter] = {}
    item_of: dict[str, int] = {}
    for (source, f), file_matches in zip(files, matches):
        documents[source.name] += f["rows"]
        counts = found.setdefault(source.name, Counter())
        for m in file_matches:
            counts[m["gram"]] += 1
            item_of.setdefault(m["gram"], m["item"])
    guard = ngrams.guard
    caught = sorted(({"source": name, "gram": gram, "item": ngrams.sources[item_of[gram]], "documents": count,
                      "of": documents[name]}
                     for name, counts in found.items() for gram, count in counts.items()
                     if count > guard.min_drops and count > guard.max_fraction * documents[name]),
                    key=lambda c: (-c["documents"], c["source"], c["gram"]))
    if caught and dropping:
        named = "; ".join(f"{c['gram']!r} (evaluation item {c['item']}) in {c['documents']} of the {c['of']} "
                          f"documents of source {c['source']!r}" for c in caught[:5])
        raise DataError(
            f"decontaminate: {len(caught)} n-gram(s) would drop more than max_drop_fraction={guard.max_fraction} "
            f"and more than min_guarded_drops={guard.min_drops} of a source's documents: {named}"
            f"{' ...' if len(caught) > 5 else ''}. Common text, not contamination: nothing was filtered or "
            "written; remove or narrow that evaluation item (its set's `fields`), raise decontaminate.min_ngram or "
            "the guard's limits, or list every match with decontaminate.mode=report")
    return caught


def decontamination_counts(ngrams: NgramSet, report: list[dict], guarded: list[dict]) -> dict:
    """The filter marker's and the manifest's `decontamination`: per evaluation item the documents whose first
    match it is (dropped, or with mode report listed and kept), in item order; the grams the guard listed; how
    many items were too short to be matched."""
    per_item = Counter(r["item"] for r in report)
    return {"documents_per_item": {item: per_item[item] for item in ngrams.sources if per_item[item]},
            "guarded": guarded, "short_items": len(ngrams.short_items)}
