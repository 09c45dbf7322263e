"""Decontamination's normalisation and n-gram matching, Hub evaluation sets (the real huggingface_hub client
against tests/data_hub_server.py), exact deduplication's decision, and the config's checks, with exact expected
values, and the filter stage's datasets on a local Ray: workers killed in each of its three operators rerun with
twice their memory and write the same bytes, a staged file changed under the stage refused by name (the stage
end to end, through the pack stage and the manifest, is in tests/test_data_pipeline.py, with a Hub set in
tests/test_data_hub_download.py)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import signal
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from huginn_ray.config import ConfigError
from huginn_ray.data.config import LocalEvalSet, load_data_config
from huginn_ray.data.decontaminate import (DropGuard, EvalFile, Match, build_ngram_set, document_words, eval_files,
                                           first_match, gram_hashes, guard_common_grams, normalise)
from huginn_ray.data.doc_dedup import (bucket_bounds, bucket_entries, content_hashes, duplicate_counts,
                                       duplicate_keys, duplicate_rows, hash_table)
from huginn_ray.data.doc_filter import find_duplicates, read_bucket
from huginn_ray.data.execution import UNDECLARED_MEMORY
from huginn_ray.data.formatting import DataError
from data_hub_server import HUB_QUESTIONS, FakeHub, gsm8k_repo, use_endpoint, web_config_against_hub
from local_ray import module_ray

ROOT = Path(__file__).resolve().parents[1]
GSM8K_SAMPLE = ROOT / "configs" / "eval" / "gsm8k_test_sample.jsonl"


def test_normalise_lowercases_and_splits_on_whitespace_and_punctuation():
    assert normalise("Q:Janet’s ducks lay 16 eggs_per-day.\n\tShe sells them for $2!  ÉTÉ, naïve") == [
        "q", "janet", "s", "ducks", "lay", "16", "eggs", "per", "day", "she", "sells", "them", "for", "2", "été",
        "naïve"]
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


def test_ngram_set_matches_13_grams_after_normalisation_and_items_from_the_floor_whole(tmp_path):
    evals = tmp_path / "eval.jsonl"
    question = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen?"
    answer = "So the short answer is 42, as before."  # 8 words: the floor, one gram of all of them
    evals.write_text(json.dumps({"question": question, "answer": answer}) + "\n\n"
                     + json.dumps({"question": "What is six times seven, Bob?", "answer": "#### 42"}) + "\n")
    fields = ("question", "answer")
    ngrams = build_ngram_set([EvalFile(evals, str(evals), fields)], 13)
    assert (ngrams.n, ngrams.min_ngram, len(ngrams.hashes), ngrams.lengths) == (13, 8, 2 + 1, (8, 13))
    assert ngrams.sources == [f"{evals}, line 1, question", f"{evals}, line 1, answer"]
    assert ngrams.short_items == (f"{evals}, line 3, question", f"{evals}, line 3, answer")  # 6 and 1 words

    def match(text: str, chat: bool = False):
        return first_match(document_words(text, chat), ngrams.hashes, ngrams.items, ngrams.lengths)

    assert match("Prefix: TWO, three four five six seven eight nine ten eleven twelve thirteen fourteen!") == Match(
        "two three four five six seven eight nine ten eleven twelve thirteen fourteen", 0)
    assert match("two three four five six seven eight nine ten eleven twelve thirteen") is None  # 12 words
    assert match("two three four five six seven eight nine ten eleven twelve thirteen 14") is None
    said = "so the short answer is 42 as before"
    assert match("He said: so the short answer is 42 as before. Then left.") == Match(said, 1)
    assert match("the short answer is 42 as before") is None  # 7 of its words
    assert match("what is six times seven bob? 42") is None  # an item under the floor is never matched
    # chat documents as staged: each message's content on its own; JSON and roles never join two messages
    conversation = [{"role": "user", "content": "so the short answer"},
                    {"role": "assistant", "content": "is 42 as before"}]
    assert match(json.dumps(conversation), chat=True) is None
    assert match(json.dumps([{"role": "user", "content": "So the short answer\nis 42 as before"}]), chat=True) == Match(
        said, 1)  # the newline as whitespace, not as JSON's `\n`
    assert match(json.dumps([["user", "x"], "then: so the short answer is 42 as before"]), chat=True) == Match(said, 1)
    local = [EvalFile(evals, str(evals), fields)]
    assert build_ngram_set(local, 13).digest == ngrams.digest != build_ngram_set(local, 12).digest
    assert build_ngram_set(local, 13, guard=DropGuard(0.01)).digest != ngrams.digest  # the guard decides again
    # the floor lowered: the 6-word question becomes one gram (the 1-word answer still is none)
    lowered = build_ngram_set(local, 13, min_ngram=2)
    assert (lowered.lengths, lowered.short_items) == ((6, 8, 13), (f"{evals}, line 3, answer",))
    assert lowered.digest != ngrams.digest
    # a Hub set's commit is part of the digest: the same questions at another commit are another set
    at = [{"hub": "openai/gsm8k", "commit": "a" * 40}]
    assert build_ngram_set(local, 13, tuple(at)).digest != ngrams.digest
    assert build_ngram_set(local, 13, tuple(at)).digest != build_ngram_set(local, 13, ({**at[0], "commit": "b" * 40},)).digest


MULTIPLE_CHOICE = [  # an evaluation set of short answers and multiple-choice letters, as a new user writes one
    {"question": "Janet has three ducks and each lays sixteen eggs a day; how many eggs a week?", "answer": "#### 0"},
    {"question": "Which planet of the solar system is the largest by mass and by volume?", "answer": "B"},
    {"question": "Is water made of two hydrogen atoms bonded to one oxygen atom in each molecule?",
     "answer": "True"},
    {"question": "A train covers 60 miles in 1 hour; how many miles in 3 hours?", "answer": "1"},  # 13 words
    {"question": "Name the author who wrote the novel about a white whale.", "answer": "A"},  # 11 words: one gram
    {"question": "Is the sky blue? yes or no", "answer": "yes"},  # 7 words: under the floor, never matched
]


def test_short_answers_and_letters_drop_no_clean_document_and_every_planted_question_is_found(tmp_path):
    """500 clean documents made of the words every corpus holds (0, 1, A, B, True, yes, numbers), against an
    evaluation set whose answers are exactly those: no clean document matches; each question of 8 or more words,
    planted verbatim, with case and whitespace changed, inside a longer document and inside a chat message, does;
    the 7-word question and every answer are listed as too short, never matched."""
    evals = tmp_path / "mc.jsonl"
    evals.write_text("".join(json.dumps(r) + "\n" for r in MULTIPLE_CHOICE))
    ngrams = build_ngram_set([EvalFile(evals, str(evals), ("question", "answer"))], 13)
    assert ngrams.short_items == tuple(f"{evals}, line {i + 1}, answer" for i in range(5)) + (
        f"{evals}, line 6, question", f"{evals}, line 6, answer")
    assert ngrams.lengths == (11, 13)
    rng = random.Random(7)
    common = "0 1 2 3 16 60 A B C D True False yes no the a is of and to in it answer question".split()
    clean = [" ".join(rng.choice(common) for _ in range(rng.randint(1, 200))) for _ in range(500)]
    clean += ["0", "A", "B", "True", "yes", "1", "#### 0", "Answer: B", "the answer is True"]

    def found(text: str, chat: bool = False):
        match = first_match(document_words(text, chat), ngrams.hashes, ngrams.items, ngrams.lengths)
        return None if match is None else ngrams.sources[match.item]

    assert [doc for doc in clean if found(doc)] == []
    for line, record in enumerate(MULTIPLE_CHOICE[:5], 1):
        question = record["question"]
        item = f"{evals}, line {line}, question"
        spaced = "  \n\t".join(question.upper().split())
        for planted in (question, spaced, f"{clean[line]} {question} {clean[line + 1]}", f"Q:{question}\nA: B"):
            assert found(planted) == item, planted
        conversation = [{"role": "user", "content": f"Please help. {question.lower()}"},
                        {"role": "assistant", "content": "The answer is B"}]
        assert found(json.dumps(conversation), chat=True) == item
        assert found(json.dumps([["user", spaced], "so the answer is 0"]), chat=True) == item
    assert found(MULTIPLE_CHOICE[5]["question"]) is None


def test_the_guard_stops_a_dropping_run_on_a_common_gram_naming_it_and_lists_it_in_report_mode(tmp_path):
    """An evaluation item quoting a boilerplate sentence that 50 of a source's 1,000 documents hold: its gram would
    drop more than 0.1 % and more than 10 of them, so a dropping run stops naming the gram, the item and the
    count, and mode report lists it; a small source whose one honest copy is 1 % of it is not stopped."""
    from types import SimpleNamespace

    boiler = "All rights reserved and no part of this page may be copied without permission."
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"question": f"{boiler} How many pages are there?"}) + "\n"
                     + json.dumps({"question": "How many legs do four spiders and two ants have in total?"}) + "\n")
    ngrams = build_ngram_set([EvalFile(evals, str(evals))], 13)
    rng = random.Random(11)
    words = "the raven flies over a recurrent depth of latent thought".split()
    web = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(1000)]
    for i in range(0, 1000, 20):
        web[i] += f" {boiler}"
    web[7] = "Homework: how many legs do four spiders and two ants have in total?"
    small = ["just a note"] * 99 + ["Homework: how many legs do four spiders and two ants have in total?"]

    def scanned(docs: list[str]) -> list[dict]:
        matches = [first_match(document_words(d, False), ngrams.hashes, ngrams.items, ngrams.lengths) for d in docs]
        return [{"gram": m.gram, "item": m.item} for m in matches if m is not None]

    files = [(SimpleNamespace(name="web"), {"rows": 600}), (SimpleNamespace(name="web"), {"rows": 400}),
             (SimpleNamespace(name="small"), {"rows": 100})]
    matches = [scanned(web[:600]), scanned(web[600:]), scanned(small)]
    gram = "all rights reserved and no part of this page may be copied without"
    with pytest.raises(DataError, match=rf"^decontaminate: 1 n-gram\(s\) would drop more than max_drop_fraction="
                                        rf"0.001 and more than min_guarded_drops=10 of a source's documents: "
                                        rf"'{gram}' \(evaluation item {evals}, line 1, question\) in 50 of the "
                                        r"1000 documents of source 'web'\. Common text"):
        guard_common_grams(ngrams, files, matches, dropping=True)
    listed = guard_common_grams(ngrams, files, matches, dropping=False)
    assert listed == [{"source": "web", "gram": gram, "item": f"{evals}, line 1, question", "documents": 50,
                       "of": 1000}]
    # 50 documents are 5 %: a guard of 10 % (or of more than 50 documents) lets the run go on
    for guard in (DropGuard(0.1, 10), DropGuard(0.001, 50)):
        lenient = build_ngram_set([EvalFile(evals, str(evals))], 13, guard=guard)
        assert guard_common_grams(lenient, files, matches, dropping=True) == []


def test_bad_evaluation_files_are_named(tmp_path):
    evals = tmp_path / "eval.jsonl"
    evals.write_text('{"question": "q", "answer": "a"}\n{"question": "q2"}\n')
    with pytest.raises(DataError, match=rf"^decontaminate.against: {evals}, line 2: field 'answer' must be a "
                                        r"string, got NoneType$"):
        build_ngram_set([EvalFile(evals, str(evals), ("question", "answer"))], 13)
    assert build_ngram_set([EvalFile(evals, str(evals))], 13).short_items == (  # the question only, by default
        f"{evals}, line 1, question", f"{evals}, line 2, question")
    evals.write_text('{"question": "q", "answer": "a"}\nnot json\n')
    with pytest.raises(DataError, match=rf"^decontaminate.against: {evals}, line 2: invalid JSON"):
        build_ngram_set([EvalFile(evals, str(evals))], 13)


def test_data_config_refuses_bad_decontaminate_and_dedup_keys_by_name(tmp_path):
    config = tmp_path / "data.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\nsources: s.yaml\n")
    (tmp_path / "gsm8k.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    cfg = load_data_config(config, ["decontaminate.mode=drop", "decontaminate.against=[gsm8k.jsonl]"])
    assert cfg.decontaminate.against == [str(tmp_path / "gsm8k.jsonl")]  # relative to the config file
    assert (cfg.decontaminate.ngram, cfg.decontaminate.min_ngram, cfg.decontaminate.max_drop_fraction,
            cfg.decontaminate.min_guarded_drops) == (13, 8, 0.001, 10)
    cfg = load_data_config(config, ["decontaminate.mode=drop",
                                    "decontaminate.against=[{path: gsm8k.jsonl, fields: [question, answer]}]"])
    assert cfg.decontaminate.against == [LocalEvalSet(str(tmp_path / "gsm8k.jsonl"), ["question", "answer"])]
    for overrides, message in (
            (["decontaminate.mode=remove"], "decontaminate.mode: 'remove' is not one of ['none', 'drop', 'report']"),
            (["decontaminate.ngram=0"], "decontaminate.ngram: must be in"),
            (["decontaminate.min_ngram=14"], "decontaminate.min_ngram: 14 is more than decontaminate.ngram"),
            (["decontaminate.max_drop_fraction=1.5"], "decontaminate.max_drop_fraction: must be in"),
            (["decontaminate.min_guarded_drops=-1"], "decontaminate.min_guarded_drops: must be in"),
            (["decontaminate.against=[{path: gsm8k.jsonl, fields: []}]"],
             "decontaminate.against[0].fields: must list at least one field name"),
            (["decontaminate.against=[{path: missing.jsonl}]"],
             f"decontaminate.against[0].path: no such file: {tmp_path / 'missing.jsonl'}"),
            (["decontaminate.against=[{path: gsm8k.jsonl, colour: red}]"],
             "unknown config key 'decontaminate.against[0].colour'"),
            (["decontaminate.mode=drop"], "decontaminate.against: mode 'drop' needs at least one evaluation file"),
            (["decontaminate.against=[missing.jsonl]"],
             f"decontaminate.against[0]: no such file: {tmp_path / 'missing.jsonl'}"),
            (["dedup=fuzzy"], "dedup: 'fuzzy' is not one of ['none', 'exact', 'near']"),
            (["decontaminate.colour=red"], "colour")):
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_data_config(config, overrides)


def test_hub_evaluation_sets_are_typed_entries_refused_by_name_when_malformed(tmp_path):
    from huginn_ray.data.config import HubEvalSet

    config = tmp_path / "data.yaml"
    (tmp_path / "gsm8k.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    config.write_text(f"output_dir: {tmp_path / 'out'}\nsources: s.yaml\ndecontaminate:\n  mode: drop\n  against:\n"
                      "    - gsm8k.jsonl\n    - {hub: openai/gsm8k, config: main}\n"
                      "    - {hub: cais/mmlu, config: all, split: test, revision: v1.0, fields: [question]}\n")
    cfg = load_data_config(config)
    assert cfg.decontaminate.against == [
        str(tmp_path / "gsm8k.jsonl"), HubEvalSet("openai/gsm8k", "main", "test", "main", ["question"]),
        HubEvalSet("cais/mmlu", "all", "test", "v1.0", ["question"])]
    assert cfg.decontaminate.against[1].patterns == ["main/test-*.parquet"]
    assert HubEvalSet("acme/evals").patterns == ["data/test-*.parquet"]  # push_to_hub's default configuration
    for entry, message in (
            ("{hub: openai/gsm8k, colour: red}", "unknown config key 'decontaminate.against[0].colour'"),
            ("{config: main}", "decontaminate.against[0]: HubEvalSet.__init__() missing 1 required positional "
                               "argument: 'hub'"),
            ("{hub: 'openai/gsm8k/extra'}", "decontaminate.against[0].hub: 'openai/gsm8k/extra' is not a Hub repo id"),
            ("{hub: openai/gsm8k, config: 'main/*'}", "decontaminate.against[0].config: 'main/*' must be a non-empty "
                                                      "name without / or wildcards"),
            ("{hub: openai/gsm8k, split: ''}", "decontaminate.against[0].split: '' must be a non-empty name"),
            ("{hub: openai/gsm8k, fields: []}", "decontaminate.against[0].fields: must list at least one column name"),
            ("{hub: openai/gsm8k, fields: question}", "decontaminate.against[0].fields: expected a list")):
        with pytest.raises(ConfigError) as err:
            load_data_config(config, [f"decontaminate.against=[{entry}]"])
        assert str(err.value).startswith(message), (entry, str(err.value))


TOKEN = "hf_local_test_token_do_not_log_0123456789"


def test_a_hub_evaluation_set_is_resolved_fetched_once_and_read_with_its_commit(tmp_path, monkeypatch):
    """eval_files against the local Hub server (HF_ENDPOINT's constant and HF_TOKEN as the download stage uses
    them): the split's file is fetched at the resolved commit into <root>/eval_sets/, its items name repo, commit
    and file, the origin records commit, files and hashes; a second call fetches nothing; with fetch=False a set
    not cached yet gives None and writes nothing."""
    import hashlib

    from huginn_ray.data.config import DownloadConfig, HubEvalSet

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    repo = gsm8k_repo()
    entry = HubEvalSet("openai/gsm8k", "main")
    local = tmp_path / "local.jsonl"
    local.write_text('{"question": "How many legs do four spiders have?", "answer": "#### 32"}\n')
    with FakeHub([repo], token=TOKEN) as hub:
        use_endpoint(monkeypatch, hub)
        download = DownloadConfig(max_attempts=2)
        assert eval_files([str(local), entry], tmp_path / "root", download, fetch=False) is None
        assert not (tmp_path / "root").exists()
        files, origins = eval_files([str(local), entry], tmp_path / "root", download)
        cached = tmp_path / "root" / "eval_sets" / f"openai/gsm8k@{repo.commit}" / "main/test-00000-of-00001.parquet"
        assert files == [EvalFile(local, str(local)),
                         EvalFile(cached, f"openai/gsm8k@{repo.commit[:12]}/main/test-00000-of-00001.parquet",
                                  ("question",))]
        assert cached.read_bytes() == repo.files["main/test-00000-of-00001.parquet"]
        data = repo.files["main/test-00000-of-00001.parquet"]
        assert origins == ({"path": str(local)}, {
            "hub": "openai/gsm8k", "config": "main", "split": "test", "revision": "main", "commit": repo.commit,
            "files": [{"path": "main/test-00000-of-00001.parquet", "size": len(data),
                       "hash": hashlib.sha256(data).hexdigest()}]})
        gets = [p for method, p, _ in hub.log if method == "GET" and "/resolve/" in p]
        assert gets == [f"/datasets/openai/gsm8k/resolve/{repo.commit}/main/test-00000-of-00001.parquet"]
        # a fetch killed before: its temporary file is deleted once the set's files are verified
        stale = cached.parents[1] / ".cache" / "huggingface" / "download" / "main" / "x.parquet.incomplete"
        stale.parent.mkdir(parents=True, exist_ok=True)
        stale.write_bytes(b"half a file")
        assert eval_files([entry], tmp_path / "root", download) == (files[1:], origins[1:])
        assert not stale.exists()
        assert eval_files([entry], tmp_path / "root", download, fetch=False) == (files[1:], origins[1:])
        assert [p for method, p, _ in hub.log if method == "GET" and "/resolve/" in p] == gets  # cached
    ngrams = build_ngram_set(files, 13, origins)
    assert ngrams.sources[-2:] == [
        f"openai/gsm8k@{repo.commit[:12]}/main/test-00000-of-00001.parquet, row {r}, question" for r in (1, 2)]
    match = first_match(document_words(f"Intro. {HUB_QUESTIONS[1]} Outro.", False), ngrams.hashes, ngrams.items,
                        ngrams.lengths)
    assert match is not None and ngrams.sources[match.item].endswith("row 2, question")


def test_a_missing_hub_repo_revision_split_or_field_is_named_before_anything_is_fetched(tmp_path, monkeypatch):
    from huginn_ray.data.config import DownloadConfig, HubEvalSet

    download = DownloadConfig(max_attempts=1)
    good = HubEvalSet("openai/gsm8k", "main")
    with FakeHub([gsm8k_repo()]) as hub:
        use_endpoint(monkeypatch, hub)
        for entry, message in (
                (HubEvalSet("openai/gsm9k", "main"), r"^decontaminate.against\[1\]: Hub dataset 'openai/gsm9k' "
                                                     r"\(revision 'main'\): openai/gsm9k@main \(listing\): failed"),
                (HubEvalSet("openai/gsm8k", "main", revision="v9"),
                 r"^decontaminate.against\[1\]: Hub dataset 'openai/gsm8k' \(revision 'v9'\)"),
                (HubEvalSet("openai/gsm8k", "main", split="validation"),
                 r"^decontaminate.against\[1\]: Hub dataset openai/gsm8k@\w{12} has no file "
                 r"main/validation-\*.parquet \(config 'main', split 'validation'\)$"),
                (HubEvalSet("openai/gsm8k", "socratic"), r"^decontaminate.against\[1\]: Hub dataset openai/gsm8k@\w{12} "
                                                         r"has no file socratic/test-\*.parquet")):
            with pytest.raises(DataError, match=message):
                eval_files([good, entry], tmp_path / "root", download)
        assert not any("/resolve/" in p for _, p, _ in hub.log) and not (tmp_path / "root").exists()
        files, _ = eval_files([HubEvalSet("openai/gsm8k", "main", fields=["question", "solution"])], tmp_path / "root",
                              download)
    with pytest.raises(DataError, match=r"^decontaminate.against: openai/gsm8k@\w{12}/main/test-00000-of-00001.parquet: "
                                        r"no column 'solution' \(expected \['question', 'solution'\]"):
        build_ngram_set(files, 13)


def test_a_run_refuses_a_missing_hub_evaluation_set_before_any_stage(tmp_path, monkeypatch):
    """pipeline.run resolves the Hub sets first: a repo the Hub does not have fails the run naming the entry and
    the repo before the plan samples a file or any stage writes under output_dir."""
    from huginn_ray.data import pipeline

    config = web_config_against_hub(tmp_path, "openai/gsm9k")
    sampled = []
    monkeypatch.setattr(pipeline, "build_plan", lambda *args: sampled.append(args))
    with FakeHub([gsm8k_repo()]) as hub:
        use_endpoint(monkeypatch, hub)
        with pytest.raises(DataError, match=r"^decontaminate.against\[0\]: Hub dataset 'openai/gsm9k' \(revision "
                                            r"'main'\): openai/gsm9k@main \(listing\): failed after 1 attempt"):
            pipeline.run(load_data_config(config, ["download.max_attempts=1"]))
    assert sampled == [] and not (tmp_path / "out").exists()


def test_exact_dedup_keeps_the_first_occurrence_whatever_the_bucket_count(tmp_path):
    """Three files of documents drawn from a small pool, each scanned in units of consecutive rows: every bucket
    count gives the brute-force answer (a document is dropped when the same text occurs at an earlier (file,
    row)), and the per-file counts are those rows'."""
    rng = random.Random(3)
    pool = [f"doc {i}" for i in range(40)]
    files = [[rng.choice(pool) for _ in range(rng.randint(0, 60))] for _ in range(3)]
    tables = []
    for i, texts in enumerate(files):
        for start, stop in ((0, 7), (7, 20), (20, len(texts))):  # a file's scan units
            tables.append((i, str(tmp_path / f"{i}-{start}.npy")))
            np.save(tables[-1][1], hash_table(content_hashes(texts[start:stop]), start))
    assert hash_table(content_hashes(["b", "a", "b"]), 5).tolist() == sorted(
        [[int(content_hashes([t])[0]), 5 + row] for row, t in enumerate(["b", "a", "b"])])
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
            np.save(outputs[-1], duplicate_keys(*bucket_entries(tables, lo, hi)))
            # doc_dedup's records: the bucket read as one record, its duplicates one record (none: an empty list)
            [found] = find_duplicates(read_bucket(b, lo, hi, tables)[0]).to_pylist()
            assert found == {"bucket": b, "duplicates": np.load(outputs[-1]).tolist()}
        assert [duplicate_rows(outputs, i).tolist() for i in range(3)] == expected
        assert duplicate_counts(outputs, 3).tolist() == [len(rows) for rows in expected]
    assert bucket_bounds(2) == [(0, 2**63), (2**63, 2**64)]


