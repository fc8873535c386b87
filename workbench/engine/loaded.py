"""A loaded model as every engine sees it: weights, tokenizer, context limit, stop tokens,
thread choice, and prompt checking.  Loading happens once; engines and fronts share it.

::

    lm = LoadedModel.load(None)                    # the bundled model (a path, "preset:<name>", a CausalLM)
    text, ids = lm.encode("The list type")         # ConfigError for an empty / too long / bad prompt
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workbench.engine.sizing import context_length
from workbench.errors import ConfigError, WorkbenchError
from workbench.model.loader import BUNDLED_MODEL, load_model, model_config
from workbench.model.decoder import CausalLM
from workbench.model.tokenizer import Tokenizer
from workbench.quant.compressed import is_compressed_checkpoint, load_compressed
from workbench.measure.threads import apply_thread_policy, usable_threads

Prompt = str | Sequence[int]


def is_compressed(model) -> bool:
    """Whether ``model`` (an LLM / LoadedModel argument) names a compressed-tensors checkpoint folder."""
    if model is None or isinstance(model, CausalLM) or str(model) == "bundled" or str(model).startswith("preset:"):
        return False
    return is_compressed_checkpoint(model)


class LoadedModel:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer | None, max_model_len: int | None = None,
                 thread_choice=None) -> None:
        self.model, self.tokenizer, self.thread_choice = model, tokenizer, thread_choice
        # above the model's context is an error, not a clamp: positions past it were never trained, and
        # every cache is sized by this number (workbench.engine.sizing)
        self.max_model_len = context_length(model.config, max_model_len)
        eos = model.config.eos_token_id
        cfg_eos = set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
        self.eos_token_ids = tokenizer.eos_token_ids if tokenizer else cfg_eos

    @classmethod
    def load(cls, model: str | CausalLM | None = None, tokenizer=None, device=None, dtype=None,
             max_model_len: int | None = None, threads: int | str | None = None,
             check_finite: bool = True) -> LoadedModel:
        """``model``: a path (a compressed-tensors checkpoint loads through
        :func:`workbench.quant.compressed.load_compressed`), ``"preset:<name>"``, None for the
        bundled model, or a loaded CausalLM;
        ``tokenizer``: a folder / tokenizer.json, a :class:`Tokenizer`, or None for the model
        folder's (presets have none: prompts are token-id lists).  ``threads``: see
        :mod:`workbench.measure.threads` (measured on this model unless given).  ``check_finite``:
        refuse NaN / Inf weights (one pass over the tensors; False skips it)."""
        usable_threads(threads, where="LLM(threads=...)")   # bad input fails before a model loads
        if max_model_len is not None and not isinstance(model, CausalLM):     # ... a context too: from the config
            try:
                cfg = model_config(model)
            except WorkbenchError:          # the loader says what is wrong with the folder
                cfg = None
            if cfg is not None:
                context_length(cfg, max_model_len)
        if isinstance(model, CausalLM):
            net, source = model, None
        elif is_compressed(model):     # a quantized checkpoint: its layers hold the stored integers
            net = load_compressed(model, device=device, dtype=dtype, check_finite=check_finite)
            source = model
        else:
            net = load_model(model, device=device, dtype=dtype, check_finite=check_finite)
            source = BUNDLED_MODEL if model in (None, "bundled") else model
        choice = apply_thread_policy(net, threads)     # torch's intra-op threads (process-wide)
        if isinstance(tokenizer, Tokenizer):
            tok = tokenizer
        elif tokenizer is not None:
            tok = Tokenizer(tokenizer)
        elif source is not None and not str(source).startswith("preset:"):
            tok = Tokenizer(source)
        else:
            tok = None
        return cls(net, tok, max_model_len, choice)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def threads(self) -> int:
        """The intra-op thread count chosen at load (``thread_choice`` says why)."""
        return self.thread_choice.threads

    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as text or as token ids, checked."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise WorkbenchError("this model has no tokenizer (a shape preset?): pass prompts as lists of "
                                     "token ids, or give LLM(..., tokenizer=<folder>)")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            prompt = None
        vocab = self.model.config.vocab_size
        if not ids:
            raise ConfigError("prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ConfigError(f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                              "(leave room for at least one generated token)")
        return prompt, ids

