"""The released Huginn-0125 chat template as pure functions: a conversation becomes token ids with a loss mask,
and conversations become fixed-length rows (one per row, padded, or several packed per row).

A conversation renders as the released tokenizer's template renders it (evaluate_raven/checkpoint_to_hf_converter.py
of the original repository; the reference's §6.1 describes the per-message form):

    <|begin_text|>                                   BOS, before the first message only
    <|begin_header|>{role}<|end_header|>\\n\\n{content, stripped}<|end_turn|>    per message
    <|end_text|>                                     EOS after the last message (for training)
    <|begin_header|>Huginn<|end_header|>\\n\\n          instead of EOS, with add_generation_prompt

Roles are `system`, `user` and `assistant`; the assistant is rendered as `Huginn` (a message may also say
`Huginn`). `CHAT_TEMPLATE` is the same template in Jinja, for `transformers`' `apply_chat_template`; the
export writes it into tokenizer_config.json, and its `{% generation %}` block marks exactly the tokens
`loss_on="assistant"` supervises, so `return_assistant_tokens_mask=True` gives the same mask.

Loss mask: `loss_mask[i] = 1` when token i is a training target (the trainer predicts token i from tokens
< i; token 0 of a row is never a target). `loss_on="assistant"` supervises each assistant message's content
tokens and its `<|end_turn|>`, nothing else (not its header, not BOS/EOS); `"all"` supervises every token of
the conversation. Padding (`<|pad|>`) is never supervised.

The functions take a `tokenizers.Tokenizer` (the tokenizer.json of huginn_ray.data.tokenizer or of the release).
Text is text: the template's structure (BOS, headers, end of turn, EOS) is put in as token ids, and every piece
of text (roles, contents, the newlines after a header) is encoded on its own with the tokenizer's special tokens
matched as ordinary text (`encode_text`), so a message that contains `<|begin_header|>` cannot forge a turn.
Since the special tokens split a string before pre-tokenisation, encoding the pieces one by one gives the ids of
encoding the whole rendered string when no content holds a special token's string (tests/test_data_chat.py
holds this against `apply_chat_template`).

Pretraining chat sources (`needs_chat_templating`) are rendered the same way, without a loss mask: staging keeps
such a document as its parts, text and messages (`template_parts`), so that the pack stage knows which text is
structure (`render_document`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from huginn_ray.data.tokenizer import BOS, EOS, PAD

BEGIN_HEADER, END_HEADER, END_TURN = "<|begin_header|>", "<|end_header|>", "<|end_turn|>"
ASSISTANT = "Huginn"
ROLE_NAMES = {"system": "system", "user": "user", "assistant": ASSISTANT, ASSISTANT: ASSISTANT}
"""Accepted message roles and the name each is rendered with."""
LOSS_ON = ("assistant", "all")

# One line: Jinja keeps every character outside its tags, and the released template has no whitespace between turns.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first -%}{{ '" + BOS + "' }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' or message['role'] == '" + ASSISTANT + "' -%}"
    "{{ '" + BEGIN_HEADER + ASSISTANT + END_HEADER + "\n\n' }}"
    "{%- generation -%}{{ message['content'] | trim }}{{ '" + END_TURN + "' }}{%- endgeneration -%}"
    "{%- else -%}"
    "{{ '" + BEGIN_HEADER + "' + message['role'] + '" + END_HEADER + "\n\n' }}"
    "{{ message['content'] | trim }}{{ '" + END_TURN + "' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '" + BEGIN_HEADER + ASSISTANT + END_HEADER + "\n\n' }}"
    "{%- else -%}{{ '" + EOS + "' }}{%- endif -%}"
)
"""The template in Jinja, as `transformers` applies it (`tokenizer_config.json` key `chat_template`)."""


@dataclass(frozen=True)
class ChatTokenIds:
    bos: int
    """<|begin_text|>: once, before the first message."""
    eos: int
    """<|end_text|>: after the last message of a training conversation."""
    pad: int
    """<|pad|>: fills rows; never supervised."""
    begin_header: int
    end_header: int
    end_turn: int
    """<|end_turn|>: closes every message; supervised with an assistant message."""


def chat_token_ids(tokenizer) -> ChatTokenIds:
    """The ids of the template's special tokens; a tokenizer without one of them is refused by name."""
    names = {"bos": BOS, "eos": EOS, "pad": PAD, "begin_header": BEGIN_HEADER, "end_header": END_HEADER,
             "end_turn": END_TURN}
    ids = {field: tokenizer.token_to_id(token) for field, token in names.items()}
    missing = [names[field] for field, value in ids.items() if value is None]
    if missing:
        raise ValueError(f"the tokenizer has no {', '.join(missing)} token, which the chat template needs")
    return ChatTokenIds(**ids)


