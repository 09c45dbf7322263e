"""Unit tests of the data pipeline's pure parts: source list validation, packing rule, weights, permutation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from huginn_ray.config import ConfigError, parse_yaml
from huginn_ray.data.chat import document_text
from huginn_ray.data.formatting import chat_template, format_record
from huginn_ray.data.packing import copy_fractions, pack, pack_row_starts, unit_hash
from huginn_ray.data.permutation import FeistelPermutation
from huginn_ray.data.shuffle import plan_split
from huginn_ray.data.sources import Source, parse_sources

GOOD = """
- name: wiki
  address: euirim/goodwiki
  features: [markdown]
  weight: 4.0
  category: wiki
  license: mit
- name: local
  local_dir: /tmp
  features: [text]
"""


def test_source_list_parses_fields_and_defaults():
    wiki, local = parse_sources(parse_yaml(GOOD), "sources.yaml")
    assert (wiki.address, wiki.weight, wiki.every_token_is_sacred) == ("euirim/goodwiki", 4.0, False)
    assert wiki.revision == "main"
    assert wiki.file_patterns == ["*.parquet", "*.jsonl", "*.jsonl.gz", "*.txt"]
    assert local.is_local and not wiki.is_local


@pytest.mark.parametrize("entry, field", [
    ("{name: wiki, address: a/b, features: [x], colour: blue}", "colour"),
    ("{name: wiki, address: a/b, features: [x], weight: heavy}", "weight"),
    ("{name: wiki, address: a/b, features: x}", "features"),
    ("{name: wiki, address: a/b, features: [x], every_token_is_sacred: 1}", "every_token_is_sacred"),
    ("{name: wiki, features: [x]}", "address"),
    ("{name: wiki, address: a/b, features: [x], weight: -1}", "weight"),
    ("{name: 'bad name', address: a/b, features: [x]}", "name"),
    ("{name: wiki, address: a/b, features: [x], kind: dialogue}", "kind"),
    ("{name: wiki, address: a/b, features: [m], kind: chat, loss_on: user}", "loss_on"),
    ("{name: wiki, address: a/b, features: [q, a, b], kind: chat}", "features"),
    ("{name: wiki, address: a/b, features: [m], kind: chat, needs_chat_templating: true}", "needs_chat_templating"),
    ("{name: wiki, address: a/b, features: [x], system_prompt: hi}", "system_prompt"),
    ("{name: wiki, address: a/b, features: [x], loss_on: all}", "loss_on"),
])
def test_bad_source_fields_are_refused_naming_source_and_field(entry, field):
    with pytest.raises(ConfigError) as err:
        parse_sources(parse_yaml(f"- {entry}"), "sources.yaml")
    message = str(err.value)
    assert "sources.yaml" in message and field in message
    if "'bad name'" not in entry:
        assert "'wiki'" in message


def test_max_bad_records_is_a_count_or_a_fraction_and_refuses_by_name():
    from huginn_ray.data.formatting import DataError
    from huginn_ray.data.staging import allowed_bad_records, check_bad_records

    for value, error in [(-1, "got -1"), (1.5, "got 1.5"), (1, None), (0.25, None), (12, None)]:
        entry = f"- {{name: a, local_dir: /x, features: [t], max_bad_records: {value}}}"
        if error is None:
            parse_sources(parse_yaml(entry), "s.yaml")
            continue
        with pytest.raises(ConfigError, match=f"source 'a': field 'max_bad_records': must be a count .*{error}"):
            parse_sources(parse_yaml(entry), "s.yaml")
    records = {"read": 40, "quarantined": {"wrong_type": 2, "invalid_utf8": 1}, "first_bad": "f.jsonl, line 3: x"}
    for limit, allowed in [(0, 0), (2, 2), (3, 3), (0.05, 2), (0.1, 4)]:
        source = Source(name="a", local_dir="/x", features=["t"], max_bad_records=limit)
        assert allowed_bad_records(source, 40) == allowed
        if allowed >= 3:
            check_bad_records(source, records)
        else:
            with pytest.raises(DataError, match=rf"^source 'a': 3 bad records of 40 read, more than max_bad_records: "
                                                rf"{limit:g} allows; the first: f.jsonl, line 3: x$"):
                check_bad_records(source, records)


def test_duplicate_source_names_are_refused():
    with pytest.raises(ConfigError, match="'a'.*more than once"):
        parse_sources(parse_yaml("- {name: a, local_dir: /x, features: [t]}\n"
                                 "- {name: a, local_dir: /y, features: [t]}"), "s.yaml")


def test_formatting_rules():
    multi = Source(name="m", local_dir="/x", features=["title", "body"])
    assert [format_record(row, multi) for row in (["T", "B"], ["U", None])] == ["T\nB", "U\n"]
    single = Source(name="s", local_dir="/x", features=["content"])
    assert [format_record([value], single) for value in ("doc", "", None)] == ["doc", "", ""]  # "": no document
    chat = Source(name="c", local_dir="/x", features=["messages"], needs_chat_templating=True)
    messages = [{"role": "user", "content": " hi \n"}, {"from": "gpt", "value": "hello"}]
    expected = '[["user", "hi"], ["Huginn", "hello"]]'  # staged as parts: the pack stage renders them
    assert chat_template(messages) == expected
    assert format_record([messages], chat) == expected
    assert document_text(json.loads(expected)) == ("<|begin_header|>user<|end_header|>\n\nhi<|end_turn|>"
                                                   "<|begin_header|>Huginn<|end_header|>\n\nhello<|end_turn|>")
    mixed = Source(name="c", local_dir="/x", features=["title", "messages"], needs_chat_templating=True)
    assert [format_record(row, mixed) for row in (["T", messages], [None, []], ["", []])] == [
        '["T", "\\n", ["user", "hi"], ["Huginn", "hello"]]', "", '["", "\\n"]']


def _docs(lengths):
    start, docs = 0, []
    for n in lengths:
        docs.append(np.arange(start, start + n, dtype=np.int32))
        start += n
    return docs


def test_incineration_rule_on_hand_made_documents():
    # row_len 5: [3, 3] fill to 6 -> row [0..4], token 5 burnt; doc 3 (7 tokens, 6..12) -> row [6..10],
    # 11..12 burnt; doc 4 (2 tokens) is left over (< 5) and dropped.
    rows = pack(_docs([3, 3, 7, 2]), [False] * 4, 5)
    assert rows.tolist() == [[0, 1, 2, 3, 4], [6, 7, 8, 9, 10]]


def test_sacred_documents_keep_every_token():
    rows = pack(_docs([3, 3, 7, 2]), [True] * 4, 5)
    assert rows.tolist() == [list(range(0, 5)), list(range(5, 10)), list(range(10, 15))]


def test_sacredness_is_that_of_the_previous_document():
    # Before doc 2 the buffer (docs 0+1, 8 tokens) ends with a sacred doc: cut 5, keep 3 (5..7).
    # Before doc 3 the buffer (5..7 + doc 2 = 5..13, 9 tokens) ends with a non-sacred doc: one row, rest burnt.
    assert pack_row_starts([4, 4, 6, 1], [False, True, False, False], 5) == [0, 5]
    rows = pack(_docs([4, 4, 6, 1]), [False, True, False, False], 5)
    assert rows.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_every_row_has_row_len_tokens():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=500)
    for sacred in (False, True):
        rows = pack(_docs(lengths), [sacred] * len(lengths), 129)
        assert rows.shape[1] == 129 and rows.shape[0] > 0
        assert rows.dtype == np.int32
    total = int(lengths.sum())
    assert pack(_docs(lengths), [True] * len(lengths), 129).shape[0] == total // 129


def test_copy_fractions_and_hash_selection():
    assert copy_fractions(1.0) == [1.0]
    assert copy_fractions(2.5) == [1.0, 1.0, 0.5]
    assert copy_fractions(0.25) == [0.25]
    assert copy_fractions(0.0) == []
    texts = [f"document {i}" for i in range(4000)]
    share = np.mean([unit_hash(7, "copy0", t) < 0.25 for t in texts])
    assert 0.22 < share < 0.28
    assert unit_hash(7, "val", "x") == unit_hash(7, "val", "x") != unit_hash(8, "val", "x")


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097])
def test_feistel_permutation_is_a_bijection(n):
    perm = FeistelPermutation(n, seed=3, stage="shuffle:train")(np.arange(n))
    assert sorted(perm.tolist()) == list(range(n))
    if n > 16:
        assert perm.tolist() != list(range(n))
        assert perm.tolist() != FeistelPermutation(n, seed=4, stage="shuffle:train")(np.arange(n)).tolist()
        assert perm.tolist() != FeistelPermutation(n, seed=3, stage="shuffle:val")(np.arange(n)).tolist()


def test_permutations_are_the_stored_sequences():
    """The data order is defined by the project's code (huginn_ray/data/permutation.py): a library upgrade, or a
    change of the keyed hash or the rounds, that would reorder a resumed run's data fails here."""
    from huginn_ray.data.packing import copy_order
    from huginn_ray.data.permutation import permutation_key

    assert permutation_key(1337, "shuffle:train", 0) == 2118523322511634502
    assert FeistelPermutation(20, seed=1337, stage="shuffle:train")(np.arange(20)).tolist() == [
        1, 4, 2, 17, 8, 5, 11, 6, 13, 3, 16, 7, 18, 14, 12, 10, 19, 0, 15, 9]
    assert FeistelPermutation(1000, seed=1337, stage="shuffle:train")(np.array([0, 1, 2, 997, 998, 999])).tolist() == [
        826, 138, 464, 124, 478, 765]
    assert copy_order(1337, 1, (3 << 32) + 4096, 12).tolist() == [5, 8, 9, 1, 3, 10, 2, 4, 0, 11, 7, 6]


