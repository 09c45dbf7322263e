"""Decontamination's normalisation and n-gram matching, exact deduplication's decision, and the config's checks,
with exact expected values (no Ray; the stage end to end is in tests/test_data_pipeline.py)."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest

from huginn_ray.config import ConfigError
from huginn_ray.data.config import load_data_config
from huginn_ray.data.decontaminate import (Match, build_ngram_set, document_words, first_match, gram_hashes,
                                           normalise)
from huginn_ray.data.doc_dedup import (bucket_bounds, bucket_duplicates, duplicate_rows, hash_table,
                                       merge_hash_tables)
from huginn_ray.data.formatting import DataError

ROOT = Path(__file__).resolve().parents[1]


def test_normalise_lowercases_strips_punctuation_and_splits_on_whitespace():
    assert normalise("Janet’s ducks lay 16 eggs_per-day.\n\tShe sells them for $2!  ÉTÉ, naïve") == [
        "janets", "ducks", "lay", "16", "eggsperday", "she", "sells", "them", "for", "2", "été", "naïve"]
    assert normalise(" ... ") == []


def test_gram_hashes_are_the_polynomial_of_the_words_blake2b():
    def blake(word: str) -> int:
        return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")

    words = "a b c d".split()
    base = 0x9E3779B97F4A7C15
    expected = [(blake(words[i]) * base * base + blake(words[i + 1]) * base + blake(words[i + 2])) % 2**64
                for i in range(2)]
    assert gram_hashes(words, 3).tolist() == expected
    assert blake("a") == 3405396810240292928  # the word hash itself, pinned
    assert gram_hashes(words, 5).tolist() == []


def test_ngram_set_matches_13_grams_after_normalisation_and_short_items_whole(tmp_path):
    evals = tmp_path / "eval.jsonl"
    question = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen?"
    evals.write_text(json.dumps({"question": question, "answer": "Short answer: 42."}) + "\n\n")
    ngrams = build_ngram_set([str(evals)], 13)
    assert (ngrams.n, len(ngrams.hashes), ngrams.lengths) == (13, 2 + 1, (3, 13))
    assert ngrams.sources == [f"{evals}, line 1, question", f"{evals}, line 1, answer"]

    def match(text: str, chat: bool = False):
        return first_match(document_words(text, chat), ngrams.hashes, ngrams.items, ngrams.lengths)

    assert match("Prefix: TWO, three four five six seven eight nine ten eleven twelve thirteen fourteen!") == Match(
        "two three four five six seven eight nine ten eleven twelve thirteen fourteen", 0)
    assert match("two three four five six seven eight nine ten eleven twelve thirteen") is None  # 12 words
    assert match("two three four five six seven eight nine ten eleven twelve thirteen 14") is None
    assert match("the short answer 42 was given") == Match("short answer 42", 1)
    # chat documents as staged: each message's content on its own; JSON and roles never join two messages
    conversation = [{"role": "user", "content": "short answer"}, {"role": "assistant", "content": "42 it is"}]
    assert match(json.dumps(conversation), chat=True) is None
    assert match(json.dumps([{"role": "user", "content": "So: short answer\n42"}]), chat=True) == Match(
        "short answer 42", 1)  # the newline as whitespace, not as JSON's `\n`
    assert match(json.dumps([["user", "x"], "then: short answer 42"]), chat=True) == Match("short answer 42", 1)
    assert build_ngram_set([str(evals)], 13).digest == ngrams.digest != build_ngram_set([str(evals)], 12).digest


def test_bad_evaluation_files_are_named(tmp_path):
    evals = tmp_path / "eval.jsonl"
    evals.write_text('{"question": "q", "answer": "a"}\n{"question": "q2"}\n')
    with pytest.raises(DataError, match=rf"^decontaminate.against: {evals}, line 2: field 'answer' must be a "
                                        r"string, got NoneType$"):
        build_ngram_set([str(evals)], 13)
    evals.write_text('{"question": "q", "answer": "a"}\nnot json\n')
    with pytest.raises(DataError, match=rf"^decontaminate.against: {evals}, line 2: invalid JSON"):
        build_ngram_set([str(evals)], 13)


def test_data_config_refuses_bad_decontaminate_and_dedup_keys_by_name(tmp_path):
    config = tmp_path / "data.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\nsources: s.yaml\n")
    (tmp_path / "gsm8k.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    cfg = load_data_config(config, ["decontaminate.mode=drop", "decontaminate.against=[gsm8k.jsonl]"])
    assert cfg.decontaminate.against == [str(tmp_path / "gsm8k.jsonl")]  # relative to the config file
    for overrides, message in (
            (["decontaminate.mode=remove"], "decontaminate.mode: 'remove' is not one of ['none', 'drop', 'report']"),
            (["decontaminate.ngram=0"], "decontaminate.ngram: must be in"),
            (["decontaminate.mode=drop"], "decontaminate.against: mode 'drop' needs at least one evaluation file"),
            (["decontaminate.against=[missing.jsonl]"],
             f"decontaminate.against[0]: no such file: {tmp_path / 'missing.jsonl'}"),
            (["dedup=fuzzy"], "dedup: 'fuzzy' is not one of ['none', 'exact']"),
            (["decontaminate.colour=red"], "colour")):
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_data_config(config, overrides)


def test_exact_dedup_keeps_the_first_occurrence_whatever_the_bucket_count(tmp_path):
    """Three files of documents drawn from a small pool: every bucket count gives the brute-force answer (a
    document is dropped when the same text occurs at an earlier (file, row))."""
    rng = random.Random(3)
    pool = [f"doc {i}" for i in range(40)]
    files = [[rng.choice(pool) for _ in range(rng.randint(0, 60))] for _ in range(3)]
    tables = []
    for i, texts in enumerate(files):
        tables.append(str(tmp_path / f"{i}.npy"))
        np.save(tables[-1], merge_hash_tables([hash_table(texts[:7]), hash_table(texts[7:20]), hash_table(texts[20:])]))
        assert np.array_equal(np.load(tables[-1]), hash_table(texts))  # a file read in batches: the same table
    seen, expected = set(), []
    for texts in files:
        rows = []
        for row, text in enumerate(texts):
            if text in seen:
                rows.append(row)
            seen.add(text)
        expected.append(rows)
    assert sum(map(len, expected)) > 20
    for buckets in (1, 3, 16):
        outputs = []
        for b, (lo, hi) in enumerate(bucket_bounds(buckets)):
            outputs.append(str(tmp_path / f"dups_{buckets}_{b}.npy"))
            np.save(outputs[-1], bucket_duplicates(tables, lo, hi))
        assert [duplicate_rows(outputs, i).tolist() for i in range(3)] == expected
    assert bucket_bounds(2) == [(0, 2**63), (2**63, 2**64)]
