"""A checkpoint's own chat template, applied as transformers applies it.

A model folder may carry a Jinja chat template: ``chat_template`` in ``tokenizer_config.json``
(a string, or a list of ``{"name", "template"}`` of which ``default`` is used), or a
``chat_template.jinja`` file (which wins, as in transformers).  It is rendered the way
``PreTrainedTokenizerBase.apply_chat_template`` renders it: a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, the variables ``messages``, ``add_generation_prompt``
(true: the prompt ends where the assistant's answer begins) and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...), the helpers ``raise_exception`` and ``strftime_now``,
``tojson`` with its keyword arguments, and the ``{% generation %}`` tag (its body).  Text parts
of a message (``"content": [{"type": "text", ...}]``) reach the template as the list they are.
The rendered text already holds any BOS the template writes, so it is tokenized without the
tokenizer's own special tokens (``add_special_tokens=False``), again as transformers does.

A template that raises (``raise_exception("roles must alternate")``) gives a :class:`TemplateError`
with its message: the server answers it as a 400 on ``messages`` and goes on serving.

A template is bounded.  Rendering stops with a TemplateError naming the template when it runs
longer than :data:`RENDER_SECONDS` (checked on every line the template executes: a loop of loops
that writes nothing ends too), writes more than :data:`MAX_OUTPUT_CHARS` characters, or nests
calls (a macro calling itself) more than :data:`MAX_CALL_DEPTH` deep; and no single value it
builds may be larger than the output limit -
``'x' * 10**9``, ``'x' | center(10**9)``, ``'{:>999999999}'.format(x)``, ``10 ** 10 ** 9``, a
string doubled in a loop - each refused before (or as soon as) it is built, so a template cannot
take the server's memory.  The sandbox stays: ``cycler.__init__.__globals__`` and the like are
refused as they were.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from workbench.errors import WorkbenchError

# The bounds of one render (see the module docstring).
RENDER_SECONDS = 2.0
MAX_OUTPUT_CHARS = 2**20          # 1 MiB of ASCII text: some 250,000 tokens, past any context here
# A template file larger than this is refused unread (the largest real templates are a few tens of kB).
MAX_TEMPLATE_BYTES = 4 * 2**20
# Calls (macros, recursive loops) nested deeper than this end the render: a macro calling itself
# would otherwise reach Python's recursion limit - and, with C frames between its Python ones and
# the render's trace function, could overflow the C stack first (a segmentation fault).
MAX_CALL_DEPTH = 64


class TemplateError(WorkbenchError):
    """The template refused these messages, or could not be rendered."""


class _OutOfTime(BaseException):
    """Raised into the template's code by the render's trace function.  A BaseException: code
    between the template and us that catches Exception does not end the render's time limit."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class _TooBig(TemplateError):
    """A value the template builds is past :data:`MAX_OUTPUT_CHARS` (an Exception, unlike the time
    limit: Jinja's constant folding at parse time must be able to decline it)."""


class _TooDeep(TemplateError):
    """Calls nested past :data:`MAX_CALL_DEPTH`."""


def _too_big(what: str, n: int | float) -> TemplateError:
    return _TooBig(f"{what} of {n:,.0f} characters or items, above its limit of {MAX_OUTPUT_CHARS:,}")


def _size(v) -> int:
    return len(v) if isinstance(v, (str, bytes, list, tuple, dict, set, frozenset)) else 0


def _check_result(v, what: str):
    if _size(v) > MAX_OUTPUT_CHARS:
        raise _too_big(what, _size(v))
    return v


_WIDTH = re.compile(r"\d{7,}")


def _check_format_string(fmt, what: str) -> None:
    """A %-format or str.format string whose width or precision alone is past the limit."""
    if isinstance(fmt, str):
        for m in _WIDTH.finditer(fmt):
            if int(m.group()) > MAX_OUTPUT_CHARS:
                raise _too_big(f"{what}: a field width", int(m.group()))