def test_plan_split_drops_surplus_and_refuses_too_few_rows():
    plan = plan_split(103, 4, 100, 1 << 20, "train")
    assert (plan["rows_per_shard"], plan["kept"], plan["dropped"]) == (25, 100, 3)
    with pytest.raises(ValueError, match="val split has 3 packed rows, fewer than num_shards=4"):
        plan_split(3, 4, 100, 1 << 20, "val")


def test_token_dtype_follows_the_vocabulary_and_out_of_range_ids_are_named():
    from huginn_ray.data.tokens import TokenRangeError, check_ids, token_dtype

    assert token_dtype(4096) == token_dtype(65536) == "uint16"
    assert token_dtype(65537) == token_dtype(200_000) == "int32"
    check_ids(np.array([0, 65535]), 65536, "uint16", "x")
    with pytest.raises(TokenRangeError, match="file.parquet: token id 65536 does not fit"):
        check_ids(np.array([3, 65536]), 70000, "uint16", "file.parquet")
    with pytest.raises(TokenRangeError, match="token id -1"):
        check_ids(np.array([-1]), 100, "int32", "x")


def test_training_reader_accepts_uint16_and_int32_shards(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from huginn_ray.data.tokens import row_schema, rows_to_arrow
    from huginn_ray.train.shard_reader import read_row_group

    rows = (np.arange(12 * 5).reshape(12, 5) * 1000) % 65536
    for dtype in ("uint16", "int32"):
        path = tmp_path / f"{dtype}.parquet"
        pq.write_table(pa.table({"input_ids": rows_to_arrow(rows, dtype)}, schema=row_schema(dtype)), path,
                       row_group_size=4)
        got = read_row_group(pq.ParquetFile(path), path, 1, 5)
        assert got.dtype == np.int32 and (got == rows[4:8]).all()


def test_huginn_source_list_carries_all_113_sources_of_the_fact_sheet():
    from pathlib import Path

    from huginn_ray.data.sources import load_sources

    root = Path(__file__).resolve().parents[1]
    sources = {s.name: s for s in load_sources(root / "configs" / "data" / "huginn_sources.yaml")}
    tsv = Path("/work/shared/huginn_sources.tsv")
    if tsv.is_file():
        rows = [line.rstrip("\n").split("\t") for line in tsv.read_text().splitlines() if not line.startswith("#")]
        for name, repo, subset, features, chat, weight, sacred, _, special, _ in rows[1:]:
            s = sources[name]
            assert (s.address, s.subset or "-", ",".join(s.features)) == (repo, subset, features)
            assert (s.needs_chat_templating, s.weight, s.every_token_is_sacred) == (chat == "1", float(weight),
                                                                                    sacred == "1")
            assert s.requires_software_heritage_aws_download == (special == "1")
    assert len(sources) == 113
    assert sources["proofpile-algebra"].file_patterns == ["algebraic-stack/train/*.jsonl.zst"]


def test_zstd_jsonl_and_chat_text_columns(tmp_path):
    import json

    import pyarrow as pa

    from huginn_ray.data.formatting import iter_documents

    path = tmp_path / "part.jsonl.zst"
    with pa.output_stream(str(path), compression="zstd") as out:
        for i in range(3):
            out.write((json.dumps({"text": f"algebra {i}"}) + "\n").encode())
    source = Source(name="pp", features=["text"], address="a/b")
    assert [t for batch in iter_documents(path, source) for t in batch.texts] == ["algebra 0", "algebra 1", "algebra 2"]
    chat = Source(name="qa", features=["question", "answer"], address="a/b", needs_chat_templating=True)
    assert format_record(["2+2?", " 4 "], chat) == '[["user", "2+2?"], ["Huginn", "4"]]'


def test_jsonl_through_arrow_reader_keeps_rows_batches_and_names_bad_lines(tmp_path, monkeypatch):
    """JSON lines are read by Arrow's reader: chat message lists whose messages use different keys, nulls,
    blank lines and a long line stage as json.loads would read them, in batches of exactly ROWS_PER_BATCH
    records; a bad line is named by its number."""
    import json

    from huginn_ray.data import formatting
    from huginn_ray.data.formatting import DataError, iter_documents

    monkeypatch.setattr(formatting, "ROWS_PER_BATCH", 40)
    lines = []
    for i in range(100):
        if i % 2:
            messages = [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f" a{i} ", "w": 1}]
        else:
            messages = [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "x" * (9000 if i == 50 else 1)}]
        lines.append(json.dumps({"messages": None if i in (60, 67) else messages, "id": i if i % 3 else {"k": i}}))
    lines[10] += "\n  \n"
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    chat = Source(name="chat", features=["messages"], local_dir=str(tmp_path), needs_chat_templating=True)
    batches = list(iter_documents(path, chat))
    # rows 60 and 67 are null: no document; their batch is read line by line, the others by Arrow's reader
    assert [(len(b.texts), b.read, b.empty, b.bad) for b in batches] == [(40, 40, 0, []), (38, 40, 2, []),
                                                                          (20, 20, 0, [])]
    rows = [json.loads(line.split("\n")[0]) for line in lines]
    expected = [chat_template(row["messages"]) for row in rows if row["messages"]]
    assert [t for b in batches for t in b.texts] == expected
    assert expected[:2] == ['[["human", "q0"], ["Huginn", "x"]]', '[["user", "q1"], ["Huginn", "a1"]]']

    path.write_text("\n  \n")  # Arrow's reader refuses a stream without a value: no rows
    assert list(iter_documents(path, chat)) == []
    text = Source(name="prose", features=["title", "body"], local_dir=str(tmp_path))
    good = b'{"title": "t", "body": "b"}\n'
    for content, line, reason, detail in [
        (good + b'\n{"title": "t", "body": oops}\n', 3, "invalid_json", "invalid JSON: Expecting value: line 1 "
                                                                        "column 24 (char 23)"),
        (good + b'{"title": "t"}\n', 2, "missing_field", "no field 'body'"),
        (good + b'{"title": "t", "body": 7}\n', 2, "wrong_type", "field 'body' holds int, not text"),
        (b'{"title": "t", "body": "b", "body": "c"}\n' + good, 1, "duplicate_field", "field 'body' appears twice"),
        (good + b'{"title": "t", "body": "caf\xe9"}\n', 2, "invalid_utf8", "not UTF-8 at byte offset 27: " + repr(b'\xe9"}\n')),
        (good + b'{"title": "t", "body": "\xed\xa0\x80"}\n', 2, "lone_surrogate",
         "not UTF-8 at byte offset 24: " + repr(b'\xed\xa0\x80"')),
        (good + b'{"title": "t", "body": "x\\ud800"}\n', 2, "lone_surrogate",
         "a lone surrogate '\\ud800' at character 3"),
    ]:
        path.write_bytes(content)
        batches = list(iter_documents(path, text))
        assert [(r.where, r.reason, r.detail) for b in batches for r in b.bad] == [(f"{path}, line {line}", reason,
                                                                                   detail)], content
        assert [t for b in batches for t in b.texts] == ["t\nb"] and sum(b.read for b in batches) == 2


