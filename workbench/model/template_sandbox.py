"""The sandbox a chat template renders in (:mod:`workbench.model.chat_template`): Jinja's immutable
sandbox with every value-building operation bounded.

* The methods a template can call: :data:`GROWING_METHODS` are bounded before they build
  (``_METHOD_BOUNDS``: an upper bound on the result; ``join``, ``str.format``), the others
  (:data:`LINEAR_METHODS`) are measured after.  A method the sandbox reaches fails
  tests/fuzz/test_fuzz_chat_template.py until it is classified here.
* ``_bounded_environment``: the environment - the binary operators ``*``, ``**``, ``+``, ``%`` and
  ``~``, list, tuple and dict literals, slices, every call of a global, a method or a filter (the
  filters of :mod:`workbench.model.template_filters`), the text of a block or macro and of an
  output, and calls nested at most :data:`~workbench.model.template_budget.MAX_CALL_DEPTH` deep.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping
from functools import update_wrapper
from types import BuiltinMethodType, MethodType

from workbench.model.template_budget import (
    _ACTIVE,
    _UNMETERED,
    MAX_CALL_DEPTH,
    MAX_OUTPUT_CHARS,
    _check_args,
    _check_binop,
    _check_format_spec,
    _int,
    _meter,
    _need,
    _too_big,
    _TooDeep,
)
from workbench.model.template_filters import _bounded_filter, _filter_replacements

# ---- the methods: what grows, and what cannot ---------------------------------------------------
# Methods of str / bytes / Markup (and int.to_bytes) a template can call that build more than a
# constant factor of their input: padded to a width, tabs expanded, a piece replaced or joined in
# once per occurrence or item, a translation table's strings, format fields.
GROWING_METHODS = frozenset({"center", "expandtabs", "format", "format_map", "join", "ljust", "replace", "rjust",
                             "to_bytes", "translate", "zfill"})
# The methods of str, bytes, Markup, list, tuple, dict, its views, int, float and range that the
# immutable sandbox lets a template call, other than the growing ones: a bool, a number or an
# index; the text or its pieces (split, partition, strip, case changes); an encoding (encode:
# 12 bytes for one character at most, 'xmlcharrefreplace'; hex: 3 characters a byte; decode, the
# bytes as text); a copy (copy, fromkeys: a key per item); an escape (Markup.escape: 5 for one).
LINEAR_METHODS = frozenset({
    "as_integer_ratio", "bit_count", "bit_length", "capitalize", "casefold", "conjugate", "copy", "count",
    "decode", "encode", "endswith", "escape", "find", "from_bytes", "fromhex", "fromkeys", "get", "hex", "index",
    "is_integer", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit", "isdisjoint", "isidentifier", "islower",
    "isnumeric", "isprintable", "isspace", "istitle", "isupper", "items", "keys", "lower", "lstrip", "maketrans",
    "partition", "removeprefix", "removesuffix", "rfind", "rindex", "rpartition", "rsplit", "rstrip", "split",
    "splitlines", "startswith", "strip", "striptags", "swapcase", "title", "unescape", "upper", "values"})


# ---- the growing methods, bounded --------------------------------------------------------------------------

def _m_width(s, width=0, *_, **__):
    return max(len(s), _int(width))


def _m_expandtabs(s, tabsize=8, *_, **__):
    tab = "\t" if isinstance(s, str) else b"\t"
    return len(s) + s.count(tab) * max(_int(tabsize), 0)


def _m_replace(s, old, new, count=-1, *_, **__):
    from markupsafe import Markup  # lazy: markupsafe / jinja2 (~75 ms) only once a chat template is compiled

    n = s.count(old) if len(old) else len(s) + 1
    if _int(count, -1) >= 0:
        n = min(n, count)
    escape = 5 if isinstance(s, Markup) else 1                 # Markup.replace escapes new: '<' -> '&lt;'
    return len(s) + n * max(0, escape * len(new) - len(old))


def _m_translate(s, table, *_, **__):
    if isinstance(table, Mapping):
        values = table.values()
    elif isinstance(table, (list, tuple)):
        values = table
    else:
        values = ()
    longest = max((len(v) for v in values if isinstance(v, (str, bytes))), default=1)
    return len(s) * max(longest, 1)


def _m_to_bytes(n, length=1, *_, **__):
    return _int(length)


_METHOD_BOUNDS = {"center": _m_width, "ljust": _m_width, "rjust": _m_width, "zfill": _m_width,
                  "expandtabs": _m_expandtabs, "replace": _m_replace, "translate": _m_translate,
                  "to_bytes": _m_to_bytes}


def _method_join(s, args, kwargs, what: str):
    """``sep.join(items)``: the items read once (into a list, passed on), their lengths and the
    separator once per item checked before joining."""
    from markupsafe import Markup

    if kwargs or len(args) != 1:
        return args
    items = list(args[0])
    esc = 5 if isinstance(s, Markup) else 1
    total = max(len(items) - 1, 0) * len(s)
    for x in items:
        total += esc * (len(x) if isinstance(x, (str, bytes, bytearray)) else _meter().size(x))
        if total > MAX_OUTPUT_CHARS:
            break
    _need(total, f"{what}: the joined text")
    return (items,)


def _formatters():
    from jinja2.sandbox import SandboxedEscapeFormatter, SandboxedFormatter

    class Bounded(SandboxedFormatter):
        """``str.format`` whose fields are checked as they are written: a width or precision past
        the limit before it is padded, the text so far after each field."""

        def __init__(self, env, what: str, **kwargs) -> None:
            super().__init__(env, **kwargs)
            self.what, self.n = what, 0

        def vformat(self, format_string, args, kwargs):
            self.n = len(format_string)
            return super().vformat(format_string, args, kwargs)

        def format_field(self, value, format_spec):
            _check_format_spec(format_spec, self.what)
            if not isinstance(value, str):
                _need(_meter().size(value), f"{self.what}: a field")
            out = super().format_field(value, format_spec)
            self.n += len(out)
            _need(self.n, f"{self.what}: a result")
            return out

    class BoundedEscape(Bounded, SandboxedEscapeFormatter):
        pass

    return Bounded, BoundedEscape


def _code_generator():
    """Jinja's code generator, writing the bounds into a template's code: ``a ~ b`` through the
    environment's ``bounded_concat``, list, tuple and dict literals and slices through its ``checked``."""
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator, optimizeconst

    class Generator(CodeGenerator):
        @optimizeconst
        def visit_Concat(self, node, frame):            # a ~ b ~ c: built piece by piece, checked
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

        def _checked(self, visit, node, frame, what: str):
            try:                                          # ['user', 'system']: as large as the template's text
                node.as_const(frame.eval_ctx)
                return visit(node, frame)
            except nodes.Impossible:
                pass
            self.write("environment.checked(")
            visit(node, frame)
            self.write(f", {what!r})")

        def visit_List(self, node, frame):              # [x, x, x]: references, but its text is theirs
            self._checked(super().visit_List, node, frame, "a list")

        def visit_Dict(self, node, frame):
            self._checked(super().visit_Dict, node, frame, "a dict")

        def visit_Tuple(self, node, frame):
            if node.ctx == "load":
                self._checked(super().visit_Tuple, node, frame, "a tuple")
            else:                                         # a target: {% for a, b in ... %}
                super().visit_Tuple(node, frame)

        def visit_Getitem(self, node, frame):           # x[a:b]: a copy
            if isinstance(node.arg, nodes.Slice):
                self._checked(super().visit_Getitem, node, frame, "a slice")
            else:
                super().visit_Getitem(node, frame)

    return Generator