def _check_args(args, kwargs, what: str) -> None:
    """An integer argument past the limit (``center(10**9)``, ``'x'.ljust(10**9)``) is refused
    before the call builds what it asks for (used for filters' arguments and string methods;
    a global such as a macro may take any number)."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_OUTPUT_CHARS:
            raise _too_big(f"{what}: an argument", abs(v))


def _check_join(items, what: str) -> None:
    if isinstance(items, (list, tuple)):
        total = sum(len(x) for x in items if isinstance(x, str))
        if total > MAX_OUTPUT_CHARS:
            raise _too_big(what, total)


def _check_binop(op: str, left, right) -> None:
    """Refuse before computing: a sequence repeated past the limit, a power with more bits than
    the limit's characters, a %-format with a huge width."""
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if _size(seq) and isinstance(n, int) and _size(seq) * n > MAX_OUTPUT_CHARS:
                raise _too_big("'*': a repeated value", _size(seq) * n)
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1 \
                and right * abs(left).bit_length() > 8 * MAX_OUTPUT_CHARS:
            raise _too_big("'**': a power", right * abs(left).bit_length() / 3.3)
    elif op == "%" and isinstance(left, str):
        _check_format_string(left, "'%'")
        if "*" in left:                                  # '%*d' % (width, value): the width is an argument
            _check_args(right if isinstance(right, tuple) else (right,), {}, "'%'")


_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_text(v) -> str | None:
    if isinstance(v, dict):                       # {"content": "<s>", "lstrip": ..., ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


def _bounded_environment(**options):
    """Jinja's immutable sandbox with every value-building operation bounded (see the module
    docstring): the binary operators ``*``, ``**``, ``+``, ``%`` and ``~`` (concatenation), every
    call of a global, a method or a filter."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generator(CodeGenerator):
        def visit_Concat(self, node, frame):           # a ~ b ~ c: its result checked
            self.write("environment.bounded_concat(")
            super().visit_Concat(node, frame)
            self.write(")")

    depth = threading.local()

    class Bounded(ImmutableSandboxedEnvironment):
        code_generator_class = Generator
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return _check_result(super().call_binop(context, operator, left, right), f"'{operator}': a result")

        def bounded_concat(self, value):
            return _check_result(value, "'~': a result")

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's own signature
            name = getattr(__obj, "__name__", type(__obj).__name__)
            owner = getattr(__obj, "__self__", None)
            if owner is None:                          # the sandbox's own wrapper of str.format
                owner = getattr(getattr(__obj, "__wrapped__", None), "__self__", None)
            if isinstance(owner, (str, bytes)):        # 'x'.ljust(10**9), .center, .zfill, .expandtabs ...
                _check_args(args, kwargs, f"{name}()")
                if name in ("format", "format_map"):
                    _check_format_string(owner, f"{name}()")
                elif name == "join" and args:
                    _check_join(args[0], "join(): the joined text")
            level = getattr(depth, "level", 0)
            if level >= MAX_CALL_DEPTH:
                raise _TooDeep(f"nests calls more than {MAX_CALL_DEPTH} deep (a macro calling itself?)")
            depth.level = level + 1
            try:
                result = super().call(__context, __obj, *args, **kwargs)
            finally:
                depth.level = level
            return _check_result(result, f"{name}(): a result")

    env = Bounded(**options)
    for name, f in list(env.filters.items()):
        env.filters[name] = _bounded_filter(name, f)
    return env


def _bounded_filter(name: str, f):
    value_at = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0     # after the context / environment

    @functools.wraps(f)          # keeps jinja_pass_arg (pass_context / pass_environment / ...)
    def bounded(*args, **kwargs):
        what = f"filter '{name}'"
        _check_args(args[value_at + 1:], kwargs, what)         # center(10**9); the value itself may be any number
        if name == "format" and args:
            _check_format_string(next((a for a in args if isinstance(a, str)), None), what)
        if name == "join":
            for a in args:
                _check_join(a, f"{what}: the joined text")
        return _check_result(f(*args, **kwargs), f"{what}: a result")
    return bounded


def _generation_extension():
    from jinja2.ext import Extension

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

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env.filters["tojson"] = _bounded_filter("tojson", tojson)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
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
    def from_folder(cls, folder: str | Path) -> "ChatTemplate | None":
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
        return cls(tpl, special, f"{cfg_file}: chat_template")

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt these messages make, within :data:`RENDER_SECONDS` and
        :data:`MAX_OUTPUT_CHARS`; a TemplateError (one line) when the template refuses them,
        fails on them, or passes either bound."""
        deadline = time.monotonic() + RENDER_SECONDS
        out, n = [], 0
        try:
            with _time_limit(deadline, self._code):
                for chunk in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                     **self.special):
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
        except Exception as e:  # noqa: BLE001 - a template bug (e.g. a missing key) is still the template's
            raise TemplateError(f"{self.origin}: the chat template failed on these messages: "
                                f"{type(e).__name__}: {_one_line(e)}") from None
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