def test_chat_source_rows_become_json_conversations_and_bad_ones_are_named(tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from huginn_ray.data.formatting import DataError, iter_documents

    qa = Source(name="qa", kind="chat", features=["q", "a"], local_dir="/x", system_prompt="Be brief.")
    assert json.loads(format_record(["2+2?", " 4 "], qa)) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": " 4 "}]
    convs = Source(name="convs", kind="chat", features=["messages"], local_dir="/x", system_prompt="Be brief.")
    own_system = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"},
                  {"role": "Huginn", "content": "h", "extra": 1}]
    assert json.loads(format_record([own_system], convs)) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "u"}, {"role": "Huginn", "content": "h"}]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in [
        {"messages": own_system}, {"messages": [{"role": "bot", "content": "x"}]}, {"conversation": own_system},
        {"messages": [{"role": "user", "content": "u"}, {"role": "user", "content": "again"}]},
        {"messages": [{"role": "user", "content": "u"}]},
        {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]},
        {"messages": [own_system[1], own_system[0], own_system[2]]}, {"messages": own_system}]) + "\n")
    (batch,) = iter_documents(path, convs)
    assert (len(batch.texts), batch.read, batch.empty) == (2, 8, 0)
    assert [(r.unit, r.number, r.reason, r.detail) for r in batch.bad] == [
        ("line", 2, "bad_message", "feature 'messages': message 0: unknown role 'bot'; known: system, user, "
                                   "assistant, Huginn"),
        ("line", 3, "missing_field", "no field 'messages'"),
        *[("line", n, "bad_role_order", f"roles {roles} are not system (optional), then user and assistant taking "
                                        "turns from user, with at least one assistant message")
          for n, roles in [(4, ["system", "user", "user"]), (5, ["system", "user"]),
                           (6, ["system", "Huginn", "user"]), (7, ["system", "user", "system", "Huginn"])]]]
    assert json.loads(batch.bad[0].record) == {"messages": [{"role": "bot", "content": "x"}]}
    pq.write_table(pa.table({"conversation": [own_system]}), tmp_path / "c.parquet")
    with pytest.raises(DataError, match=r"source 'convs': .*c.parquet has no column 'messages' \(columns: "
                                        r"conversation\)"):
        list(iter_documents(tmp_path / "c.parquet", convs))
    pq.write_table(pa.table({"q": ["why?", "2+2?"], "a": [None, "4"]}), tmp_path / "qa.parquet")
    (batch,) = iter_documents(tmp_path / "qa.parquet", qa)
    assert [(r.where, r.reason, r.detail, r.record) for r in batch.bad] == [
        (f"{tmp_path / 'qa.parquet'}, row 1", "wrong_type", "feature 'a' holds NoneType, not text",
         '{"q": "why?", "a": null}')]
    assert [json.loads(t)[-1] for t in batch.texts] == [{"role": "assistant", "content": "4"}]


def test_a_source_list_mixing_chat_with_other_sources_is_refused_by_name():
    from huginn_ray.data.formatting import DataError
    from huginn_ray.data.pipeline import check_sources

    chat = Source(name="convs", kind="chat", features=["messages"], local_dir="/x")
    prose = Source(name="prose", features=["text"], local_dir="/x")
    check_sources([chat, Source(name="qa", kind="chat", features=["q", "a"], local_dir="/x")])
    with pytest.raises(DataError, match=r"mixes chat sources \(convs\) with other sources \(prose\)"):
        check_sources([chat, prose])


