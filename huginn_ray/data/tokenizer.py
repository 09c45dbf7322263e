"""The Huginn tokenizer: byte-level BPE trained with bpeasy, exported as a Hugging Face tokenizer.json.

Vocabulary layout for a vocabulary of V entries (V = 65,536 for the real model):

    [0, 256)            the 256 single bytes
    [256, B)            BPE tokens trained by bpeasy with the `aeolian` pre-tokenisation regex
    [B, V - 32)         the manual tokens of the reference (§6.1), in order; one that is already in the
                        vocabulary becomes an unreachable placeholder `<|reserved_token_i|>` so ids stay put
    [V - 32, V)         the 32 special tokens, <|begin_text|> first: BOS 65504, EOS 65505, ... for V = 65,536

The exported tokenizer wraps every document in <|begin_text|> ... <|end_text|> (post-processor), so
`encode(text).ids` is a packed document as the data pipeline and the model expect it.

Encoding follows tiktoken/bpeasy semantics: a pre-token that is a vocabulary entry is emitted whole
(`ignore_merges`), otherwise merges apply in rank order. Pre-tokenisation keeps text the regex does not match
as its own piece (the reference dropped it), so decoding gives back the exact input bytes.

The readers (`load_tokenizer_file`, `special_token_ids`, `check_tokenizer_fits`, `file_sha256`) take a location: a local path, or a
bucket URI (huginn_ray/storage.py) whose tokenizer.json is read in one GET and parsed from memory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from huginn_ray import storage
from huginn_ray.data import layout

# The `aeolian` pre-tokenisation regex of the reference (Appendix C of the fact sheet), verbatim.
AEOLIAN_REGEX = r"""(\\n(?:e(?:wcommand|wenvironment|wline|wpage|wtheorem)|abla|e|eq|geq|gtr|leq|exists|ocite|oindent|olinebreak|onumber|opagebreak|ormalsize|ot(?!(?:ag\b|\b)))\b|\n+|\\n(?!\b)|\p{N}{1,1}|(?:[ \t](?:==|!=|<=|>=|<<|>>|\*\*|//|\+=|-=|\*=|/=|%=|&=|\|=|\^=|<<=|>>=|\*\*=|//=|:=|\+\+|--|[\p{L}]+[''ʼ](?:\p{L}+)\b|\\[a-zA-Z]+|\\{|\\}|{|}|\\\[|\\\]|\[|\]|\(|\)|_+|\||\+|-|\*|—|-|=|\*\*|^|[.,!?;()]|\$\$?|`+|\"+|\#+|\p{N}+(?:st|nd|rd|th)|<0x[0-9A-Fa-f]{1,2}>)|[^\r\n\p{L}\p{N}]?\p{L}+|[\p{P}\p{S}])|\s+|\p{So})"""

# The first 32 names of the reference's `complete` special-token layout: the ids above 65,503 hold 32.
SPECIAL_TOKENS = [
    "<|begin_text|>", "<|end_text|>", "<|begin_header|>", "<|end_header|>", "<|end_turn|>", "<|pad|>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|...|>", "<|del|>",
    "<|c_0|>", "<|c_1|>", "<|c_2|>", "<|c_3|>", "<|c_4|>", "<|c_5|>", "<|c_6|>", "<|c_7|>", "<|c_8|>",
    "<|c_9|>", "<|?|>", "<|&|>", "<|!|>", "<|-|>", "<|+|>", "<|interrupt|>", "<|>>-|>", "<|-<<|>",
    "<|->>|>", "<|<<-|>",
]
BOS, EOS, PAD = "<|begin_text|>", "<|end_text|>", "<|pad|>"

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def manual_tokens() -> list[str]:
    """The reference's hand-added tokens (§6.1), in order, duplicates included (placeholders keep ids fixed)."""
    tokens = ['"""', "'''", '"', "''", 'f"', "f'"]
    for char in (" ", "\n", "\t"):
        tokens += [char * n for n in range(1, 17)]
    tokens += [chr(i) for i in range(687)]
    tokens.append("\U0001F9AD")  # seal
    ranges = [(0x1F600, 0x1F64F), (0x1F300, 0x1F5FF), (0x1F680, 0x1F6FF), (0x1F900, 0x1F9FF),
              (0x2600, 0x26FF), (0x2700, 0x27BF), (0x2150, 0x218F), (0x2190, 0x21FF), (0x2200, 0x22FF)]
    for lo, hi in ranges:
        tokens += [chr(i) for i in range(lo, hi + 1)]
    tokens.append("Huginn")
    return tokens


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path, *, use_manual_tokens: bool = True,
                    max_token_length: int = 32) -> Path:
    """Train BPE on `texts` and write tokenizer.json + tokenizer_config.json to `out_dir` (atomically)."""
    import bpeasy

    extra = manual_tokens() if use_manual_tokens else []
    bpe_size = vocab_size - len(SPECIAL_TOKENS) - len(extra)
    if bpe_size < 257:
        raise ValueError(
            f"vocab_size {vocab_size} is too small: {len(SPECIAL_TOKENS)} special and {len(extra)} manual tokens "
            f"leave {bpe_size} BPE entries, and the 256 single bytes alone need 256 (+1 merge)")
    ranks = dict(bpeasy.train_bpe(iter(texts), AEOLIAN_REGEX, max_token_length, bpe_size))
    # bpeasy stops early when the corpus runs out of pairs; unused slots keep the special ids at the top.
    unused = [f"<|unused_bpe_{i}|>".encode() for i in range(len(ranks), bpe_size)]
    for token in unused:
        ranks[token] = len(ranks)
    return write_tokenizer(ranks, extra, out_dir, unreachable=set(unused))


def write_tokenizer(ranks: dict[bytes, int], extra: list[str], out_dir: str | Path,
                    unreachable: set[bytes] = frozenset()) -> Path:
    """Build the Hugging Face tokenizer from bpeasy ranks plus manual tokens and save it under `out_dir`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    ranks = dict(ranks)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("bpeasy ranks are not the contiguous ids 0..n-1")
    unreachable = set(unreachable)
    for i, token in enumerate(extra):
        data = token.encode("utf-8")
        if data in ranks:
            data = f"<|reserved_token_{i}|>".encode()
            unreachable.add(data)
        ranks[data] = len(ranks)

    byte_to_char = _bytes_to_unicode()

    def as_str(data: bytes) -> str:
        return "".join(byte_to_char[b] for b in data)

    vocab = {as_str(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2 or token in unreachable:
            continue
        parts = _bpe_parts(ranks, token, rank)
        if len(parts) == 2:  # manual tokens without a two-part split are reached as whole pre-tokens
            merges.append((as_str(parts[0]), as_str(parts[1])))

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(AEOLIAN_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    base = tokenizer.get_vocab_size(with_added_tokens=False)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bos, eos = base, base + 1
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}",
        pair=f"{BOS} $A {EOS} {BOS}:1 $B:1 {EOS}:1",
        special_tokens=[(BOS, bos), (EOS, eos)],
    )

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = layout.tmp_dir_for(out_dir)
    tokenizer.save(str(tmp / TOKENIZER_FILE))
    (tmp / TOKENIZER_CONFIG_FILE).write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
    }, indent=2))
    layout.replace_dir(tmp, out_dir)
    return out_dir


def load_text_tokenizer(path: str | Path):
    """A `tokenizers.Tokenizer` from a tokenizer.json that encodes every string as text: a special token's string
    inside a document (`<|end_text|>` on a web page) gives ordinary ids, never the control id. Control ids come
    only from the post-processor (BOS/EOS around a document) and from structure the caller puts in by id (the chat
    template, huginn_ray/data/chat.py)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.encode_special_tokens = True  # tokenizers >= 0.15; not stored in tokenizer.json
    return tokenizer


def _tokenizer_location(tokenizer_dir: str | Path) -> str | Path:
    """`<tokenizer_dir>/tokenizer.json`: a Path when local, a URI in a bucket."""
    if storage.is_uri(str(tokenizer_dir)):
        return storage.join(str(tokenizer_dir), TOKENIZER_FILE)
    return Path(tokenizer_dir) / TOKENIZER_FILE


def load_tokenizer_file(file: str | Path):
    """A `tokenizers.Tokenizer` from a tokenizer.json: a local file, or an object read in one GET and parsed from
    its text."""
    from tokenizers import Tokenizer

    if storage.is_uri(str(file)):
        return Tokenizer.from_str(storage.read_text(str(file)))
    return Tokenizer.from_file(str(file))


def special_token_ids(tokenizer_dir: str | Path) -> dict[str, int]:
    """bos/eos/pad ids (and the vocabulary size) of a saved tokenizer (a local directory or a bucket prefix)."""
    file = _tokenizer_location(tokenizer_dir)
    tok = load_tokenizer_file(file)
    ids = {"bos": tok.token_to_id(BOS), "eos": tok.token_to_id(EOS), "pad": tok.token_to_id(PAD)}
    missing = [k for k, v in ids.items() if v is None]
    if missing:
        raise ValueError(f"{file}: no {', '.join(missing)} token")
    ids["vocab_size"] = tok.get_vocab_size(with_added_tokens=True)
    return ids


def check_tokenizer_fits(tokenizer_path: str | Path, model_vocab_size: int) -> int:
    """Raise ValueError unless every id of the tokenizer is below the model's vocabulary size.

    `tokenizer_path` is a tokenizer directory (or bucket prefix) or its tokenizer.json. Returns the tokenizer's
    vocabulary size.
    """
    if storage.is_uri(str(tokenizer_path)):
        location = str(tokenizer_path)
        file = location if location.endswith(".json") else storage.join(location, TOKENIZER_FILE)
        found = storage.exists(file)
    else:
        path = Path(tokenizer_path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        found = file.is_file()
    if not found:
        raise ValueError(f"tokenizer file not found: {file}")
    try:
        tok = load_tokenizer_file(file)
    except Exception as err:  # tokenizers raises plain Exception subclasses for bad JSON
        raise ValueError(f"{file}: cannot be loaded as a Hugging Face tokenizer: {err}") from None
    size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    if size > model_vocab_size:
        raise ValueError(
            f"tokenizer {file} has a vocabulary of {size} ids but the model's vocab_size is {model_vocab_size}: "
            f"token ids >= {model_vocab_size} would index past the embedding")
    return size


def file_sha256(path: str | Path) -> str:
    """The sha256 of a local file's or an object's bytes (read in 1 MiB pieces)."""
    digest = hashlib.sha256()
    with (storage.open_input_file(str(path)) if storage.is_uri(str(path)) else open(path, "rb")) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Merge the bytes of `token` greedily by rank, using only ranks below `max_rank` (tiktoken's rule)."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = i, rank
        if best < 0:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return parts


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what ByteLevel pre-tokenisation produces)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table