def _bounded_concat(values):
    """``a ~ b``: each side's text (a value's text is within the limit), the total checked
    before the join."""
    m, parts, n = getattr(_ACTIVE, "meter", None) or _UNMETERED, [], 0
    for v in values:
        if not isinstance(v, str):
            _need(m.size(v), "'~': a result")
            v = str(v)
        n += len(v)
        if n > MAX_OUTPUT_CHARS:
            raise _too_big("'~': a result", n)
        parts.append(v)
    out = "".join(parts)
    if m.budget is not None:
        m.built += sys.getsizeof(out)
        if m.built > m.budget:
            raise m._over("'~'")
    return out


def _concat(pieces):
    """The text of a block, a macro, a ``{% set %}`` block, a filter block: the pieces it
    wrote, counted before they are joined (they may be one long string many times)."""
    m, parts, n = _meter(), [], 0
    for s in pieces:
        n += len(s)
        _need(n, "a block's or macro's text")
        parts.append(s)
    out = "".join(parts)
    m.charge(sys.getsizeof(out), "a block's or macro's text")
    return out


def _str_format_wrapper(env, value, formatter_class, escape_formatter_class):
    """Jinja's sandboxed ``str.format`` / ``format_map`` of ``value``, its fields bounded by the
    formatters of :func:`_formatters`; None for any other callable."""
    from markupsafe import Markup

    if not isinstance(value, (MethodType, BuiltinMethodType)) or value.__name__ not in ("format",
                                                                                        "format_map"):
        return None
    f_self = value.__self__
    if not isinstance(f_self, str):
        return None
    what = f"{value.__name__}()"
    if isinstance(f_self, Markup):
        formatter = escape_formatter_class(env, what, escape=f_self.escape)
    else:
        formatter = formatter_class(env, what)
    str_type, is_format_map = type(f_self), value.__name__ == "format_map"

    def wrapper(*args, **kwargs):
        if is_format_map:
            if kwargs:
                raise TypeError("format_map() takes no keyword arguments")
            if len(args) != 1:
                raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
            kwargs, args = args[0], ()
        return str_type(formatter.vformat(f_self, args, kwargs))

    return update_wrapper(wrapper, value)       # a function: call() sees no str owner, the formatter bounds it


def _check_method_call(name: str, owner, args, kwargs):
    """A call of a str / bytes method or of ``int.to_bytes``: its arguments checked and its result
    bounded before it is built.  Returns the arguments to call it with (``join``'s items, read once)."""
    if isinstance(owner, (str, bytes, bytearray)):
        what = f"{name}()"                        # 'x'.ljust(10**9), .center, .zfill, .expandtabs ...
        _check_args(args, kwargs, what)
        if name == "join":
            args = _method_join(owner, args, kwargs, what)
        elif name in _METHOD_BOUNDS:
            try:
                est = _METHOD_BOUNDS[name](owner, *args, **kwargs)
            except (TypeError, ValueError, AttributeError):
                est = 0                           # arguments the method itself refuses
            _need(est, f"{what}: a result")
    elif isinstance(owner, int) and name == "to_bytes":         # (1).to_bytes(10**9)
        _check_args(args, kwargs, f"{name}()")
        try:
            est = _m_to_bytes(owner, *args, **kwargs)
        except TypeError:
            est = 0
        _need(est, f"{name}(): a result")
    return args


def _bounded_environment(**options):
    """Jinja's immutable sandbox with every value-building operation bounded (see the module
    docstring): the binary operators ``*``, ``**``, ``+``, ``%`` and ``~`` (concatenation), list,
    tuple and dict literals, slices, every call of a global, a method or a filter, the text of a
    block or macro (``concat``) and of an output (``finalize``)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    depth = threading.local()
    Formatter, EscapeFormatter = _formatters()

    class Bounded(ImmutableSandboxedEnvironment):
        code_generator_class = _code_generator()
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        bounded_concat = staticmethod(_bounded_concat)
        concat = staticmethod(_concat)

        def call_binop(self, context, operator, left, right):
            if type(left) is str:                        # the common cases, kept short
                if operator == "+" and type(right) is str:
                    _need(len(left) + len(right), "'+': a result")
                    return _meter().checked(left + right, "'+': a result", (left, right))
                if operator == "*" and type(right) is int:
                    _need(len(left) * right, "'*': a repeated value")
                    return _meter().checked(left * right, "'*': a result", (left, right))
            _check_binop(operator, left, right)
            return _meter().checked(super().call_binop(context, operator, left, right), f"'{operator}': a result",
                                    (left, right))

        @staticmethod
        def checked(value, what: str):
            return _meter().checked(value, what)

        def wrap_str_format(self, value):
            """Jinja's sandboxed ``str.format`` / ``format_map``, its fields bounded."""
            return _str_format_wrapper(self, value, Formatter, EscapeFormatter)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's own signature
            name = getattr(__obj, "__name__", type(__obj).__name__)
            args = _check_method_call(name, getattr(__obj, "__self__", None), args, kwargs)
            level = getattr(depth, "level", 0)
            if level >= MAX_CALL_DEPTH:
                raise _TooDeep(f"nests calls more than {MAX_CALL_DEPTH} deep (a macro calling itself?)")
            depth.level = level + 1
            try:
                result = super().call(__context, __obj, *args, **kwargs)
            finally:
                depth.level = level
            return _meter().checked(result, f"{name}(): a result", args)

    env = Bounded(finalize=_finalize, **options)
    replaced = _filter_replacements()
    for name, f in list(env.filters.items()):
        env.filters[name] = _bounded_filter(name, replaced.get(name, f))
    return env


def _finalize(value):
    """``{{ value }}``: the text of a value that is not a string, measured first and counted."""
    if isinstance(value, str):
        return value
    m = _meter()
    _need(m.size(value), "an output value")
    text = str(value)
    m.charge(sys.getsizeof(text), "an output value")
    return text