def test_unsupported_or_unmatched_sources_are_errors_naming_them(tmp_path):
    from huginn_ray.data.config import DataConfig
    from huginn_ray.data.formatting import DataError
    from huginn_ray.data.pipeline import check_supported, source_inputs

    swh = Source(name="the-stack-v2", features=["content"], address="bigcode/the-stack-v2-train-smol-ids",
                 requires_software_heritage_aws_download=True)
    with pytest.raises(DataError, match="'the-stack-v2'.*Software Heritage"):
        check_supported([swh])
    swh.weight = 0.0
    check_supported([swh])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("x")
    cfg = DataConfig(output_dir=str(tmp_path / "out"), sources="s.yaml")
    source = Source(name="algebra", features=["text"], local_dir=str(tmp_path / "d"), files=["*.jsonl.zst"])
    with pytest.raises(DataError, match=r"source 'algebra': no file under .* matches \['\*.jsonl.zst'\]"):
        source_inputs(cfg, source)


def test_tokenizer_corpus_reads_only_the_files_it_needs_and_uses_message_contents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from huginn_ray.data.formatting import chat_template
    from huginn_ray.data.tokenizer_corpus import corpus_texts

    files = []
    for i in range(50):
        path = tmp_path / f"{i:05d}.parquet"
        pq.write_table(pa.table({"text": [f"file {i} doc {j}" for j in range(20)]}), path, row_group_size=5)
        files.append(path)
    chat = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"text": [chat_template([{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "hello\nthere"}])]}), chat)
    texts = list(corpus_texts({"plain": files, "chat": [chat]}, 12, 100, seed=3, chat_sources=frozenset({"chat"})))
    plain = texts[:12]
    assert len(plain) == 12 and len({t.split(" doc")[0] for t in plain}) <= 3  # a few files, not all 50
    assert plain == list(corpus_texts({"plain": files}, 12, 100, seed=3))
    assert plain != list(corpus_texts({"plain": files}, 12, 100, seed=4))
    assert texts[12:] == ["hi\nhello\nthere"]
    # a kind: chat source's staged conversations (JSON) contribute their message contents too
    conversation = tmp_path / "conversation.parquet"
    pq.write_table(pa.table({"text": [format_record(["hi", "hello\nthere"],
                                                    Source(name="qa", kind="chat", features=["q", "a"], local_dir="/x",
                                                           system_prompt="Be brief."))]}), conversation)
    assert list(corpus_texts({"qa": [conversation]}, 12, 100, seed=3, conversation_sources=frozenset({"qa"}))) == [
        "Be brief.\nhi\nhello\nthere"]


def test_tokenizer_corpus_order_is_the_keyed_hash_permutation_pinned(tmp_path):
    """The corpus sample's file order and row order are permutation.FeistelPermutation's (keyed hash of seed,
    source, file, row group), not a library stream: a fixed seed gives this exact sequence with any NumPy."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from huginn_ray.data.tokenizer_corpus import corpus_texts, sample_order

    files = []
    for i in range(5):
        files.append(tmp_path / f"{i:05d}.parquet")
        pq.write_table(pa.table({"text": [f"f{i}r{j}" for j in range(7)]}), files[-1], row_group_size=3)
    assert sample_order(5, 233, "tokenizer_corpus:web").tolist() == [4, 3, 2, 0, 1]
    assert sample_order(10, 233, "tokenizer_corpus:web").tolist() == [4, 6, 7, 9, 5, 8, 3, 2, 1, 0]
    assert list(corpus_texts({"web": files}, 9, 100, seed=233)) == [
        "f4r0", "f4r1", "f4r2", "f4r4", "f4r3", "f4r5", "f4r6", "f3r1", "f3r2"]
    assert list(corpus_texts({"code": files}, 9, 100, seed=233))[:7] != [
        "f4r0", "f4r1", "f4r2", "f4r4", "f4r3", "f4r5", "f4r6"]  # another source, another order


def test_plan_sample_encodes_the_first_sample_bytes_of_a_large_file_and_reads_the_rest(tmp_path, monkeypatch):
    """A first file larger than the sample: every document is read (text per input byte over the whole file), only
    the first SAMPLE_BYTES of text are encoded and packed."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from huginn_ray.data import plan_sources

    words = {"<unk>": 0, "alpha": 1, "beta": 2}
    inner = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()

    class CountingTokenizer:
        encoded: list[str] = []

        def encode_batch_fast(self, texts):
            self.encoded.extend(texts)
            return inner.encode_batch_fast(texts)

    doc = "alpha beta " * 9 + "alpha"  # 104 bytes of text, 19 tokens
    (tmp_path / "big.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for _ in range(1000)))
    size = (tmp_path / "big.jsonl").stat().st_size
    monkeypatch.setattr(plan_sources, "SAMPLE_BYTES", 25_000)  # about a quarter of the file's text
    tokenizer = CountingTokenizer()
    source = Source(name="big", local_dir=str(tmp_path), features=["text"])
    ratios = plan_sources.sample_source(source, [(str(tmp_path / "big.jsonl"), size)], tokenizer, row_len=65,
                                        docs_per_batch=64, dtype="uint16", row_group_size=64)
    kept = 241  # documents until 25,000 bytes are reached: ceil(25000 / 104)
    assert tokenizer.encoded == [doc] * (kept + kept)  # their lengths, then the ids of (up to 256 of) them
    assert ratios.text_per_input_byte == 104 * 1000 / size  # every document of the file read
    assert ratios.tokens_per_text_byte == 19 / 104
    assert ratios.docs_per_text_byte == 1 / 104


def test_a_stage_commit_killed_at_any_step_is_finished_or_resumed_by_the_rerun(tmp_path):
    """layout.commit_work_dir killed (os._exit in a forked child) at each file-system step in turn: the rerun
    (stale directories removed, finish_commit) finds either the new output complete in place, or the old one
    untouched and the work directory resumable with its committed files; never neither."""
    import os

    from huginn_ray.data import layout

    outcomes = []
    for kill_at in range(1, 40):
        final, work = tmp_path / str(kill_at) / "packed", tmp_path / str(kill_at) / "packed.partial"
        final.mkdir(parents=True)
        (final / "a.parquet").write_text("old")
        layout.write_json(final / layout.COMPLETE, {"fingerprint": "old"})
        work.mkdir()
        layout.write_json(work / layout.PLAN, {"fingerprint": "new"})
        for name in ("a.parquet", "b.parquet", "c.parquet.0123456789ab.tmp"):
            (work / name).write_text("new")
        pid = os.fork()
        if pid == 0:  # the run that dies at its kill_at-th rename, replace, unlink or rmdir
            calls = [0]

            def dying(fn):
                def call(*args, **kwargs):
                    calls[0] += 1
                    if calls[0] == kill_at:
                        os._exit(9)
                    return fn(*args, **kwargs)
                return call

            for name in ("rename", "replace", "unlink", "rmdir"):
                setattr(os, name, dying(getattr(os, name)))
            layout.commit_work_dir(work, final, {"fingerprint": "new"})
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        layout.clean_stale(final)  # the rerun: the dead run's <final>.old-<pid> goes, its commit is finished
        layout.finish_commit(final)
        if layout.is_complete(final, "new"):
            assert sorted(p.name for p in final.iterdir()) == ["_COMPLETE.json", "a.parquet", "b.parquet"]
            assert (final / "a.parquet").read_text() == "new" and not work.exists()
            outcomes.append("new")
        else:
            assert layout.is_complete(final, "old") and (final / "a.parquet").read_text() == "old"
            assert layout.is_complete(work, "new", layout.PLAN)
            assert sorted(p.name for p in work.glob("*.parquet")) == ["a.parquet", "b.parquet"]
            outcomes.append("resume")
        assert sorted(p.name for p in final.parent.iterdir()) == sorted(["packed"] + ["packed.partial"] * (
            outcomes[-1] == "resume"))
        if os.waitstatus_to_exitcode(status) == 0:
            break
    # steps: unlink the temp file; the marker's temp write renamed into place; unlink PLAN; final -> old;
    # work -> final; then the old directory's files and the directory itself removed
    assert outcomes == ["resume", "resume", "new", "new", "new", "new", "new", "new", "new"], outcomes


def test_two_jobs_taking_over_the_same_stale_lock_at_once_one_wins(tmp_path):
    """The run lock that both data jobs take (huginn_ray/train/runlock.py): two processes that both judge the same
    dead holder's lock stale take it over at staggered moments; exactly one holds it, the other is refused naming
    the winner (before: the later one removed the lock the first had just created, and both held it)."""
    import socket
    import subprocess
    import sys
    import time

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "LOCK").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "start": "1",
                                               "since": "2026-01-01T00:00:00Z"}))
    script = """
import sys, time
from huginn_ray.train import runlock
alive, wake = runlock._alive, [float(sys.argv[2])]
def judged_late(holder):  # both read the dead holder now, then act at their own moment
    time.sleep(max(0.0, wake.pop() - time.time()) if wake else 0.0)
    return alive(holder)
runlock._alive = judged_late
lock = runlock.RunLock(sys.argv[1])
try:
    lock.acquire()
    print("won", flush=True)
    time.sleep(1.5)
    lock.release()
except runlock.RunLockError as err:
    print("refused", err, flush=True)
"""
    start = time.time()
    jobs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(start + 1.5 + 0.5 * i)],
                             stdout=subprocess.PIPE, text=True) for i in range(2)]
    outs = [job.communicate(timeout=60)[0] for job in jobs]
    assert outs[0] == "won\n", outs
    assert outs[1].startswith(f"refused another job is writing run directory {tmp_path} (host "
                              f"{socket.gethostname()}, PID {jobs[0].pid},"), outs
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the winner released it; no takeover file left


def test_a_library_upgrade_changes_the_stage_fingerprint_and_the_rerun_names_it(tmp_path, monkeypatch, capsys):
    """Fingerprints hold the versions of the libraries that shape the bytes; a marker records the fingerprint's
    inputs, so a rerun after an upgrade (or a setting change) says what changed instead of rerunning silently."""
    import importlib.metadata

    from huginn_ray.data import layout

    assert layout.library_versions() == {name: importlib.metadata.version(name)
                                         for name in ("tokenizers", "pyarrow", "numpy")}
    digest, inputs = layout.stage_fingerprint({"seed": 1, "tokenizer": "ab" * 32})
    layout.write_json(tmp_path / layout.COMPLETE, {"fingerprint": digest, "fingerprint_inputs": inputs})
    assert layout.current_marker(tmp_path, digest, inputs, "pack")["fingerprint"] == digest
    assert capsys.readouterr().out == ""

    real = layout.library_versions()
    monkeypatch.setattr(layout, "library_versions", lambda: {**real, "tokenizers": "99.0.0"})
    assert layout.stage_fingerprint({"seed": 1, "tokenizer": "ab" * 32})[0] != digest  # the upgrade alone
    upgraded, upgraded_inputs = layout.stage_fingerprint({"seed": 2, "tokenizer": "ab" * 32})
    assert layout.current_marker(tmp_path, upgraded, upgraded_inputs, "pack") is None
    assert capsys.readouterr().out == (f"[pack] {tmp_path}: seed 1 -> 2, tokenizers {real['tokenizers']} -> 99.0.0 "
                                       "changed; the stage reruns\n")
    layout.write_json(tmp_path / layout.COMPLETE, {"fingerprint": "made before inputs were recorded"})
    assert layout.current_marker(tmp_path, upgraded, upgraded_inputs, "pack") is None
    assert capsys.readouterr().out == (f"[pack] {tmp_path}: its inputs (the output records none) changed; the "
                                       "stage reruns\n")


def test_pack_memory_follows_the_largest_document_and_a_killed_task_never_reruns_with_the_same_memory():
    from huginn_ray.data.execution import KilledTaskError, memory_after_kill
    from huginn_ray.data.tokenize_pack import pack_task_memory

    # 256 MiB + 24 B x 4,096 documents of 1,000 characters + 180 B x the largest document's 2 M characters
    assert pack_task_memory(4096, 1000.0, 2_000_000) == 268_435_456 + 98_304_000 + 360_000_000
    assert pack_task_memory(4096, 1000.0, 20_000_000) - pack_task_memory(4096, 1000.0, 2_000_000) == 3_240_000_000
    gib = 1 << 30
    assert memory_after_kill(300 << 20, 8 * gib, "tokenize_pack") == 600 << 20
    assert memory_after_kill(None, 8 * gib, "staging") == 2 * gib  # declared nothing: taken as UNDECLARED_MEMORY
    assert memory_after_kill(5 * gib, 8 * gib, "tokenize_pack") == 8 * gib  # at most the largest node's
    assert memory_after_kill(5 * gib, 0, "tokenize_pack") == 10 * gib  # the cluster reports no memory
    with pytest.raises(KilledTaskError, match=r"tokenize_pack: a task killed with memory=8.00 GiB, the most a node "
                                              r"offers; a rerun cannot get more"):
        memory_after_kill(8 * gib, 8 * gib, "tokenize_pack")


