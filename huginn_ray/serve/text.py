"""A request's text as its tokens arrive: the pieces a stream may send, and where a `stop` string ends it.

    text = GeneratedText(tokenizer, stop_texts=("\\n\\n",))
    piece = text.add(token_id, is_stop_token)   # text that is final now ("" while undecided)
    text.stopped                                 # a stop string appeared: the request is over
    rest = text.finish()                         # what is left when the request ends

The text is the decoding of every token so far (special tokens as their names; a stop token that ends the
request is not part of it). A piece is held back while its end is an incomplete UTF-8 character (the decoder
shows U+FFFD) or could be the start of a stop string; the text ends just before the first stop string, as
OpenAI's does. Decoding all tokens at every step costs O(tokens) per token, in the tokenizer's Rust code:
small beside a forward of the model.
"""

from __future__ import annotations


class GeneratedText:
    def __init__(self, tokenizer, stop_texts: tuple[str, ...] = ()):
        self.tokenizer, self.stop_texts = tokenizer, stop_texts
        self.token_ids: list[int] = []
        self.sent = ""
        """Text handed out so far."""
        self.stopped = False
        """Whether a stop string ended the text."""

    def add(self, token_id: int, is_stop_token: bool) -> str:
        """Take the next token; returns the text that became final ("" when none)."""
        if self.stopped:
            return ""
        if not is_stop_token:
            self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=False)
        found = [at for stop in self.stop_texts if (at := text.find(stop)) >= 0]
        if found:
            self.stopped = True
            return self._send(text[: min(found)])
        safe = len(text.rstrip("\ufffd"))
        held = max([length for stop in self.stop_texts for length in range(1, min(len(stop), safe + 1))
                    if text[safe - length : safe] == stop[:length]], default=0)
        return self._send(text[: max(safe - held, len(self.sent))])

    def finish(self) -> str:
        """The text still held back, once the request has ended."""
        if self.stopped:
            return ""
        return self._send(self.tokenizer.decode(self.token_ids, skip_special_tokens=False))

    def _send(self, text: str) -> str:
        piece, self.sent = text[len(self.sent):], text
        return piece