def check_messages(messages) -> list[tuple[str, str]]:
    """(role name as rendered, content) per message; refuses what the template cannot render, naming the message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"a conversation must be a non-empty list of messages, got {messages!r:.80}")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"message {index}: needs a string 'content' and a 'role', got {message!r:.80}")
        role = message.get("role")
        if role not in ROLE_NAMES:
            raise ValueError(f"message {index}: unknown role {role!r}; known: {', '.join(ROLE_NAMES)}")
        checked.append((ROLE_NAMES[role], message["content"].strip()))
    return checked


def encode_text(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without BOS/EOS, special-token strings encoded as the text they are
    (`tokenizers`' `encode_special_tokens`, set for this call and restored)."""
    previous = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    finally:
        tokenizer.encode_special_tokens = previous


PRETRAINING_ASSISTANT_NAMES = {"gpt", "assistant"}
"""Roles of pretraining chat data rendered as Huginn, as in the reference."""


def template_parts(messages: list) -> list[list[str]]:
    """A pretraining chat feature's messages as document parts, `[role, content]` each (an assistant renamed to
    Huginn, content stripped). Messages use `role`/`content` or `from`/`value`; any role name is kept."""
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"a chat message must be a mapping, got {type(message).__name__}")
        # a null key counts as absent: Arrow's JSON and parquet readers fill the keys a message lacks with null
        role = message.get("role") if message.get("role") is not None else message.get("from")
        content = message.get("content") if message.get("content") is not None else message.get("value")
        if not isinstance(role, str) or not isinstance(content, str):
            raise TypeError("a chat message needs string 'role'/'content' (or 'from'/'value')")
        parts.append([ASSISTANT if role.lower() in PRETRAINING_ASSISTANT_NAMES else role, content.strip()])
    return parts


def document_text(parts: list) -> str:
    """A pretraining chat document's parts (text strings and `[role, content]` messages) as the string it reads
    as: `<|begin_header|>{role}<|end_header|>\\n\\n{content}<|end_turn|>` per message."""
    return "".join(p if isinstance(p, str) else f"{BEGIN_HEADER}{p[0]}{END_HEADER}\n\n{p[1]}{END_TURN}"
                   for p in parts)


def render_document(parts: list, tokenizer) -> list[int]:
    """Token ids of a pretraining chat document (parts as staging keeps them: text strings and `[role, content]`
    messages): BOS, each message's structure as ids and everything else as text, EOS."""
    special = chat_token_ids(tokenizer)
    pieces: list = []  # text runs (str) and structure ids (int), in order
    for part in parts:
        if isinstance(part, str):
            part_pieces = [part]
        else:
            part_pieces = [special.begin_header, part[0], special.end_header, "\n\n" + part[1], special.end_turn]
        for piece in part_pieces:
            if isinstance(piece, str) and pieces and isinstance(pieces[-1], str):
                pieces[-1] += piece  # adjacent text is one run, as the tokenizer sees it in the whole string
            else:
                pieces.append(piece)
    runs = iter(encode_text(tokenizer, [p for p in pieces if isinstance(p, str)]))
    ids = [special.bos]
    for piece in pieces:
        ids += next(runs) if isinstance(piece, str) else [piece]
    return ids + [special.eos]