def test_publish_turns_an_old_shards_directory_into_a_version_and_a_crash_between_renames_is_finished(
        tmp_path, monkeypatch, capsys):
    from huginn_ray.data import layout

    pointer = tmp_path / "shards"
    pointer.mkdir()
    (pointer / "manifest.json").write_text("published before versions")
    new = tmp_path / "new"
    new.mkdir()
    (new / "manifest.json").write_text("new")
    assert layout.publish_version(new, pointer) == tmp_path / "shards.v0002"
    assert pointer.readlink() == Path("shards.v0002") and (pointer / "manifest.json").read_text() == "new"
    assert (tmp_path / "shards.v0001" / "manifest.json").read_text() == "published before versions"

    # a crash after the version's rename, before the pointer's: the rerun's finish_publish moves the pointer
    newer = tmp_path / "newer"
    newer.mkdir()
    monkeypatch.setattr(layout, "_point", lambda pointer, version: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        layout.publish_version(newer, pointer)
    monkeypatch.undo()
    assert pointer.readlink() == Path("shards.v0002") and (tmp_path / "shards.v0003").is_dir()
    capsys.readouterr()
    layout.finish_publish(pointer)
    assert pointer.readlink() == Path("shards.v0003")
    assert capsys.readouterr().out.startswith(f"[recover] {tmp_path / 'shards.v0003'} was published but {pointer} "
                                              "still names shards.v0002")
    layout.finish_publish(pointer)  # nothing left to do
    assert capsys.readouterr().out == ""
    # a dead run's temporary pointer is removed with the other stale temporaries
    (tmp_path / "shards.link-999999999").symlink_to("shards.v0003")
    layout.clean_stale(pointer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards", "shards.v0001", "shards.v0002", "shards.v0003"]
    assert [p.name for p in layout.remove_old_versions(pointer)] == ["shards.v0001", "shards.v0002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards", "shards.v0003"]


def test_last_run_stats_keep_the_peak_of_a_split_made_per_file_ahead_of_the_run(tmp_path, monkeypatch):
    """The released data's train split made per file by per_file_shards, then write_shards (the val split, the
    train shards kept): the run's figures hold the largest peak RSS of both, the train split's included; a second
    run of the same work whose tasks all ran before reports none of the first's."""
    from huginn_ray.data import shard_build

    peaks = {"train": 900.0, "val": 300.0}

    def per_file_split(split, method, files, work, **settings):  # the tasks' pass: shards committed, peak reported
        out = work / "out" / split
        todo = [r for r in range(2) if not (out / f"{r:05d}.parquet").exists()]
        for r in todo:
            (out / f"{r:05d}.parquet").write_bytes(b"shard")
        return [], peaks[split] if todo else None

    monkeypatch.setattr(shard_build, "per_file_split", per_file_split)
    monkeypatch.setattr(shard_build, "publish", lambda work, shard_root, manifest: None)
    files = [{"path": f"{i}.parquet", "rel": f"{i}.parquet", "train_rows": 4, "val_rows": 4} for i in range(2)]
    settings = dict(row_len=9, token_dtype="uint16", vocab_size=100, row_group_size=2, hash_inputs=False)
    work_id = shard_build.shard_work_id("fp", 1, 1, "uint16")

    def run() -> dict:
        shard_build.per_file_shards("train", "hard_link", files, tmp_path / "shards", work_id, "fp", **settings)
        shard_build.write_shards([], {"train": ("hard_link", files), "val": ("hard_link", files)},
                                 shard_root=tmp_path / "shards", num_shards=2, seed=0, reducer_mib=1, map_mib=1,
                                 fingerprint="fp", manifest_extra={}, **settings)
        return dict(shard_build.last_run_stats)

    assert run() == {"max_task_peak_rss_mib": 900.0}
    assert run() == {}  # every shard kept: no task ran


def test_plan_counts_the_filter_stage_bytes_tasks_memory_and_ngram_set_exactly(tmp_path, capsys):
    """`--plan` of a small config with decontaminate (drop, the GSM8k sample) and dedup exact, no tokenizer (so
    the stated DEFAULTS: 1 text byte per jsonl byte, staged 0.5 byte per text byte, 4,096 text bytes per document):
    the filter stage's reads and writes, disk, tasks, the dedup task's memory and the n-gram set, each exact; with
    mode report and no dedup nothing is rewritten; with both off the plan has no filter stage."""
    import importlib.util

    from huginn_ray.data.decontaminate import normalise

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("prepare_data", root / "jobs" / "prepare_data.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    sizes = {"web/a.jsonl": 40960, "web/b.jsonl": 20480, "code/c.jsonl": 12288}
    for rel, size in sizes.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text('{"text": "' + "a" * (size - 13) + '"}\n')
        assert (tmp_path / rel).stat().st_size == size
    (tmp_path / "sources.yaml").write_text("- {name: web, local_dir: web, features: [text]}\n"
                                           "- {name: code, local_dir: code, features: [text]}\n"
                                           "- {name: unused, local_dir: code, features: [text], weight: 0}\n")
    gsm8k = root / "configs" / "eval" / "gsm8k_test_sample.jsonl"
    config = tmp_path / "data.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\nsources: sources.yaml\nseq_len: 255\nnum_shards: 2\n"
                      f"tokenizer: {{path: {tmp_path / 'no_tokenizer'}}}\nlocal_ray: {{num_cpus: 2}}\n"
                      f"decontaminate: {{mode: drop, ngram: 13, against: [{gsm8k}]}}\ndedup: exact\n")

    def plan(*overrides: str) -> dict:
        capsys.readouterr()
        assert job.main(["--config", str(config), "--plan", "--json", *overrides]) == 0
        return json.loads(capsys.readouterr().out)

    p = plan()
    docs = 73728 / 4096  # 18 documents in 3 staged files (the weight-0 source is neither staged nor filtered)
    staged = 73728 * 0.5
    tables = 16 * docs + 128 * 3  # doc_scan: (hash, row) per document + an npy header per scan unit (one a file)
    keys = 8 * docs + 128 * 1  # doc_dedup: at most every document's key, one bucket
    items = [json.loads(line)["question"] for line in gsm8k.read_text().splitlines()]  # a plain path: its questions
    grams = sum(max(1, len(normalise(t)) - 12) for t in items)
    assert (grams, len(items)) == (89, 4)
    ngram_file = 16 * grams + 128
    assert p["filter"] == {
        "documents": 18, "staged_bytes": 36864, "rewritten_bytes": 36864, "hash_table_bytes": int(tables),
        "duplicate_key_bytes": int(keys),
        "ngram_set": {"built_on": "driver, before any stage (pipeline.eval_ngrams); saved as ngrams.npy in the "
                                  "filter stage's directory, loaded from it by each scan task",
                      "tasks_at_once": 1, "grams": 89, "items": 4, "file_bytes": ngram_file,
                      "bytes_per_task": 89 * 12, "load_peak_bytes_per_task": 89 * 28,
                      "eval_sets": [str(gsm8k)]}}
    assert p["io_bytes"]["filter"] == {"read": int(staged + tables + keys + staged),
                                       "written": int(tables + keys + staged + ngram_file)}
    assert p["io_bytes"]["pack"]["read"] == 36864  # the filtered files hold the staged documents that remain
    disk = p["disk_after_stage_bytes"]
    assert set(disk) == {"download", "staging", "filter", "pack", "shuffle"}
    assert disk["filter"] == int(staged + staged + ngram_file + tables + keys)
    assert disk["pack"] - int(staged + staged + ngram_file) == int(p["io_bytes"]["pack"]["written"])
    # one scan unit per file (each far below SCAN_UNIT_DOCS documents), the three grouped into one read
    assert {k: p["counts"][k] for k in ("scan_units", "scan_tasks", "dedup_tasks", "filter_tasks")} == {
        "scan_units": 3, "scan_tasks": 1, "dedup_tasks": 1, "filter_tasks": 3}
    assert p["memory_per_task_bytes"]["dedup_task"] == 256 * 2**20 + 48 * 18
    assert set(p["estimated_seconds"]) == {"download", "staging", "filter", "pack", "shuffle"}

    report = plan("decontaminate.mode=report", "dedup=none")  # nothing dropped: every filtered file a hard link
    assert report["filter"]["rewritten_bytes"] == report["filter"]["duplicate_key_bytes"] == 0
    assert report["io_bytes"]["filter"] == {"read": 36864, "written": int(tables + ngram_file)}
    assert "dedup_task" not in report["memory_per_task_bytes"] and report["counts"]["dedup_tasks"] == 0
    near = plan("dedup=near")  # exact then near: the exact buckets as above, and the signatures' buckets
    from huginn_ray.data.doc_near_dedup import near_dedup_plan
    signatures = near_dedup_plan(18, 3, bands=14, rows=8)
    assert near["filter"]["near_signature_bytes"] == signatures.scan_bytes_written == 672 * 18 + 2 * 128 * 3
    assert near["counts"]["near_pairs_tasks"] == signatures.buckets == 1 and near["counts"]["dedup_tasks"] == 1
    assert near["memory_per_task_bytes"]["near_pairs_task"] == signatures.bucket_task_memory
    assert near["counts"]["ray_tasks"] == p["counts"]["ray_tasks"] + 1
    assert near["disk_after_stage_bytes"]["filter"] == disk["filter"] + signatures.scan_bytes_written
    off = plan("decontaminate.mode=none", "dedup=none")
    assert off["filter"] is None and "filter" not in off["io_bytes"] and "filter" not in off["disk_after_stage_bytes"]
    assert off["counts"]["ray_tasks"] == p["counts"]["ray_tasks"] - (1 + 1 + 3)
    assert job.main(["--config", str(config), "--plan"]) == 0  # the table names the filter stage
    assert ("filter: scans 18 documents (36.00 KiB staged; scan units: 3, reads: 1), rewrites at most 36.00 KiB; hash "
            "tables 672 B, duplicate keys at most 272 B; n-gram set 89 grams of 4 items (1.52 KiB file; 1.04 KiB per "
            "scan task, tasks at once: 1, 2.43 KiB while loading), built on the driver") in capsys.readouterr().out


def test_plan_counts_the_scan_units_and_reads_that_the_filter_stage_builds(tmp_path, monkeypatch, capsys):
    """A staged file of more documents than a scan unit holds is several units, and consecutive small units share
    one read: the plan's `scan_units` / `scan_tasks` are exactly the units and reads doc_filter builds
    (`scan_units`, `scan_reads`) from the staging markers of the same files. Documents of 4,096 input bytes (the
    plan's DEFAULTS without a tokenizer) make the plan's estimate each file's real count; SCAN_UNIT_DOCS is 4 here
    so that a 10-document file splits."""
    import importlib.util

    from huginn_ray.data import doc_filter
    from huginn_ray.data.formatting import iter_documents
    from huginn_ray.data.staging import list_local_files

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("prepare_data", root / "jobs" / "prepare_data.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    monkeypatch.setattr(doc_filter, "SCAN_UNIT_DOCS", 4)
    line = '{"text": "' + "a" * (4096 - 13) + '"}\n'
    for rel, docs in {"web/a.jsonl": 10, "web/b.jsonl": 1, "code/c.jsonl": 1, "code/d.jsonl": 1,
                      "code/e.jsonl": 3}.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(line * docs)
    (tmp_path / "sources.yaml").write_text("- {name: web, local_dir: web, features: [text]}\n"
                                           "- {name: code, local_dir: code, features: [text]}\n")
    (tmp_path / "data.yaml").write_text(
        f"output_dir: {tmp_path / 'out'}\nsources: sources.yaml\nseq_len: 255\nnum_shards: 2\n"
        f"tokenizer: {{path: {tmp_path / 'no_tokenizer'}}}\nlocal_ray: {{num_cpus: 2}}\ndedup: exact\n")
    capsys.readouterr()
    assert job.main(["--config", str(tmp_path / "data.yaml"), "--plan", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)

    # what staging records of these files (rows and characters per file), and the units doc_filter builds from it
    files, markers = [], {}
    for source in (Source(name="web", local_dir=str(tmp_path / "web"), features=["text"]),
                   Source(name="code", local_dir=str(tmp_path / "code"), features=["text"])):
        texts = [[t for batch in iter_documents(path, source) for t in batch.texts]
                 for path in list_local_files(source)]
        markers[source.name] = {"rows": sum(map(len, texts)), "chars": sum(len(t) for ts in texts for t in ts)}
        files += [(source, {"rows": len(ts), "output": f"{i:05d}.parquet"}) for i, ts in enumerate(texts)]
    units = doc_filter.scan_units(files, markers, tmp_path / "staging")
    reads = doc_filter.scan_reads(units)
    # a.jsonl: 4 + 4 + 2 documents; b, c, d, e one unit each; reads of at most 4 documents:
    # [a 4] [a 4] [a 2, b, c] [d, e 3]
    assert [[(u["file"], u["start"], u["count"]) for u in read] for read in reads] == [
        [(0, 0, 4)], [(0, 4, 4)], [(0, 8, 2), (1, 0, 1), (2, 0, 1)], [(3, 0, 1), (4, 0, 3)]]
    assert {k: planned["counts"][k] for k in ("staged_files", "scan_units", "scan_tasks")} == {
        "staged_files": 5, "scan_units": len(units), "scan_tasks": len(reads)} == {
        "staged_files": 5, "scan_units": 7, "scan_tasks": 4}
    assert planned["filter"]["hash_table_bytes"] == 16 * 16 + 128 * 7  # an npy header per scan unit

    # the pack stage, batches of 4 documents: its batches (one packed file each) and read tasks are those
    # tokenize_pack builds (pack_batches, read_units) from the same staging markers
    from huginn_ray.data.tokenize_pack import pack_batches, read_units

    assert job.main(["--config", str(tmp_path / "data.yaml"), "--plan", "--json", "docs_per_pack_batch=4"]) == 0
    planned = json.loads(capsys.readouterr().out)
    sources = [files[0][0], files[2][0]]  # web (a, b), code (c, d, e)
    staged = {source.name: {"files": [{"output": f["output"], "rows": f["rows"], "max_chars": 0}
                                      for t, f in files if t is source]} for source in sources}
    batches = pack_batches(sources, tmp_path / "staging", staged, 4)
    assert [b["count"] for b in batches] == [4, 4, 2, 1, 1, 1, 3]
    assert {k: planned["counts"][k] for k in ("pack_batches", "pack_tasks")} == {
        "pack_batches": len(batches), "pack_tasks": len(read_units(batches, 4))} == {"pack_batches": 7,
                                                                                      "pack_tasks": 4}

def _shingle_set(text: str, n: int = 5) -> set:
    import re

    words = re.findall(r"[a-z0-9\x80-\U0010ffff]+", text.lower())
    return {tuple(words[i:i + n]) for i in range(max(1, len(words) - n + 1))}


def _near_corpus():
    """200 documents of 300 words, copies of the first 100 with a line added and 3 words (1 %) changed, and 40
    distinct documents that share one 60-word boilerplate paragraph."""
    import random

    rng = random.Random(4)
    vocab = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 8))) for _ in range(20_000)]
    originals = [" ".join(rng.choices(vocab, k=300)) for _ in range(200)]
    copies = []
    for text in originals[:100]:
        words = text.split()
        for i in rng.sample(range(len(words)), 3):
            words[i] = rng.choice(vocab)
        copies.append(" ".join(words) + "\nSee also: " + " ".join(rng.choices(vocab, k=8)) + ".")
    boilerplate = " ".join(rng.choices(vocab, k=60))
    shared = [f"{' '.join(rng.choices(vocab, k=120))}\n\n{boilerplate}" for _ in range(40)]
    return originals, copies, shared


def test_near_duplicates_are_removed_and_documents_sharing_boilerplate_are_kept():
    """Copies with a line added and 1 % of their words changed (5-shingle Jaccard >= 0.8 with their original) are
    found by MinHash LSH with the default 14 x 8 bands (at least 95 %: here all, the S-curve gives 99.6 % at 0.87)
    and dropped in favour of the original (the smaller key); distinct documents sharing a boilerplate paragraph and
    the other originals are all kept."""
    from huginn_ray.data.near_dedup import (MinHashParams, band_keys, band_table, candidate_pairs, component_drops,
                                            minhash_signatures, similar)

    originals, copies, shared = _near_corpus()
    texts = originals + copies + shared
    assert min(len(_shingle_set(a) & _shingle_set(b)) / len(_shingle_set(a) | _shingle_set(b))
               for a, b in zip(originals, copies)) >= 0.8
    params = MinHashParams.make(5, 14, 8, seed=1)
    signatures, has = minhash_signatures(texts, params)
    assert signatures.shape == (340, 112) and has.all()
    table = band_table(band_keys(signatures, 14, 8), has)
    first, other = candidate_pairs(table[:, 0], table[:, 1])
    keep = similar(signatures[first.astype(np.int64)], signatures[other.astype(np.int64)], 0.8)
    dropped, kept = component_drops(first[keep], other[keep])
    copy_keys = np.arange(200, 300)
    assert np.isin(copy_keys, dropped).mean() >= 0.95
    assert set(dropped.tolist()) <= set(copy_keys.tolist())  # no original, no boilerplate document
    assert (kept == dropped - 200).all()  # each copy's kept document is its original