@pytest.fixture(scope="module")
def ray_instance():
    with module_ray("hrdc_"):
        yield


def _killed_once(fn, flag: Path):
    """fn, except that its first call SIGKILLs its own worker process; every call appends (memory= Ray gave the worker, killed or ran) to `<flag>.memory`."""

    def first_call_dies(*args, **kwargs):
        import ray

        memory = ray.get_runtime_context().get_assigned_resources().get("memory")
        try:
            os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
        except FileExistsError:  # a later call, or the rerun of the killed one
            with open(flag.with_suffix(".memory"), "a") as f:
                f.write(json.dumps([memory, "ran"]) + "\n")
            return fn(*args, **kwargs)
        with open(flag.with_suffix(".memory"), "a") as f:
            f.write(json.dumps([memory, "killed"]) + "\n")
        os.kill(os.getpid(), signal.SIGKILL)

    return first_call_dies


def test_filter_workers_killed_in_scan_dedup_and_filter_rerun_with_twice_their_memory_and_change_no_byte(
        ray_instance, tmp_path, monkeypatch, capsys):
    """A scan task, a dedup task and a filter task each SIGKILLed on their first call: the units they had not
    committed run again with twice the memory (scan and filter tasks declare none: 2 x UNDECLARED_MEMORY), and the
    stage's outputs, with the scan cut into units of 7 documents, are byte for byte an undisturbed run's (files
    scanned whole), with no temp file left. A rewritten file has one row group per batch read, of its kept
    documents. A staged file that no longer holds the documents of its marker fails the job with the DataError
    naming it."""
    from huginn_ray.data import doc_filter

    spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "jobs" / "prepare_data.py")
    prepare_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare_data)
    questions = [json.loads(line)["question"] for line in GSM8K_SAMPLE.read_text().splitlines()]
    rng = random.Random(5)
    words = "the raven flies over a recurrent depth of latent thought while ray shards data".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(90)]
    docs[4], docs[70] = f"intro {questions[0]} outro", f"{questions[1]} outro"
    docs[50] = docs[10]
    (tmp_path / "web").mkdir()
    for i in range(3):  # three staged files; file 1 loses a duplicate, file 2 a contaminated document and its copy
        (tmp_path / "web" / f"{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                             for t in docs[30 * i:30 * (i + 1)] + docs[:1] * (i == 2)))
    (tmp_path / "sources.yaml").write_text("- {name: web, local_dir: web, features: [text]}\n")

    config = tmp_path / "data.yaml"

    def outputs(out: Path) -> dict[str, bytes]:
        """Staging and the filter stage into `out`: every file under filtered/."""
        config.write_text(f"output_dir: {out}\nsources: {tmp_path / 'sources.yaml'}\nseq_len: 32\nnum_shards: 2\n"
                          f"decontaminate: {{mode: drop, ngram: 13, against: [{GSM8K_SAMPLE}]}}\ndedup: exact\n")
        assert prepare_data.main(["--quiet", "--config", str(config), "--stage", "staging", "--stage", "filter"]) == 0
        return {p.relative_to(out / "filtered").as_posix(): p.read_bytes()
                for p in sorted((out / "filtered").rglob("*")) if p.is_file()}

    monkeypatch.setattr(doc_filter, "READ_BATCH_ROWS", 8)  # a rewritten file: one row group per 8 documents read
    undisturbed = outputs(tmp_path / "undisturbed")
    assert sorted(undisturbed) == ["_COMPLETE.json", "decontamination.jsonl", "ngrams.json", "ngrams.npy",
                                   "web/00000.parquet", "web/00001.parquet", "web/00002.parquet"]
    # dropped: row 4 | row 20 (a copy of docs[10]) | rows 10 (contaminated) and 30 (a copy of docs[0])
    filtered = [pq.ParquetFile(tmp_path / "undisturbed" / "filtered" / "web" / f"0000{i}.parquet") for i in range(3)]
    assert [[f.metadata.row_group(g).num_rows for g in range(f.num_row_groups)] for f in filtered] == [
        [7, 8, 8, 6], [8, 8, 7, 6], [8, 7, 8, 6]]

    # the killed run also cuts the scan into units of 7 documents: the same bytes
    monkeypatch.setattr(doc_filter, "SCAN_UNIT_DOCS", 7)
    monkeypatch.setattr(doc_filter, "scan_documents", _killed_once(doc_filter.scan_documents, tmp_path / "scan"))
    monkeypatch.setattr(doc_filter, "find_duplicates", _killed_once(doc_filter.find_duplicates, tmp_path / "dedup"))
    monkeypatch.setattr(doc_filter, "read_documents_to_filter",
                        _killed_once(doc_filter.read_documents_to_filter, tmp_path / "filter"))
    killed = outputs(tmp_path / "killed")
    assert killed == undisturbed
    assert not [p for p in (tmp_path / "killed").rglob("*.tmp")]
    dedup_memory = doc_filter.declared_memory(256 * 2**20 + 48 * 91, doc_filter.node_memory_cap())
    for stage, first in (("scan", None), ("dedup", dedup_memory), ("filter", None)):
        attempts = [json.loads(line) for line in (tmp_path / f"{stage}.memory").read_text().splitlines()]
        assert attempts[0] == [first, "killed"], stage
        assert attempts[1:] and {memory for memory, _ in attempts[1:]} == {2 * (first or UNDECLARED_MEMORY)}, stage

    marker = json.loads((tmp_path / "undisturbed" / "filtered" / "_COMPLETE.json").read_text())
    assert marker["decontamination"] == {"documents_per_item": {f"{GSM8K_SAMPLE}, line 1, question": 1,
                                                                f"{GSM8K_SAMPLE}, line 2, question": 1},
                                         "guarded": [], "short_items": 0}

    # the guard: an evaluation item whose one gram ("the raven", the floor lowered to 2 words) many documents hold
    # stops the run after the scan, naming it, and the filter stage's output is left as it was
    monkeypatch.undo()
    common = tmp_path / "common.jsonl"
    common.write_text(json.dumps({"question": "The raven!"}) + "\n")
    holding = sum(1 for d in docs + docs[:1] if " the raven " in f" {d} ")
    assert holding > 3
    before = {p: p.read_bytes() for p in sorted((tmp_path / "undisturbed" / "filtered").rglob("*")) if p.is_file()}
    capsys.readouterr()
    assert prepare_data.main(["--quiet", "--config", str(config), "--stage", "filter",
                              f"output_dir={tmp_path / 'undisturbed'}", "decontaminate.ngram=2",
                              "decontaminate.min_ngram=2", "decontaminate.min_guarded_drops=3",
                              f"decontaminate.against=[{common}]"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prepare_data: error:")]
    assert errors == [
        "prepare_data: error: decontaminate: 1 n-gram(s) would drop more than max_drop_fraction=0.001 and more than "
        f"min_guarded_drops=3 of a source's documents: 'the raven' (evaluation item {common}, line 1, question) in "
        f"{holding} of the 91 documents of source 'web'. Common text, not contamination: nothing was filtered or "
        "written; remove or narrow that evaluation item (its set's `fields`), raise decontaminate.min_ngram or the "
        "guard's limits, or list every match with decontaminate.mode=report"]
    assert {p: p.read_bytes() for p in sorted((tmp_path / "undisturbed" / "filtered").rglob("*"))
            if p.is_file()} == before
    assert not list((tmp_path / "undisturbed").glob("filtered.partial/web/*.parquet"))

    # a staged file rewritten with fewer documents than its marker says (the filter's fingerprint changed:
    # the stage runs again)
    staged = tmp_path / "undisturbed" / "staging" / "web" / "00001.parquet"
    pq.write_table(pq.read_table(staged).slice(0, 20), staged)
    capsys.readouterr()
    assert prepare_data.main(["--quiet", "--config", str(config), "--stage", "filter",
                              f"output_dir={tmp_path / 'undisturbed'}", "decontaminate.mode=report"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prepare_data: error:")]
    assert errors == [  # the DataError itself, not Ray's wrapper of it
        f"prepare_data: error: source 'web': {staged} holds 20 documents from row 1, its staging marker 30: staged "
        "again since it was planned; rerun the staging stage"]
