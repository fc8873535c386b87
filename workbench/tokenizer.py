"""Tokenizer of a model folder (``tokenizer.json``, the Hugging Face *tokenizers* format).

Also :class:`IncrementalDetokenizer`: turns a growing list of token ids into text deltas for
streaming.  Decoding one token at a time is wrong for byte-level BPE (a character can span
several tokens; a leading space depends on the previous token), so we decode a short window
of recent tokens and emit only the new, complete characters.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import TokenizerError


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        folder = Path(path)
        file = folder / "tokenizer.json" if folder.is_dir() else folder
        if not file.is_file():
            extra = ""
            if folder.is_dir() and (folder / "tokenizer.model").is_file():
                extra = (" (found tokenizer.model, a SentencePiece file: convert it with transformers' "
                         "AutoTokenizer(...).save_pretrained() to get tokenizer.json)")
            raise TokenizerError(f"{file}: tokenizer.json not found{extra}; pass token ids instead of text "
                                 "or point at a folder with a tokenizer")
        try:
            self._tok = _HFTokenizer.from_file(str(file))
        except Exception as e:  # the Rust library raises plain Exceptions
            raise TokenizerError(f"{file}: cannot read tokenizer ({e})") from None
        self.path = file
        self.eos_token_ids = self._find_eos(file.parent)
        self.vocab_size = self._tok.get_vocab_size()

    def _find_eos(self, folder: Path) -> set[int]:
        for name in ("generation_config.json", "config.json"):
            p = folder / name
            if p.is_file():
                eos = json.loads(p.read_text()).get("eos_token_id")
                if eos is not None:
                    return set(eos) if isinstance(eos, list) else {eos}
        tid = self._tok.token_to_id("<|endoftext|>") or self._tok.token_to_id("</s>")
        return {tid} if tid is not None else set()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_str(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    """``push(token_id) -> new text``; ``text`` holds everything decoded so far."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], context: int = 5) -> None:
        self.tok = tokenizer
        self.ids = list(prompt_ids[-context:])  # a little prompt context for leading spaces
        self.prefix, self.read = 0, len(self.ids)  # decode window start / end of text already emitted
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        delta = after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta
