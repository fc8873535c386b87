"""A checkpoint's own chat template, applied as transformers applies it.

A model folder may carry a Jinja chat template: ``chat_template`` in ``tokenizer_config.json``
(a string, or a list of ``{"name", "template"}`` of which ``default`` is used), or a
``chat_template.jinja`` file (which wins, as in transformers).  It is rendered the way
``PreTrainedTokenizerBase.apply_chat_template`` renders it: a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, the variables ``messages``, ``add_generation_prompt``
(true: the prompt ends where the assistant's answer begins), ``tools`` and ``documents`` (none
here) and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...), the helpers
``raise_exception`` and ``strftime_now``, ``tojson`` with its keyword arguments, and the
``{% generation %}`` tag (its body).  Text parts of a message (``"content": [{"type": "text",
...}]``) reach the template as the list they are.  The rendered text already holds any BOS the
template writes, so it is tokenized without the tokenizer's own special tokens
(``add_special_tokens=False``), again as transformers does.

A template that raises (``raise_exception("roles must alternate")``) gives a :class:`TemplateError`
with its message: the server answers it as a 400 on ``messages`` and goes on serving.

A template is bounded, in time and in memory, whatever it does.  Rendering stops with a
TemplateError naming the template when it

- runs longer than :data:`RENDER_SECONDS` (checked on every line the template executes: a loop of
  loops that writes nothing ends too);
- writes more than :data:`MAX_OUTPUT_CHARS` characters;
- nests calls (a macro calling itself) more than :data:`MAX_CALL_DEPTH` deep;
- builds one value whose text would be longer than :data:`MAX_OUTPUT_CHARS` - measured as the
  text the value prints as, so a list holding one long string a thousand times
  (``[s] * 1000``, a list doubled in a loop) is as large as that text, although it holds only
  references;
- builds, in all, values that take more than :data:`MAX_BUILT_BYTES` of memory for one render -
  ``range(3000) | map('center', 1000000) | list``: each value within the limit, a thousand of
  them are not (a value is counted when it is built, as the bytes Python gives it; returning one
  that exists already, a message or an argument, counts nothing);

and every operation that can build more than a constant factor of what it is given is bounded
*before* it builds: the filters of :data:`GROWING_FILTERS` (``center``, ``indent``, ``join``,
``replace``, ``wordwrap``, ``format``, ``tojson``'s indent ...), the string methods of
:data:`GROWING_METHODS` (``ljust``, ``zfill``, ``expandtabs``, ``str.format`` ...), the operators
``*``, ``**``, ``+``, ``%`` and ``~``, a block's or macro's text, ``lipsum`` and ``strftime_now``.
Every other filter and method (:data:`LINEAR_FILTERS`, :data:`LINEAR_METHODS`) builds at most a
constant factor of its input (a case change, an HTML escape: 5x, a list of the input's items),
and its result is measured and counted after.  tests/fuzz/test_fuzz_chat_template.py enumerates
Jinja's filters and the string, list and dict methods the sandbox lets a template call: each must
be in one of these sets (a new Jinja filter fails it until it is classified in
:mod:`~workbench.model.template_filters`, a new method until it is in
:mod:`~workbench.model.template_sandbox`).  What a
template can hold is then :data:`MAX_BUILT_BYTES`, plus what one operation builds before it is
measured (a constant factor of values within the limit: some MiB), in about :data:`RENDER_SECONDS`.

The sandbox stays: ``cycler.__init__.__globals__`` and the like are refused as they were.  The
bounds change no rendering: a real template renders exactly as transformers renders it
(tests/serve/test_chat_template_transformers.py); only a template that builds past a bound is
refused.  A template that accumulates the whole conversation into one string in a loop builds
(characters) x (messages) / 2 in all, and is refused above some 32 MiB of that.

The template is the checkpoint's, as its tokenizer is (:mod:`workbench.model.tokenizer`):
``workbench import-gguf`` keeps a GGUF file's template only if it loads here, and ``workbench
serve`` renders chat requests with it (:mod:`workbench.serve.chat_template` re-exports this
module's names).  The render's parts live in three modules, their names importable from here:

* :mod:`~workbench.model.template_budget`: the limits, :class:`TemplateError`, the meter that
  measures values and counts what a render builds, and the checks made before a value is built
  (operators, ``%``-formats, format specs, integer arguments);
* :mod:`~workbench.model.template_filters`: Jinja's filters classified (:data:`GROWING_FILTERS`,
  :data:`LINEAR_FILTERS`) and bounded, ``join``, ``tojson``, ``pprint`` and ``sum`` replaced;
* :mod:`~workbench.model.template_sandbox`: the methods classified (:data:`GROWING_METHODS`,
  :data:`LINEAR_METHODS`) and bounded, and the bounded sandboxed environment.

This module reads a model folder's template (:meth:`ChatTemplate.from_folder`) and renders it
(:meth:`ChatTemplate.render`) under the time limit.  Jinja is imported when a template is built,
not with this module.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path

from workbench.model.template_budget import (
    _ACTIVE,
    MAX_BUILT_BYTES,
    MAX_CALL_DEPTH,
    MAX_OUTPUT_CHARS,
    MAX_TEMPLATE_BYTES,
    RENDER_SECONDS,
    TemplateError,
    _Meter,
    _need,
    _TooBig,
    _TooDeep,
)
from workbench.model.template_filters import (  # noqa: F401  (the filters' bounds: tests read them here)
    _FILTER_BOUNDS,
    GROWING_FILTERS,
    LINEAR_FILTERS,
    _filter_replacements,
)
from workbench.model.template_sandbox import (  # noqa: F401  (the methods' bounds: tests read them here)
    _METHOD_BOUNDS,
    GROWING_METHODS,
    LINEAR_METHODS,
    _bounded_environment,
)

__all__ = ["GROWING_FILTERS", "GROWING_METHODS", "LINEAR_FILTERS", "LINEAR_METHODS", "MAX_BUILT_BYTES",
           "MAX_CALL_DEPTH", "MAX_OUTPUT_CHARS", "MAX_TEMPLATE_BYTES", "RENDER_SECONDS", "ChatTemplate",
           "TemplateError"]


class _OutOfTime(BaseException):
    """Raised into the template's code by the render's trace function.  A BaseException: code
    between the template and us that catches Exception does not end the render's time limit."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_text(v) -> str | None:
    if isinstance(v, dict):                       # {"content": "<s>", "lstrip": ..., ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


