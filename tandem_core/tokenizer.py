"""Tokenizers and incremental detokenization (no JAX).

`ByteTokenizer` serves the random-weight presets: ids 0..255 are raw bytes, 256 is BOS, 257 EOS.
`HFTokenizer` wraps a `tokenizer.json` through the `tokenizers` library.
`Detokenizer` turns a token stream into text deltas, holding back incomplete UTF-8.
"""
from __future__ import annotations

import codecs
from pathlib import Path
from typing import Protocol

from tandem_core.models import BYTE_BOS, BYTE_EOS, BYTE_VOCAB, ModelInfo


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    def __init__(self) -> None:
        self.bos_token_id = BYTE_BOS
        self.eos_token_ids = (BYTE_EOS,)

    def encode(self, text: str) -> list[int]:
        return [BYTE_BOS, *text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: str | Path, bos: int | None, eos: tuple[int, ...]) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(Path(path) / "tokenizer.json"))
        self.bos_token_id = bos
        self.eos_token_ids = eos

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(info: ModelInfo) -> Tokenizer:
    if info.tokenizer == "hf" and info.path:
        return HFTokenizer(info.path, info.bos_token_id, info.eos_token_ids)
    return ByteTokenizer()


class Detokenizer:
    """Incremental detokenization for one request: `feed(id)` returns the new text, if any.

    Bytes: an incremental UTF-8 decoder holds back split multi-byte characters.
    HF: decode a small window of recent ids and emit what grew, holding back text that ends in
    U+FFFD (an incomplete character), the way vLLM and TGI do.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._bytes = isinstance(tokenizer, ByteTokenizer)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are already emitted

    def feed(self, token_id: int) -> str:
        if self._bytes:
            if 0 <= token_id < BYTE_VOCAB:
                return self._utf8.decode(bytes([token_id]))
            return ""
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        if self._bytes:
            return self._utf8.decode(b"", final=True)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]
