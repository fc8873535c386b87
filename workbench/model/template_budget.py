"""The bounds of one chat-template render (:mod:`workbench.model.chat_template`): its limits, the
meter that measures and counts what a template builds, and the checks made before a value is built.

* The limits: :data:`RENDER_SECONDS`, :data:`MAX_OUTPUT_CHARS` (the text a render writes, and the
  text any one value prints as), :data:`MAX_BUILT_BYTES` (what one render builds in all),
  :data:`MAX_TEMPLATE_BYTES` (a template file), :data:`MAX_CALL_DEPTH`.
* :class:`TemplateError` and the errors a bound raises (``_TooBig``, ``_TooDeep``).
* ``_Meter``: the size of a value (the length of the text it prints as, walked without printing
  it) and what the render has built so far; ``_meter()`` is the active render's (``_ACTIVE``), or
  one that only measures outside a render.
* Checks before building: ``_need`` (an upper bound on a result against the limit), integer
  arguments (``_check_args``), format specs and ``%``-formats (``_check_format_spec``,
  ``_percent_bound``), the binary operators ``*``, ``**``, ``+`` and ``%`` (``_check_binop``).

The filters and methods that use them are :mod:`workbench.model.template_filters` and
:mod:`workbench.model.template_sandbox`.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView

from workbench.errors import WorkbenchError

# The bounds of one render (see workbench.model.chat_template's docstring).
RENDER_SECONDS = 2.0
MAX_OUTPUT_CHARS = 2**20          # 1 MiB of ASCII text: some 250,000 tokens, past any context here
# What one render may build in all, in bytes (sys.getsizeof of each value built: a string's
# characters at 1, 2 or 4 bytes each, a list's 8 bytes a slot).  A real template builds some 3 times
# its output (each message's content trimmed, concatenated with its role markers): for a 1 MiB
# conversation, 3 MiB of ASCII, 12 MiB of text outside the BMP.
MAX_BUILT_BYTES = 32 * 2**20
# A template file larger than this is refused unread (the largest real templates are a few tens of kB).
MAX_TEMPLATE_BYTES = 4 * 2**20
# Calls (macros, recursive loops) nested deeper than this end the render: a macro calling itself
# would otherwise reach Python's recursion limit - and, with C frames between its Python ones and
# the render's trace function, could overflow the C stack first (a segmentation fault).
MAX_CALL_DEPTH = 64


class TemplateError(WorkbenchError):
    """The template refused these messages, or could not be rendered."""


class _TooBig(TemplateError):
    """A value the template builds is past :data:`MAX_OUTPUT_CHARS`, or what it built in all past
    :data:`MAX_BUILT_BYTES` (an Exception, unlike the time limit: code between the template and
    the check may decline it, and the render still ends with it)."""


class _TooDeep(TemplateError):
    """Calls nested past :data:`MAX_CALL_DEPTH`."""


def _too_big(what: str, n: int | float) -> TemplateError:
    return _TooBig(f"{what} of {n:,.0f} characters or items, above its limit of {MAX_OUTPUT_CHARS:,}")


# ---- measuring values --------------------------------------------------------------------------------

def _repr_len(s) -> int:
    """The length of ``repr(s)`` (a string inside a list prints as its repr), exactly or a bound
    just above it, without building it when the string is printable ASCII."""
    if isinstance(s, str) and s.isascii() and s.isprintable():
        return len(s) + 2 + s.count("\\") + s.count("'")
    if isinstance(s, (bytes, bytearray)):
        return 4 * len(s) + 14
    return len(repr(s))


def _namespace_attrs(x) -> dict | None:
    from jinja2.utils import Namespace  # lazy: jinja2 (~75 ms, with markupsafe) only once a chat template is compiled

    if isinstance(x, Namespace):
        return object.__getattribute__(x, "_Namespace__attrs")
    return None


class _Meter:
    """What one render has built, and the size of values.

    :meth:`size` is the length of the text a value prints as (a bound just above it), walked
    without printing it and given up past ``limit``; containers the render has measured whole
    (the messages, large lists the template built) are remembered, so a list of the messages is
    not walked again and again.  ``budget`` None: outside a render (the sizes only)."""

    def __init__(self, budget: int | None) -> None:
        self.budget, self.built = budget, 0
        self.sizes: dict[int, tuple[object, int]] = {}       # id -> (container, size): measured whole
        self.given: dict[int, object] = {}                    # id -> value: the render's input
        self.saw_namespace = False

    def learn(self, value, depth: int = 0) -> None:
        """Remember the render's input (the messages, the special tokens): returning one of them
        (``messages[0]``, ``default``, ``select``) builds nothing."""
        if depth > 64 or self.budget is None:
            return
        if isinstance(value, str):
            self.given[id(value)] = value
            return
        if isinstance(value, Mapping):
            for k, v in value.items():
                self.learn(k, depth + 1)
                self.learn(v, depth + 1)
        elif isinstance(value, (list, tuple)):
            for v in value:
                self.learn(v, depth + 1)
        else:
            return
        self.given[id(value)] = value
        self.sizes[id(value)] = (value, self.size(value, limit=sys.maxsize))

    def size(self, value, limit: int = MAX_OUTPUT_CHARS, nested: bool = False) -> int:
        """``len(str(value))`` (``repr`` when ``nested``), or a bound just above it; past ``limit``
        the walk stops and returns what it has counted (more than ``limit``)."""
        if isinstance(value, str) and not nested:
            return len(value)
        total, stack, sizes = 0, [(value, nested)], self.sizes
        while stack:
            x, inner = stack.pop()
            t = type(x)
            if t is str:
                total += _repr_len(x) if inner else len(x)
            elif t is int:
                total += x.bit_length() * 3 // 10 + 2
            elif t is list or t is tuple or t is dict:
                hit = sizes.get(id(x))
                if hit is not None and hit[0] is x:
                    total += hit[1]
                elif t is dict:
                    total += 2 + 4 * len(x)
                    if total <= limit:
                        for k, v in x.items():
                            stack.append((k, True))
                            stack.append((v, True))
                else:
                    total += 2 + 2 * len(x)
                    if total > limit:
                        return total
                    try:                                    # a list of strings: measured in C, as one string
                        chars = sum(map(len, x))            # (each item's size is at least its len)
                        if total + chars > limit:
                            return total + chars
                        odd = len(x) - list(map(type, x)).count(str)      # Markup('...'): its name too
                        total += _repr_len("".join(x)) + 2 * len(x) - 2 + 16 * odd
                    except TypeError:                       # not all strings (or a number: no len)
                        stack.extend([(v, True) for v in x])
            elif isinstance(x, str):                       # Markup: its repr is Markup('...')
                total += _repr_len(x) + 16 if inner else len(x)
            elif isinstance(x, (bytes, bytearray)):
                total += 4 * len(x) + 14
            elif isinstance(x, bool) or x is None:
                total += 5
            elif isinstance(x, int):
                total += x.bit_length() * 3 // 10 + 2
            elif isinstance(x, float):
                total += 24
            elif isinstance(x, Mapping):                    # a dict subclass, another mapping
                total += 2 + 4 * len(x)
                if total <= limit:
                    for k, v in x.items():
                        stack.append((k, True))
                        stack.append((v, True))
            elif isinstance(x, (list, tuple, set, frozenset, KeysView, ValuesView, ItemsView)):
                total += 16 + 2 * len(x)
                if total <= limit:
                    stack.extend([(v, True) for v in x])
            elif isinstance(x, range):
                total += 40
            elif (attrs := _namespace_attrs(x)) is not None:
                self.saw_namespace = True
                total += 13
                stack.append((attrs, True))
            else:                              # a macro, a loop, Undefined, a generator: its repr at most
                total += 256
            if total > limit:
                return total
        return total

    def charge(self, n: int, what: str) -> None:
        if self.budget is None:
            return
        self.built += n
        if self.built > self.budget:
            raise self._over(what)

    def _over(self, what: str) -> TemplateError:
        return _TooBig(f"{what}: {self.built:,} bytes of values in all for these messages, above the limit of "
                       f"{self.budget:,} on what one render builds")

    def _new_bytes(self, v, args) -> int:
        """The bytes a result newly takes (its own, not its items': they were counted when built):
        nothing when it is one of the arguments or of the render's input (it was there already)."""
        if self.given.get(id(v)) is v:
            return 0
        for a in args:
            if v is a:
                return 0
        try:
            return sys.getsizeof(v)
        except TypeError:                                 # an object whose __sizeof__ is odd
            return 64

    def checked(self, value, what: str, args=(), count: bool = True):
        """``value`` if its text is within :data:`MAX_OUTPUT_CHARS`, counted towards the render's
        total (``count``: false for a value some other check counted); an iterator is checked item
        by item as it is consumed."""
        if type(value) is str:                            # the common case, kept short: every filter's result
            n = len(value)
            if n > MAX_OUTPUT_CHARS:
                raise _too_big(what, n)
            if count and self.budget is not None and n and self.given.get(id(value)) is not value:
                for a in args:
                    if a is value:
                        return value
                self.built += sys.getsizeof(value)
                if self.built > self.budget:
                    raise self._over(what)
            return value
        if isinstance(value, Iterator) and not isinstance(value, (str, bytes)):
            return self._watch(value, what, count)
        self.saw_namespace = False
        n = self.size(value)
        if n > MAX_OUTPUT_CHARS:
            raise _too_big(what, n)
        if count:
            self.charge(self._new_bytes(value, args), what)
        if (self.budget is not None and n >= 4096 and not self.saw_namespace
                and isinstance(value, (list, tuple, dict))):
            self.sizes[id(value)] = (value, n)       # kept alive with the render: its id stays its own
        return value

    def _watch(self, items, what: str, count: bool):
        for item in items:
            yield self.checked(item, f"{what} (an item)", (), count)


_ACTIVE = threading.local()
_UNMETERED = _Meter(None)          # outside a render (constant folding at parse time): sizes only


def _meter() -> _Meter:
    return getattr(_ACTIVE, "meter", None) or _UNMETERED


def _int(v, default: int = 0) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _text_len(v) -> int:
    return len(v) if isinstance(v, (str, bytes, bytearray)) else _meter().size(v)


def _need(est: int, what: str) -> None:
    """Refuse before building: ``est`` is an upper bound on the size of what would be built."""
    if est > MAX_OUTPUT_CHARS:
        raise _too_big(what, est)


_WIDTH = re.compile(r"\d{7,}")


def _check_format_spec(spec, what: str) -> None:
    """A format spec whose width or precision alone is past the limit."""
    if isinstance(spec, str):
        for m in _WIDTH.finditer(spec):
            if int(m.group()) > MAX_OUTPUT_CHARS:
                raise _too_big(f"{what}: a field width", int(m.group()))


def _check_args(args, kwargs, what: str) -> None:
    """An integer argument past the limit (``center(10**9)``, ``'x'.ljust(10**9)``) is refused
    before the call builds what it asks for (used for filters' arguments and string methods;
    a global such as a macro may take any number)."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_OUTPUT_CHARS:
            raise _too_big(f"{what}: an argument", abs(v))


# A product or power with more bits than this is refused before it is computed (315,000 decimal
# digits; Python prints at most 4,300 of them): multiplying such numbers takes long in C, where the
# render's time limit cannot stop it.
_MAX_INT_BITS = 2**20
_PERCENT = re.compile(r"%(?:\(([^()]*)\))?([-#0 +]*)(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.)", re.S)


def _percent_bound(fmt, args, what: str, escape: int = 1) -> int:
    """An upper bound on ``len(fmt % args)``, from the format string's fields and the arguments'
    sizes, before it is built; a width or precision past the limit is refused as such."""
    seq = list(args) if isinstance(args, tuple) else [args]
    mapping = args if isinstance(args, Mapping) else None
    total, i, m = len(fmt), 0, _meter()
    for spec in _PERCENT.finditer(fmt):
        name, _flags, width, prec, conv = spec.groups()
        if conv == "%":
            continue
        w = p = 0
        if width == "*":
            w, i = abs(_int(seq[i] if i < len(seq) else 0)), i + 1
        elif width:
            w = int(width)
        if prec == "*":
            p, i = abs(_int(seq[i] if i < len(seq) else 0)), i + 1
        elif prec:
            p = int(prec)
        if max(w, p) > MAX_OUTPUT_CHARS:
            raise _too_big(f"{what}: a field width", max(w, p))
        if name is not None:
            v = mapping.get(name) if mapping is not None else None
        else:
            v, i = (seq[i] if i < len(seq) else None), i + 1
        if conv in "sra":
            n = m.size(v, nested=conv != "s") * escape
        elif conv == "b":
            n = len(v) if isinstance(v, (bytes, bytearray)) else m.size(v)
        elif conv in "diouxX":
            n = (v.bit_length() + 3 if isinstance(v, int) else 330) + p
        elif conv in "eEfFgG":
            n = 330 + (p or 6)
        elif conv == "c":
            n = 1
        else:                          # a key with parentheses in it ('%(a(b))s'), which the pattern does not
            values = mapping.values() if mapping is not None else seq       # follow: the largest argument
            n = max((m.size(x) for x in values), default=0) * escape
            if n > MAX_OUTPUT_CHARS:
                return total + n
        total += max(w, n)
        if total > MAX_OUTPUT_CHARS:
            return total
    return total


def _check_binop(op: str, left, right) -> None:
    """Refuse before computing: a sequence repeated past the limit, a product or power with more
    bits than the limit's characters, a concatenation past it, a %-format past it."""
    m = _meter()
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and n > 1:
                size = len(seq) if isinstance(seq, (str, bytes)) else m.size(seq)
                if size * n > MAX_OUTPUT_CHARS:
                    raise _too_big("'*': a repeated value", size * n)
        if isinstance(left, int) and isinstance(right, int) \
                and left.bit_length() + right.bit_length() > _MAX_INT_BITS:
            raise _too_big("'*': a product", (left.bit_length() + right.bit_length()) / 3.3)
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1 \
                and right * abs(left).bit_length() > _MAX_INT_BITS:
            raise _too_big("'**': a power", right * abs(left).bit_length() / 3.3)
    elif op == "+":
        if isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
            _need(len(left) + len(right), "'+': a result")
        elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
            _need(m.size(left) + m.size(right), "'+': a result")
    elif op == "%" and isinstance(left, (str, bytes)):
        from markupsafe import Markup

        _need(_percent_bound(left, right, "'%'", 5 if isinstance(left, Markup) else 1), "'%': a result")
