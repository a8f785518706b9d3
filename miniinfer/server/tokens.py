"""Text in and text out for the server, bounded so that no input can stall the event loop.

A tokenizer call holds the GIL for as long as it runs (HF's fast tokenizers release it for
part of an encode at best), so a prompt of many megabytes would freeze every stream for seconds wherever
it ran. Three things keep a prompt cheap:

- a bound before any tokenising: no token of the vocabulary spells more than
  ``max_token_chars`` characters, so a text of ``c`` characters has at least
  ``c / max_token_chars`` tokens; one that must overflow the context is refused at once;
- the rest is tokenised in a worker thread, in pieces of a few thousand characters cut where
  the pre-tokenizer cuts anyway (before the whitespace that starts a word), so the GIL is
  handed back between pieces and the event loop keeps streaming; a start-up self-check falls
  back to whole-text encoding for a tokenizer where pieces would change the tokens;
- the count is kept as the pieces go: a prompt is refused as soon as it passes the context,
  before the rest is tokenised.

Output text grows incrementally (``TextStream``): each step decodes only the tokens since the
last complete character, not the whole output again.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

from ..core.models import LoadedModel, chat_text
from ..core.scheduler import FinishReason
from .protocol import APIError, invalid

PIECE_CHARS = 4096
_SELF_CHECK_TEXTS = (
    "  <|im_start|>  <|im_end|>\n <|im_start|>x",
    "The capital of France is Paris.  Two  spaces,\ttabs\tand\nnew lines\n\n  indented",
    "naïve café, 東京 and emoji 🙂🙃 next to digits 1234567 and 3.14159 -- punctuation!?",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # a comment\n\n\nclass A:\n    pass   ",
)


class PromptTokenizer:
    """The server's tokenizer: bounded, piecewise encoding (call ``encode`` from a worker
    thread), the chat template, decoding, and a cache of single-token texts (logprobs)."""

    def __init__(self, lm: LoadedModel) -> None:
        self.tokenizer = lm.tokenizer
        self.max_context = lm.max_context
        # Characters are at least as many as the UTF-8 bytes they need, so the longest token
        # in bytes bounds every token's characters (byte-level BPE spells each byte as one
        # character of one or two bytes: an overestimate, which keeps the bound safe).
        self.max_token_chars = max(len(token.encode("utf-8", "surrogatepass"))
                                   for token in self.tokenizer.get_vocab())
        probe = "x y"
        bare = self.tokenizer.encode(probe, add_special_tokens=False)
        full = self.tokenizer.encode(probe)
        at = next(i for i in range(len(full) - len(bare) + 1) if full[i: i + len(bare)] == bare)
        self.special_prefix, self.special_suffix = full[:at], full[at + len(bare):]
        # Where a byte-level BPE pre-tokenizer always cuts: before the (last) whitespace in
        # front of a word; cutting there changes no token. Not in front of an added token
        # (<|im_start|>): those are split off first, and the whitespace before one is a run
        # of its own.
        added = "|".join(re.escape(t) for t in self.tokenizer.get_added_vocab())
        self.boundary = re.compile(r"\s(?=\S)" + (f"(?!{added})" if added else ""))
        self.piecewise = all(self._pieces_match(text) for text in _SELF_CHECK_TEXTS)
        self._token_text: dict[int, str] = {}

    def _pieces_match(self, text: str) -> bool:
        whole = self.tokenizer.encode(text, add_special_tokens=False)
        pieces = [t for piece in self.split(text, 8)
                  for t in self.tokenizer.encode(piece, add_special_tokens=False)]
        return whole == pieces

    @property
    def max_chars(self) -> int:
        """The longest text that could still fit the context."""
        return self.max_context * self.max_token_chars

    def check_chars(self, num_chars: int, param: str) -> None:
        """Refuse, without tokenising, text too long for the context whatever its tokens."""
        if num_chars > self.max_chars:
            raise too_long(f"{num_chars} characters, so at least "
                           f"{-(-num_chars // self.max_token_chars)} tokens (no token of this "
                           f"vocabulary spells more than {self.max_token_chars})",
                           self.max_context, param)

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; refused once they pass the context. Blocking: run it in a
        worker thread."""
        self.check_chars(len(text), param)
        ids = list(self.special_prefix) if add_special_tokens else []
        pieces = self.split(text, PIECE_CHARS) if self.piecewise else [text]
        num_chars = 0
        for piece in pieces:
            ids += self.tokenizer.encode(piece, add_special_tokens=False)
            num_chars += len(piece)
            if len(ids) > self.max_context:
                raise too_long(f"more than {self.max_context} tokens in its first {num_chars} "
                               f"characters", self.max_context, param)
            time.sleep(0)  # hand the GIL to the event loop between pieces
        return ids + (list(self.special_suffix) if add_special_tokens else [])

    def split(self, text: str, size: int) -> list[str]:
        """``text`` cut into pieces of about ``size`` characters at pre-tokenizer boundaries
        (a text without one stays whole)."""
        pieces = []
        start = 0
        while len(text) - start > size:
            boundary = self.boundary.search(text, start + size)
            if boundary is None:
                break
            pieces.append(text[start: boundary.start()])
            start = boundary.start()
        pieces.append(text[start:])
        return pieces

    def encode_chat(self, turns: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        """The model's chat template over the turns, as ``generate --chat`` applies it, then
        ``encode``. Blocking: run it in a worker thread."""
        # Each turn adds at least one token (its role marker) besides its content.
        self.check_chars(sum(len(t["content"]) for t in turns), "messages")
        if len(turns) > self.max_context:
            raise too_long(f"{len(turns)} messages", self.max_context, "messages")
        text = chat_text(self.tokenizer, turns, add_generation_prompt)
        return self.encode(text, "messages")

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs show it (a piece of a character decodes as U+FFFD)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


def too_long(what: str, max_context: int, param: str) -> APIError:
    return invalid(f"{param} is too long for the model's context of {max_context} tokens: "
                   f"{what}", param)


class TextStream:
    """The output text as tokens arrive: each call returns the new text that is safe to send.

    Decoding is incremental (vLLM's and TGI's scheme): the tokens since the last complete
    character are decoded with the ones before them for context, so a step costs the same at
    token 10 and at token 10,000. Two things are held back until more tokens come: a
    character whose UTF-8 bytes are split across tokens, and the last ``len(longest stop) -
    1`` characters, which could be the start of a stop string (OpenAI never sends a stop
    string). At the end the output is cut before the first stop string."""

    def __init__(self, tokenizer: PromptTokenizer, stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.decoded = ""  # every complete character so far
        self.text = ""  # what has been sent
        self._prefix_offset = 0  # the tokens decoded for context only
        self._read_offset = 0  # tokens before this are in ``decoded``

    def _decode(self, final: bool) -> None:
        ids = self.token_ids
        if self._read_offset == len(ids):
            return
        decode = self.tokenizer.decode
        before = decode(ids[self._prefix_offset: self._read_offset], self.skip_special_tokens)
        after = decode(ids[self._prefix_offset:], self.skip_special_tokens)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.decoded += after[len(before):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)

    def add(self, token_ids: Sequence[int], reason: FinishReason | None) -> str:
        self.token_ids += token_ids
        self._decode(final=reason is not None)
        decoded = self.decoded
        if reason is None:
            end = len(decoded) - self.holdback
        elif reason is FinishReason.STOP:
            # The output ends at the first stop string, which is left out.
            end = min((i for i in (decoded.find(s) for s in self.stop) if i >= 0),
                      default=len(decoded))
        else:
            end = len(decoded)
        if end <= len(self.text):
            return ""
        delta = decoded[len(self.text): end]
        self.text += delta
        return delta
