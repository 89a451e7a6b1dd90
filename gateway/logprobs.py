"""Logprobs in OpenAI's two response shapes, from the ids and logprobs the workers stream.

- completions: `{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}],
  "text_offset": [...]}`, parallel lists; with echo, the prompt's tokens come first, the very first
  with a null logprob (nothing predicts it).
- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}], "refusal": null}`.
A token's text is its own bytes decoded alone (`Tokenizer.token_bytes`; invalid UTF-8, a
character split across tokens, shows as U+FFFD, and `bytes` carries the exact bytes). Pure
formatting: no I/O, nothing computed here beyond the shapes.
"""
from __future__ import annotations

from functools import lru_cache

from tandem_core.tokenizer import Tokenizer
from tandem_core.types import TokenLogprobs


class TokenText:
    """Token id -> (text, bytes), cached per gateway (bounded)."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 65536) -> None:
        self._tok = tokenizer
        self.text = lru_cache(maxsize=cache_size)(self._text)

    def _text(self, token_id: int) -> tuple[str, tuple[int, ...], int]:
        """(text, bytes, how many characters it adds to the response's text: 0 for a special
        token such as BOS, which the text leaves out)."""
        raw = self._tok.token_bytes(token_id)
        shown = len(self._tok.decode([token_id])) if token_id >= 0 else 0
        return raw.decode("utf-8", errors="replace"), tuple(raw), shown


class CompletionLogprobs:
    """One choice's completions-shaped logprobs, built a token at a time (text offsets run on)."""

    def __init__(self, names: TokenText, offset: int = 0) -> None:
        self.names = names
        self.offset = offset  # characters of text before the next token

    def prompt(self, prompt_ids: list[int], items: list[TokenLogprobs | None]) -> dict:
        out = empty_completion()
        for tid, lp in zip(prompt_ids, items):
            self._add(out, tid, lp)
        return out

    def token(self, token_id: int, lp: TokenLogprobs | None) -> dict:
        out = empty_completion()
        self._add(out, token_id, lp)
        return out

    def _add(self, out: dict, token_id: int, lp: TokenLogprobs | None) -> None:
        text, _raw, shown = self.names.text(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if lp is None else lp.logprob)
        out["top_logprobs"].append(None if lp is None else {self.names.text(t)[0]: v for t, v in lp.top})
        out["text_offset"].append(self.offset)
        self.offset += shown


def chat_logprobs(names: TokenText, token_id: int, lp: TokenLogprobs) -> dict:
    """One token's entry of chat's `logprobs.content`."""
    text, raw, _ = names.text(token_id)
    return {"token": text, "logprob": lp.logprob, "bytes": list(raw),
            "top_logprobs": [_alt(names, t, v) for t, v in lp.top]}


def _alt(names: TokenText, token_id: int, logprob: float) -> dict:
    text, raw, _ = names.text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


def merge_completion(parts: list[dict]) -> dict | None:
    """The whole response's logprobs: the streamed parts concatenated."""
    if not parts:
        return None
    out = empty_completion()
    for p in parts:
        for k in out:
            out[k].extend(p[k])
    return out


def empty_completion() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
