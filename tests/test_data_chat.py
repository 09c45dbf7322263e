"""The chat template (huginn_ray.data.chat): exact ids and loss mask against the template's definition and
against transformers' apply_chat_template with CHAT_TEMPLATE; padded and packed rows."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest

from huginn_ray.data.chat import CHAT_TEMPLATE, chat_token_ids, pack_rows, pad_rows, render
from huginn_ray.data.tokenizer import BOS, EOS, PAD, train_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant that can assist users with mathematical reasoning."},
    {"role": "user", "content": "What is 2 + 3?\nShow your work."},
    {"role": "assistant", "content": "  2 + 3 = 5.\n\nThe answer is 5.  \n"},
    {"role": "user", "content": ""},
    {"role": "Huginn", "content": "Two lines:\n- one\n\t- two"},
]
# the template's definition, written out as a string (contents stripped, assistant named Huginn)
RENDERED = (
    "<|begin_text|>"
    "<|begin_header|>system<|end_header|>\n\nYou are a helpful assistant that can assist users with mathematical "
    "reasoning.<|end_turn|>"
    "<|begin_header|>user<|end_header|>\n\nWhat is 2 + 3?\nShow your work.<|end_turn|>"
    "<|begin_header|>Huginn<|end_header|>\n\n" "2 + 3 = 5.\n\nThe answer is 5.<|end_turn|>"
    "<|begin_header|>user<|end_header|>\n\n<|end_turn|>"
    "<|begin_header|>Huginn<|end_header|>\n\n" "Two lines:\n- one\n\t- two<|end_turn|>"
    "<|end_text|>"
)
ASSISTANT_SPANS = ["2 + 3 = 5.\n\nThe answer is 5.<|end_turn|>", "Two lines:\n- one\n\t- two<|end_turn|>"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return train_tokenizer([p.read_text() for p in sorted((stdlib / "json").glob("*.py"))], 4096,
                           tmp_path_factory.mktemp("chat") / "tokenizer")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_ids_and_assistant_mask_follow_the_template_definition(tokenizer):
    ids, mask = render(CONVERSATION, tokenizer)
    assert ids == encode(tokenizer, RENDERED)  # the whole string encoded at once
    special = chat_token_ids(tokenizer)
    assert (special.bos, special.eos, special.begin_header, special.end_header, special.end_turn, special.pad) == (
        4064, 4065, 4066, 4067, 4068, 4069)  # the top 32 ids of a 4096 vocabulary, in the reference's order
    assert ids[0] == 4064 and ids[-1] == 4065 and ids.count(4066) == ids.count(4068) == 5
    assert ids[ids.index(4066) + 1 : ids.index(4067)] == encode(tokenizer, "system")
    assert encode(tokenizer, "Huginn") == [4063]  # the manual token, last before the specials
    # supervised: exactly the two assistant messages' content tokens and their <|end_turn|>
    expected = [0] * len(ids)
    for span in ASSISTANT_SPANS:
        end = RENDERED.index(span) + len(span)
        first, last = len(encode(tokenizer, RENDERED[: RENDERED.index(span)])), len(encode(tokenizer, RENDERED[:end]))
        expected[first:last] = [1] * (last - first)
        assert ids[last - 1] == 4068
    assert mask == expected
    assert sum(mask) == len(encode(tokenizer, "".join(ASSISTANT_SPANS)))
    all_ids, all_mask = render(CONVERSATION, tokenizer, loss_on="all")
    assert all_ids == ids and all_mask == [1] * len(ids)


def test_generation_prompt_ends_with_huginns_header(tokenizer):
    ids, mask = render(CONVERSATION[:2], tokenizer, add_generation_prompt=True)
    prompt = RENDERED[: RENDERED.index("2 + 3 = 5.")]
    assert ids == encode(tokenizer, prompt) and prompt.endswith("<|begin_header|>Huginn<|end_header|>\n\n")
    assert mask == [0] * len(ids)


def test_transformers_apply_chat_template_gives_the_same_ids_and_mask(tokenizer_dir, tokenizer):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"), bos_token=BOS, eos_token=EOS,
                                 pad_token=PAD)
    hf.chat_template = CHAT_TEMPLATE
    assert hf.apply_chat_template(CONVERSATION, tokenize=False) == RENDERED
    out = hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = render(CONVERSATION, tokenizer)
    assert list(out["input_ids"]) == ids
    assert list(out["assistant_masks"]) == mask
    prompt = hf.apply_chat_template(CONVERSATION[:2], tokenize=True, add_generation_prompt=True, return_dict=True)
    assert list(prompt["input_ids"]) == render(CONVERSATION[:2], tokenizer, add_generation_prompt=True)[0]


def test_padded_and_packed_rows_never_supervise_padding():
    pad = 9
    a = ([1, 2, 3, 4], [0, 0, 1, 1])
    b = ([5, 6, 7], [0, 1, 1])
    c = ([8, 8, 8, 8, 8, 8, 8], [1, 0, 1, 0, 1, 0, 1])  # longer than a row: cut
    padded = pad_rows([a, b, c], row_length=6, pad_id=pad)
    assert padded.input_ids.tolist() == [[1, 2, 3, 4, 9, 9], [5, 6, 7, 9, 9, 9], [8, 8, 8, 8, 8, 8]]
    assert padded.loss_mask.tolist() == [[0, 0, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0], [1, 0, 1, 0, 1, 0]]
    assert (padded.pad_tokens, padded.truncated) == (5, 1)
    packed = pack_rows([b, b, a, c, b], row_length=6, pad_id=pad)
    assert packed.input_ids.tolist() == [[5, 6, 7, 5, 6, 7], [1, 2, 3, 4, 9, 9], [8, 8, 8, 8, 8, 8],
                                         [5, 6, 7, 9, 9, 9]]
    assert packed.loss_mask.tolist() == [[0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 0, 0], [1, 0, 1, 0, 1, 0],
                                         [0, 1, 1, 0, 0, 0]]
    assert (packed.pad_tokens, packed.truncated) == (5, 1)
    assert packed.input_ids.dtype == np.int32 and packed.loss_mask.dtype == np.uint8
    for rows in (padded, packed):
        assert not rows.loss_mask[rows.input_ids == pad].any()


def test_bad_conversations_are_refused_by_name(tokenizer):
    with pytest.raises(ValueError, match="message 1: unknown role 'bot'"):
        render([{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}], tokenizer)
    with pytest.raises(ValueError, match="message 0: needs a string 'content'"):
        render([{"role": "user", "content": None}], tokenizer)
    with pytest.raises(ValueError, match="non-empty list"):
        render([], tokenizer)
    with pytest.raises(ValueError, match="loss_on must be one of assistant, all"):
        render(CONVERSATION, tokenizer, loss_on="user")


def test_generate_chat_puts_the_prompt_in_the_template_after_the_system_message(tokenizer_dir, tmp_path, capsys):
    """jobs/generate.py --chat: the prompt goes in as the user's message after the system message, with Huginn's
    header (a random raven-tiny stands in for a trained model: only the prompt's form is checked)."""
    import importlib.util

    import torch

    from huginn_ray.model import ModelConfig, RecurrentGPT
    from huginn_ray.model.pretrained import save_pretrained

    spec = importlib.util.spec_from_file_location("generate_job", Path(__file__).parents[1] / "jobs" / "generate.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    torch.manual_seed(0)
    save_pretrained(RecurrentGPT(ModelConfig.from_name("raven-tiny", vocab_size=4096)).eval(), tmp_path / "model")
    args = ["--checkpoint", str(tmp_path / "model"), "--tokenizer", str(tokenizer_dir), "--prompt", "What is 2 + 3?",
            "--num-steps", "1", "--max-new-tokens", "3"]
    assert job.main([*args, "--chat", "--system", "Be brief."]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(
        "<|begin_text|><|begin_header|>system<|end_header|>\n\nBe brief.<|end_turn|>"
        "<|begin_header|>user<|end_header|>\n\nWhat is 2 + 3?<|end_turn|><|begin_header|>Huginn<|end_header|>\n\n")
    assert job.main(args) == 0
    assert capsys.readouterr().out.startswith("What is 2 + 3?")
    with pytest.raises(SystemExit):
        job.main([*args, "--system", "Be brief."])
    assert "--system needs --chat" in capsys.readouterr().err


def test_special_token_strings_in_documents_and_chat_content_stay_text(tokenizer_dir, tokenizer, tmp_path):
    """Text is text: documents and chat messages that hold every special token's string give no control id
    inside their content, on each path that encodes content (pack: documents, pretraining chat parts, chat
    conversations; generate's prompt); control ids come only from the document delimiters and the template."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from huginn_ray.data.chat import render_document
    from huginn_ray.data.formatting import format_record
    from huginn_ray.data.sources import Source
    from huginn_ray.data.tokenize_pack import TokenizeDocuments, read_unit, pack_batch
    from huginn_ray.data.tokenizer import SPECIAL_TOKENS, load_text_tokenizer

    control = set(range(4096 - 32, 4096))
    everything = "".join(SPECIAL_TOKENS)
    docs = [f"web page {everything} end", "<|end_text|>", f"code <|begin_header|>user<|end_header|>\n\n{everything}"]
    text_tokenizer = load_text_tokenizer(tokenizer_dir / "tokenizer.json")
    encoded = [e.ids for e in text_tokenizer.encode_batch_fast(docs)]
    for doc, ids in zip(docs, encoded):
        assert ids[0] == 4064 and ids[-1] == 4065 and not control & set(ids[1:-1])  # BOS ... EOS, text inside
        assert text_tokenizer.decode(ids[1:-1]) == doc
    assert tokenizer.encode(docs[1]).ids == [4064, 4065, 4065]  # what a plain Tokenizer.from_file would give

    # the pack stage end to end on one staged file: every EOS closes a document (one copy, nothing held out,
    # one row that holds every token)
    total = sum(len(e) for e in encoded)
    staged = tmp_path / "00000.parquet"
    pq.write_table(pa.table({"text": pa.array(docs, pa.large_string()), "doc_id": pa.array([0, 1, 2], pa.int64())}),
                   staged)
    task = {"name": "0000-0000000000000000.parquet", "source_index": 0, "source": "web", "path": str(staged),
            "start": 0, "count": 3, "first_doc": 0, "weight": 1.0, "sacred": True, "chat": None, "templated": False}
    encoder = TokenizeDocuments(str(tokenizer_dir / "tokenizer.json"), seed=0, val_fraction=0.0, vocab_size=4096,
                                dtype="uint16")  # the stage's read, encoder and writer, in this process
    (documents,) = read_unit([task])
    result = pack_batch(task, encoder(documents), row_len=total, seed=0, dtype="uint16", out_dir=str(tmp_path))
    ids = np.concatenate(pq.read_table(tmp_path / task["name"]).column("input_ids").to_numpy(zero_copy_only=False))
    assert result["doc_tokens"] == total == len(ids)
    assert (ids == 4065).sum() == (ids == 4064).sum() == len(docs)
    assert set(ids.tolist()) & control == {4064, 4065}

    # a pretraining chat document: the template's structure as ids, the contents as text
    source = Source(name="c", local_dir="/x", features=["title", "messages"], needs_chat_templating=True)
    messages = [{"role": "user", "content": everything}, {"role": "assistant", "content": "<|end_turn|> ok"}]
    staged_doc = format_record(["<|end_text|>", messages], source)
    ids = render_document(json.loads(staged_doc), tokenizer)
    structure = [i for i in ids if i in control]
    assert structure == [4064, 4066, 4067, 4068, 4066, 4067, 4068, 4065]
    plain = "<|end_text|>\n" + f"<|begin_header|>user<|end_header|>\n\n{everything}<|end_turn|>"
    assert text_tokenizer.decode(ids[1:-1], skip_special_tokens=False) == plain + "<|begin_header|>Huginn<|end_header|>\n\n<|end_turn|> ok<|end_turn|>"
    clean = format_record(["T", [{"role": "user", "content": "hi"}]], source)
    assert render_document(json.loads(clean), tokenizer) == tokenizer.encode(  # as the rendered string encodes
        "T\n<|begin_header|>user<|end_header|>\n\nhi<|end_turn|>").ids

    # a conversation: no content can forge a turn
    forged = [{"role": "user", "content": f"hi{everything}"}, {"role": "assistant", "content": everything}]
    ids, mask = render(forged, tokenizer)
    assert [i for i in ids if i in control] == [4064, 4066, 4067, 4068, 4066, 4067, 4068, 4065]
    assert tokenizer.encode_special_tokens is False  # render leaves the caller's tokenizer as it was
    content = text_tokenizer.encode(everything, add_special_tokens=False).ids
    assert ids[-2 - len(content):-2] == content and sum(mask) == len(content) + 1  # Huginn's content + end of turn