def render(messages, tokenizer, loss_on: str = "assistant",
           add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and its loss mask (same length). With add_generation_prompt the ids end
    with Huginn's header, ready for generation, instead of EOS."""
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
    special = chat_token_ids(tokenizer)
    checked = check_messages(messages)
    texts = [role for role, _ in checked] + ["\n\n"] + [content for _, content in checked]
    encoded = encode_text(tokenizer, texts + [ASSISTANT])
    roles, newlines, contents = encoded[: len(checked)], encoded[len(checked)], encoded[len(checked) + 1 : -1]
    everything = loss_on == "all"
    ids, mask = [special.bos], [int(everything)]
    for (role, _), role_ids, content_ids in zip(checked, roles, contents):
        header = [special.begin_header, *role_ids, special.end_header, *newlines]
        body = [*content_ids, special.end_turn]
        ids += header + body
        mask += [int(everything)] * len(header) + [int(everything or role == ASSISTANT)] * len(body)
    if add_generation_prompt:
        tail = [special.begin_header, *encoded[-1],
                special.end_header, *newlines]
    else:
        tail = [special.eos]
    return ids + tail, mask + [int(everything)] * len(tail)


@dataclass
class ChatRows:
    """Conversations laid out as rows of one length (`pad_rows`, `pack_rows`), with their loss mask."""

    input_ids: np.ndarray
    """(rows, row_length) int32 token ids."""
    loss_mask: np.ndarray
    """(rows, row_length) uint8: 1 where the token is a training target."""
    pad_tokens: int
    """Padding tokens in all rows."""
    truncated: int
    """Conversations longer than a row, cut to its length."""


def pad_rows(conversations: list[tuple[list[int], list[int]]], row_length: int, pad_id: int) -> ChatRows:
    """One row per conversation (the reference's layout): cut to row_length, then padded."""
    return _rows([[c] for c in conversations], row_length, pad_id)


def pack_rows(conversations: list[tuple[list[int], list[int]]], row_length: int, pad_id: int) -> ChatRows:
    """Whole conversations, in order, as many per row as fit; the rest of a row that cannot take the next one
    is padded. A conversation is never split across rows (its second half would lose the question); one longer
    than a row gets a row of its own, cut to row_length. Each keeps its own loss mask."""
    groups = pack_groups([len(ids) for ids, _ in conversations], row_length)
    return _rows([[conversations[i] for i in group] for group in groups], row_length, pad_id)


def pack_groups(lengths: list[int], row_length: int) -> list[list[int]]:
    """The rows `pack_rows` makes, as lists of conversation indices, from the conversations' lengths."""
    groups, current, used = [], [], 0
    for index, length in enumerate(lengths):
        if current and used + length > row_length:
            groups.append(current)
            current, used = [], 0
        current.append(index)
        used += length
    if current:
        groups.append(current)
    return groups


def _rows(groups: list[list[tuple[list[int], list[int]]]], row_length: int, pad_id: int) -> ChatRows:
    if row_length < 2:
        raise ValueError(f"row_length (block_size + 1) must be >= 2, got {row_length}")
    input_ids = np.full((len(groups), row_length), pad_id, dtype=np.int32)
    loss_mask = np.zeros((len(groups), row_length), dtype=np.uint8)
    truncated = pad_tokens = 0
    for row, group in enumerate(groups):
        start = 0
        for ids, mask in group:
            if len(ids) != len(mask):
                raise ValueError(f"a conversation has {len(ids)} ids but {len(mask)} loss-mask entries")
            if start + len(ids) > row_length:
                truncated += 1
            take = min(len(ids), row_length - start)
            input_ids[row, start : start + take] = ids[:take]
            loss_mask[row, start : start + take] = mask[:take]
            start += take
        pad_tokens += row_length - start
    return ChatRows(input_ids, loss_mask, pad_tokens, truncated)