def _generation_extension():
    from jinja2.ext import Extension  # lazy: jinja2 (~75 ms, with markupsafe) only once a chat template is compiled

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's tokens
        with it (for training masks); rendering a prompt, it is its body."""
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str], origin: str) -> None:
        from jinja2.exceptions import TemplateError as JinjaError

        def raise_exception(message):
            raise TemplateError(_one_line(message))

        _Generation = _generation_extension()
        env = _bounded_environment(trim_blocks=True, lstrip_blocks=True,
                                   extensions=["jinja2.ext.loopcontrols", _Generation])

        def strftime_now(fmt):
            if isinstance(fmt, str):                  # '%c' is some 24 characters: 64 for any field
                _need(len(fmt) + 64 * fmt.count("%"), "strftime_now(): a result")
            return datetime.now().strftime(fmt)

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        lipsum = env.globals["lipsum"]

        def bounded_lipsum(n=5, html=True, min=20, max=100):      # noqa: A002 - Jinja's own names
            for v in (n, min, max):
                if not isinstance(v, int) or v > 1000:
                    raise _TooBig(f"lipsum() with an argument of {v!r:.20} (integers up to 1,000 only)")
            return lipsum(n, html, min, max)

        env.globals["lipsum"] = bounded_lipsum       # n paragraphs in a Python loop the trace does not see
        try:
            self._template = env.from_string(source)
        except JinjaError as e:
            raise TemplateError(f"{origin}: the chat template does not parse: {_one_line(e)}") from None
        except Exception as e:  # noqa: BLE001 - RecursionError (nesting), MemoryError, a bug in Jinja: still this file's
            raise TemplateError(f"{origin}: the chat template does not parse: {type(e).__name__}: "
                                f"{_one_line(e)}") from None
        self.source, self.special, self.origin = source, special, origin
        self._jinja_error = JinjaError
        self._code = {"<template>"}          # the file name Jinja compiles a template from a string under

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatTemplate | None:
        """The folder's template, or None when it has none."""
        folder = Path(folder)
        cfg_file = folder / "tokenizer_config.json"
        try:
            cfg = json.loads(_read(cfg_file, "tokenizer config", 64 * 2**20)) if cfg_file.is_file() else {}
        except (ValueError, RecursionError) as e:         # not JSON, nested too deeply, a 5,000-digit number
            raise TemplateError(f"{cfg_file}: cannot read it ({type(e).__name__}: {_one_line(e)})") from None
        if not isinstance(cfg, dict):
            raise TemplateError(f"{cfg_file}: expected a JSON object, got {type(cfg).__name__}")
        special = {k: t for k in _SPECIAL if (t := _token_text(cfg.get(k))) is not None}
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(_read(jinja_file, "chat template", MAX_TEMPLATE_BYTES), special, str(jinja_file))
        tpl = cfg.get("chat_template")
        if isinstance(tpl, list):                 # named templates: the default one
            tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
        if not isinstance(tpl, str) or not tpl.strip():
            return None
        if len(tpl) > MAX_TEMPLATE_BYTES:
            raise TemplateError(f"{cfg_file}: chat_template: {len(tpl):,} characters is too large for a chat "
                                f"template (limit {MAX_TEMPLATE_BYTES:,})")
        return cls(tpl, special, f"{cfg_file}: chat_template")

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt these messages make, within :data:`RENDER_SECONDS`, :data:`MAX_OUTPUT_CHARS`
        and :data:`MAX_BUILT_BYTES`; a TemplateError (one line) when the template refuses them,
        fails on them, or passes a bound."""
        deadline = time.monotonic() + RENDER_SECONDS
        out, n = [], 0
        meter = _Meter(MAX_BUILT_BYTES)
        meter.learn(messages)
        meter.learn(self.special)
        outer = getattr(_ACTIVE, "meter", None)
        _ACTIVE.meter = meter
        try:
            with _time_limit(deadline, self._code):
                for chunk in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                     tools=None, documents=None, **self.special):
                    n += len(chunk)
                    if n > MAX_OUTPUT_CHARS:
                        raise TemplateError(f"{self.origin}: the chat template wrote more than {MAX_OUTPUT_CHARS:,} "
                                            "characters for these messages (its output limit)")
                    out.append(chunk)
        except _OutOfTime:
            raise TemplateError(f"{self.origin}: the chat template ran longer than its {RENDER_SECONDS:g} s limit on "
                                "these messages") from None
        except _TooBig as e:
            raise TemplateError(f"{self.origin}: the chat template built {_one_line(e)}") from None
        except _TooDeep as e:
            raise TemplateError(f"{self.origin}: the chat template {_one_line(e)}") from None
        except TemplateError as e:
            raise TemplateError(_one_line(e)) from None
        except self._jinja_error as e:
            raise TemplateError(f"{self.origin}: the chat template failed on these messages: {_one_line(e)}") from None
        except MemoryError:
            raise TemplateError(f"{self.origin}: the chat template ran out of memory on these messages") from None
        except Exception as e:  # noqa: BLE001 - a template bug (e.g. a missing key) is still the template's
            raise TemplateError(f"{self.origin}: the chat template failed on these messages: "
                                f"{type(e).__name__}: {_one_line(e)}") from None
        finally:
            _ACTIVE.meter = outer
        return "".join(out)


def _read(path: Path, what: str, limit: int) -> str:
    """A small text file of the model folder, or a TemplateError naming it."""
    try:
        size = path.stat().st_size
        if size > limit:
            raise TemplateError(f"{path}: {size:,} bytes is too large for a {what} (limit {limit:,})")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TemplateError(f"{path}: cannot read the {what} ({_one_line(e)})") from None


class _time_limit:
    """While rendering: a trace function that ends the render (:class:`_OutOfTime`) once
    ``deadline`` passes, checked on every line of the template's own code (``code``: the file
    names its code is compiled under) - a loop of loops that writes nothing ends too.  Only
    there: raised on entering a library function, the error could land in a generator's
    finalizer, which swallows it (and Python then drops the trace function).  What one template
    line can make a library do is bounded by the size checks.  The thread's previous trace
    function (a debugger, coverage) is put back after."""

    def __init__(self, deadline: float, code: set[str]) -> None:
        self.deadline, self.code, self.old = deadline, code, None

    def _line(self, frame, event, arg):
        if event == "line" and time.monotonic() > self.deadline:
            raise _OutOfTime
        return self._line

    def _call(self, frame, event, arg):
        return self._line if frame.f_code.co_filename in self.code else None

    def __enter__(self):
        self.old = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc):
        sys.settrace(self.old)
        return False
