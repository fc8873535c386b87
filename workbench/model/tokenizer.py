"""Tokenizer of a model folder (``tokenizer.json``, the Hugging Face *tokenizers* format).

Two helpers for servers, which must not hold the interpreter while a long prompt is tokenized:
:meth:`Tokenizer.encode_nogil` (the same ids as :meth:`~Tokenizer.encode`; the Rust work runs
with the GIL released, and the ids are not even turned into a list when there are too many)
and :attr:`Tokenizer.max_token_bytes` (the most UTF-8 bytes one token can cover, when the
tokenizer's configuration proves such a bound: a prompt of ``b`` bytes then has at least
``ceil(b / max_token_bytes)`` tokens, so a prompt too long for the context can be refused
from its byte length alone, without tokenizing it).

Also :class:`IncrementalDetokenizer`: turns a growing list of token ids into text deltas for
streaming.  Decoding one token at a time is wrong for byte-level BPE (a character can span
several tokens; a leading space depends on the previous token), so we decode a short window
of recent tokens and emit only the new, complete characters.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer, pre_tokenizers

from workbench.errors import ConfigError, TokenizerError

# generation_config.json and config.json are a few kB; a larger one is refused unread.
_MAX_SIDE_JSON_BYTES = 64 * 2**20


def _eos_field(path: Path) -> int | list[int] | None:
    """``eos_token_id`` of a generation_config.json or config.json, or a one-line ConfigError naming
    the file and the field.  transformers' model loader logs a malformed generation_config.json and
    goes on with defaults; here it is refused, as every side file of a model is (the project never
    falls back silently): the EOS ids decide where every generation stops, and a default would make
    generations run to ``max_tokens``."""
    fix = "fix the file or remove it"
    try:
        size = path.stat().st_size
        if size > _MAX_SIDE_JSON_BYTES:
            raise ConfigError(f"{path}: {size:,} bytes is too large for a {path.name} (limit "
                              f"{_MAX_SIDE_JSON_BYTES:,}); {fix}")
        d = json.loads(path.read_bytes())
    except ConfigError:
        raise
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:          # JSONDecodeError, UnicodeDecodeError, nesting
        raise ConfigError(f"{path}: not valid JSON ({type(e).__name__}: {' '.join(str(e).split())}); the EOS "
                          f"token ids are read from its field 'eos_token_id': {fix}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a JSON object (with the field 'eos_token_id'), got "
                          f"{type(d).__name__}; {fix}")
    eos = d.get("eos_token_id")

    def is_id(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if eos is None or is_id(eos) or (isinstance(eos, list) and eos and all(is_id(v) for v in eos)):
        return eos
    raise ConfigError(f"{path}: field 'eos_token_id' must be a token id (an integer) or a non-empty list of "
                      f"them, got {eos!r:.80}; {fix}")


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
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
        """The ids that end generation: ``eos_token_id`` of generation_config.json, else of
        config.json (as transformers takes them), else the vocabulary's ``<|endoftext|>`` or ``</s>``."""
        for name in ("generation_config.json", "config.json"):
            p = folder / name
            if p.is_file():
                eos = _eos_field(p)
                if eos is not None:
                    return set(eos) if isinstance(eos, list) else {eos}
        tid = self._tok.token_to_id("<|endoftext|>") or self._tok.token_to_id("</s>")
        return {tid} if tid is not None else set()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most UTF-8 bytes one token can cover, when the configuration proves it (a byte-level
        BPE without normalizer or truncation; see :func:`_max_token_bytes`), else None.  Worked out
        on first use (it reads the whole vocabulary)."""
        return _max_token_bytes(self._tok)

    def encode_nogil(self, text: str, add_special_tokens: bool = True,
                     limit: int | None = None) -> tuple[int, list[int] | None]:
        """``(number of tokens, ids)``: the ids :meth:`encode` gives, computed with the GIL
        released, so other Python threads (a server's event loop, the engine thread) run
        meanwhile; ``ids`` is None when ``limit`` is given and there are at least ``limit`` tokens
        (the ids are then never made into a Python list, which holds the GIL for ~10 ms per
        300k tokens).

        Why ``encode_batch_fast``: ``tokenizers``' ``encode`` holds the GIL for the whole call
        (a 1 MB prompt: ~0.6 s during which no other thread runs Python, measured with tokenizers
        0.23), while ``encode_batch*`` runs the Rust work with the GIL released, and the ``_fast``
        variant skips computing offsets (about half the time).  One tokenizer is shared by all
        threads: these calls only read it."""
        if isinstance(text, str) and text:
            fast = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
            enc = fast([text], add_special_tokens=add_special_tokens)[0]
        else:                                   # "" (no batch needed) or a type encode() reports plainly
            enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        n = len(enc)
        if limit is not None and n >= limit:
            return n, None
        return n, enc.ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(self.encode(text))`` from the text's UTF-8 length alone
        (0 when the tokenizer proves no bound; see :attr:`max_token_bytes`)."""
        if not self.max_token_bytes:
            return 0
        return math.ceil(utf8_len(text) / self.max_token_bytes)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_str(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for.  With a byte-level vocabulary (GPT-2's byte
        symbols) these are exact, also for a token that ends inside a UTF-8 character (whose
        :meth:`token_to_str` shows U+FFFD); otherwise the UTF-8 of :meth:`token_to_str`."""
        piece = self._tok.id_to_token(token_id)
        table = self._byte_symbols
        if table and piece is not None and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return self.token_to_str(token_id).encode("utf-8", "surrogatepass")

    def shown_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` adds to decoded text: :meth:`token_bytes`, or nothing for a
        special token (BOS, EOS, ...), which decoding skips."""
        return b"" if token_id in self._special_ids else self.token_bytes(token_id)

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        try:
            return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        except AttributeError:                  # an old tokenizers without the call
            return frozenset()

    @functools.cached_property
    def _byte_symbols(self) -> dict[str, int] | None:
        """Byte-level symbol -> byte (GPT-2's table), when the decoder is byte-level; else None."""
        try:
            decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        except Exception:  # noqa: BLE001 - an unexpected layout: no exact bytes
            return None
        steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
        if not any(d.get("type") == "ByteLevel" for d in steps):
            return None
        keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                *range(ord("\xae"), ord("\xff") + 1)]
        table, extra = {chr(b): b for b in keep}, 0
        for b in range(256):
            if b not in keep:
                table[chr(256 + extra)] = b
                extra += 1
        return table


def utf8_len(text: str) -> int:
    """UTF-8 length of ``text`` (O(1) for ASCII text; lone surrogates count 3 bytes)."""
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


_SPLITTERS = {"Split", "Punctuation"}    # pre-tokenizers that only cut the text (unless told to remove the cuts)


def _max_token_bytes(hf_tok) -> int | None:
    """The most input bytes one token can cover, when the configuration proves it; else None.

    Proof for a byte-level BPE: with no normalizer, the ByteLevel pre-tokenizer maps each
    input byte to one symbol and the other pre-tokenizers allowed only cut the text, so the
    pieces partition the input's bytes (a prefix space only adds one); BPE over an alphabet that
    holds all 256 byte symbols covers every symbol of every piece with exactly one token (no
    unknown token can swallow a run); added tokens cover their own content (none may strip the
    whitespace beside it: ``lstrip``/``rstrip`` make a token cover a run of any length); the post-processor
    only adds tokens; nothing truncates.  So the tokens partition the bytes, each covers at most
    ``L`` bytes, and ``tokens >= bytes / L``: a lower bound, safe for refusing prompts early.
    Anything else (a normalizer may shrink the text, WordPiece's [UNK] may cover a whole word,
    truncation caps the count) gives None: no early refusal, the exact count decides."""
    try:
        cfg = json.loads(hf_tok.to_str())
        if cfg.get("normalizer") is not None or cfg.get("truncation") is not None:
            return None
        pre = cfg.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        if not any(p.get("type") == "ByteLevel" for p in steps):
            return None
        for p in steps:
            if not (p.get("type") in ("ByteLevel", "Digits") or
                    (p.get("type") in _SPLITTERS and p.get("behavior", "Isolated") != "Removed")):
                return None
        model = cfg.get("model") or {}
        vocab = model.get("vocab")
        if model.get("type") != "BPE" or not isinstance(vocab, dict) or not vocab:
            return None
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        if not alphabet <= vocab.keys():
            return None
        # a vocabulary string is in byte symbols (one byte each); any other character counts its
        # UTF-8 length, which can only overstate what the token covers (the bound stays safe)
        longest = max(len(t) if set(t) <= alphabet else len(t.encode("utf-8", "surrogatepass")) for t in vocab)
        added = cfg.get("added_tokens") or []
        if any(a.get("lstrip") or a.get("rstrip") for a in added):
            return None                   # such a token also swallows the whitespace next to it, however long
        return max([longest, *(len(a.get("content", "").encode("utf-8", "surrogatepass")) for a in added)])
    except Exception:  # noqa: BLE001 - an unexpected layout only means no early bound
        return None


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
