"""The trained tokenizer: special-token layout, BOS/EOS wrapping, exact round trips, loading by both libraries."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from huginn_ray.data.tokenizer import (SPECIAL_TOKENS, check_tokenizer_fits, manual_tokens, special_token_ids,
                                       train_tokenizer)

ROUND_TRIPS = [
    "def f(x):\n    return {'a': x ** 2}  # comment\n",
    "tabs\tand    runs     of spaces\n\n\n\nand blank lines",
    "windows\r\nline\r\nendings\r\n",
    "emoji 🦭😀🚀 and ZWJ 👩‍💻",
    "中文文本和日本語のテキスト、한국어",
    r"$\frac{a}{b} + \sqrt{x^2} \nabla \cdot \newcommand{\R}{\mathbb{R}}$",
    "control \x00\x01\x7f chars and a lone combining mark \u0301 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "",
]


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text() for p in sorted((stdlib / "json").glob("*.py"))] + ROUND_TRIPS * 3


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return train_tokenizer(_corpus(), 4096, tmp_path_factory.mktemp("tok") / "tokenizer")


def test_special_tokens_take_the_top_32_ids_in_order(small):
    tok = Tokenizer.from_file(str(small / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 4096
    for offset, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == 4096 - 32 + offset
    assert special_token_ids(small) == {"bos": 4064, "eos": 4065, "pad": 4069, "vocab_size": 4096}


def test_full_vocabulary_places_specials_like_the_released_tokenizer(tmp_path):
    out = train_tokenizer(_corpus(), 65536, tmp_path / "tok65k")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS[:6]}
    assert ids == {"<|begin_text|>": 65504, "<|end_text|>": 65505, "<|begin_header|>": 65506,
                   "<|end_header|>": 65507, "<|end_turn|>": 65508, "<|pad|>": 65509}
    assert max(tok.get_vocab(with_added_tokens=True).values()) == 65535
    assert tok.token_to_id("Huginn") is not None  # a manual token is in the vocabulary
    (snowman,) = tok.encode("☃", add_special_tokens=False).ids  # a manual token absent from the corpus
    assert tok.decode([snowman]) == "☃" and snowman >= 65504 - len(manual_tokens())


def test_manual_token_list():
    tokens = manual_tokens()
    assert tokens[:6] == ['"""', "'''", '"', "''", 'f"', "f'"]
    assert " " * 16 in tokens and "\t" * 16 in tokens and "\n" * 16 in tokens
    assert tokens[-1] == "Huginn" and "\U0001F9AD" in tokens and "∀" in tokens
    assert len(tokens) - len(set(tokens)) == 5  # like the reference: 5 duplicates become placeholders


@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_exact_round_trip_and_document_wrapping(small, text):
    tok = Tokenizer.from_file(str(small / "tokenizer.json"))
    ids = tok.encode(text).ids
    assert ids[0] == 4064 and ids[-1] == 4065
    assert tok.decode(ids, skip_special_tokens=True).encode() == text.encode()
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_special_token_text_in_data_maps_to_special_ids(small):
    tok = Tokenizer.from_file(str(small / "tokenizer.json"))
    ids = tok.encode("<|begin_header|>user<|end_header|>\n\nhi<|end_turn|>", add_special_tokens=False).ids
    assert ids[0] == 4066 and 4067 in ids and ids[-1] == 4068


def test_transformers_loads_it_with_the_same_ids(small):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(small))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(small / "tokenizer.json"))
    tok = Tokenizer.from_file(str(small / "tokenizer.json"))
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (4064, 4065, 4069)
    for text in ROUND_TRIPS:
        assert hf(text)["input_ids"] == tok.encode(text).ids == fast(text)["input_ids"]
        assert hf.decode(hf(text)["input_ids"], skip_special_tokens=True) == text
    config = json.loads((small / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|begin_text|>" and config["pad_token"] == "<|pad|>"


def test_check_tokenizer_fits(small, tmp_path):
    assert check_tokenizer_fits(small, 4096) == 4096
    assert check_tokenizer_fits(small / "tokenizer.json", 65536) == 4096
    with pytest.raises(ValueError) as err:
        check_tokenizer_fits(small, 4000)
    assert "4096" in str(err.value) and "4000" in str(err.value) and "tokenizer.json" in str(err.value)
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=str(broken)):
        check_tokenizer_fits(broken, 4096)


def test_vocab_too_small_for_the_manual_tokens_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab_size 1024 is too small"):
        train_tokenizer(["some text"], 1024, tmp_path / "tok")


def test_pack_refuses_a_tokenizer_without_document_delimiters(small, tmp_path):
    import json

    from huginn_ray.data.formatting import DataError
    from huginn_ray.data.pipeline import check_document_delimiters

    ids = special_token_ids(small)
    check_document_delimiters(str(small / "tokenizer.json"), ids["bos"], ids["eos"])
    spec = json.loads((small / "tokenizer.json").read_text())
    spec["post_processor"] = None
    bare = tmp_path / "tokenizer.json"
    bare.write_text(json.dumps(spec))
    with pytest.raises(DataError, match=rf"{bare} does not wrap documents in BOS \({ids['bos']}\)"):
        check_document_delimiters(str(bare), ids["bos"], ids["eos"])