def test_minhash_words_ignore_case_and_punctuation_and_components_keep_the_smallest_key():
    """Words are runs of letters and digits, lower-cased; shingle order matters; a text of no word has no signature
    and fewer words than a shingle make one shingle; the components of chained pairs drop all but the smallest key."""
    from huginn_ray.data.near_dedup import MinHashParams, component_drops, minhash_signatures

    params = MinHashParams.make(5, 2, 4, seed=0)
    signatures, has = minhash_signatures(["Hello, World!  again", "hello world again", "again world hello", "...",
                                          ""], params)
    assert (signatures[0] == signatures[1]).all() and not (signatures[0] == signatures[2]).all()
    assert has.tolist() == [True, True, True, False, False]
    again, _ = minhash_signatures(["hello world again"], MinHashParams.make(5, 2, 4, seed=0))
    assert (again[0] == signatures[1]).all()  # no state between calls: a batch's signatures are the text's own
    pairs = np.array([[5, 9], [2, 9], [7, 8], [1, 3]], np.uint64)
    dropped, kept = component_drops(pairs[:, 0], pairs[:, 1])
    assert dropped.tolist() == [3, 5, 8, 9] and kept.tolist() == [1, 2, 7, 2]


def test_a_source_is_committed_when_its_own_files_are_staged_while_another_still_runs(tmp_path, monkeypatch):
    """stage_sources commits a source's marker as soon as its files are staged: here while the dataset still runs
    the other source's file, which then fails; the finished source stays committed (a rerun skips it)."""
    import time

    import pyarrow as pa
    import pyarrow.parquet as pq

    from huginn_ray.data import staging
    from huginn_ray.data.formatting import DataError

    for name in ("done", "broken"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.jsonl").write_text('{"text": "x"}\n')
    sources = parse_sources(parse_yaml(f"- {{name: done, local_dir: {tmp_path / 'done'}, features: [text]}}\n"
                            f"- {{name: broken, local_dir: {tmp_path / 'broken'}, features: [text]}}\n"), "sources.yaml")
    seen = {}

    def run_staging(files, todo, results):  # the dataset: stages `done`, then fails on `broken` once it is committed
        stats = {"rows": 1, "chars": 1, "max_chars": 1, "read": 1, "empty": 0, "quarantined": {}, "first_bad": None}
        done = next(f for f in files if f["source"].name == "done")
        table = pa.table({"text": ["x"], "source": ["done"], "doc_id": [0]}, schema=staging.STAGING_SCHEMA)
        pq.write_table(table.replace_schema_metadata({staging.STATS_KEY: json.dumps(stats)}), done["output"])
        deadline = time.monotonic() + 30
        while not (tmp_path / "staging" / "done" / "_COMPLETE.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["committed while running"] = (tmp_path / "staging" / "done" / "_COMPLETE.json").exists()
        raise DataError("broken: a bad record")

    monkeypatch.setattr(staging, "run_staging", run_staging)
    monkeypatch.setattr(staging, "POLL_S", 0.05)
    with pytest.raises(DataError, match="broken: a bad record"):
        staging.stage_sources([(s, staging.list_local_files(s)) for s in sources], tmp_path / "staging")
    assert seen == {"committed while running": True}
    marker = json.loads((tmp_path / "staging" / "done" / "_COMPLETE.json").read_text())
    assert marker["rows"] == 1 and marker["files"][0]["output"] == "00000.parquet"
    assert not (tmp_path / "staging" / "broken").exists()


def test_near_dedup_plan_counts_buckets_bytes_and_task_memory():
    """What `dedup: near` adds to the plan: 14 band entries per document in buckets of DOCS_PER_BUCKET entries,
    4 x 112 + 16 x 14 bytes per document written by the scan (+ two npy headers per unit), the bucket task's
    memory as exact dedup's per entry."""
    from huginn_ray.data.doc_dedup import DOCS_PER_BUCKET
    from huginn_ray.data.doc_near_dedup import near_dedup_plan

    small = near_dedup_plan(1000, 3, bands=14, rows=8)
    assert (small.buckets, small.scan_bytes_written, small.bucket_task_memory) == (
        1, 672 * 1000 + 2 * 128 * 3, 256 * 2**20 + 48 * 14_000)
    large = near_dedup_plan(DOCS_PER_BUCKET, 1, bands=14, rows=8)
    assert large.buckets == 14 and large.bucket_task_memory == 256 * 2**20 + 48 * DOCS_PER_BUCKET
