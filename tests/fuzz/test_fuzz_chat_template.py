"""Fuzzing chat templates (:mod:`workbench.serve.chat_template`: a checkpoint's Jinja template, as
``workbench serve`` renders it).  Templates are drawn from a grammar of what real templates do
(loops over the messages, conditions, filters, ``tojson``, macros, ``{% generation %}``) and of
what a hostile or broken one does (loops of loops, values doubled in a loop, ``'x' * 10**9``,
``center(10**9)``, huge format widths and powers, recursion, ``raise_exception``, sandbox escapes,
undefined names, syntax errors), then rendered on drawn messages.

The outcome is a rendered prompt within the limits (at most MAX_OUTPUT_CHARS characters, in
about RENDER_SECONDS) or a one-line TemplateError naming the template (or, from
``raise_exception``, the template's own words) - never another exception, never a hang, never
memory the limits do not allow.  The fuzzer runs with the time limit lowered to 0.25 s (the
mechanism is the same; the real 2 s limit is tested once below).  The server answers such a
template with a 400 on ``messages`` and goes on serving (one request over HTTP, below).
"""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzkit import MiB, Shown, check_refusal, fuzz, note, outcome

from workbench.serve import chat_template as ct
from workbench.serve.chat_template import MAX_OUTPUT_CHARS, RENDER_SECONDS, ChatTemplate, TemplateError

ORIGIN = "fuzzed/chat_template.jinja"
FUZZ_SECONDS = 0.25
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
NUMBERS = [0, 1, 2, 3, 7, 100, 1000, 100_000, 1_000_000, 2**20, 2**20 + 1, 10**7, 10**9, 10**18, -1, -10**9]


# ---- the grammar ----------------------------------------------------------------------------------------

def _expr(leaf):
    """Expressions built from smaller ones: what grows, what fails, what escapes."""
    n = st.sampled_from(NUMBERS).map(str)
    return st.one_of(
        st.tuples(leaf, n).map(lambda t: f"({t[0]} * {t[1]})"),
        st.tuples(leaf, leaf).map(lambda t: f"({t[0]} ~ {t[1]})"),
        st.tuples(leaf, leaf).map(lambda t: f"({t[0]} + {t[1]})"),
        st.tuples(n, n).map(lambda t: f"({t[0]} ** {t[1]})"),
        st.tuples(leaf, n).map(lambda t: f"({t[0]} | center({t[1]}))"),
        st.tuples(leaf, n).map(lambda t: f"({t[0]} | indent({t[1]}))"),
        st.tuples(leaf, n).map(lambda t: f"({t[0]} | truncate({t[1]}))"),
        st.tuples(leaf, n).map(lambda t: f"({t[0]} | wordwrap({t[1]}))"),
        leaf.map(lambda e: f"({e} | replace('a', 'aaaaaaaaaa'))"),
        leaf.map(lambda e: f"({e} | join)"), leaf.map(lambda e: f"({e} | list)"), leaf.map(lambda e: f"({e} | upper)"),
        leaf.map(lambda e: f"({e} | tojson)"), leaf.map(lambda e: f"({e} | length)"), leaf.map(lambda e: f"[{e}]"),
        st.tuples(n, leaf).map(lambda t: f"('%{t[0]}s' % {t[1]})"),
        st.tuples(n, leaf).map(lambda t: f"('{{:>{t[0]}}}'.format({t[1]}))"),
        st.tuples(leaf, n).map(lambda t: f"({t[0]}.ljust({t[1]}) if {t[0]} is string else {t[0]})"),
        st.tuples(leaf, leaf).map(lambda t: f"({t[0]} if {t[1]} else {t[1]})"),
        n.map(lambda k: f"lipsum({k})"), n.map(lambda k: f"(range({k}) | list)"), n.map(lambda k: f"(1 / {k})"),
    )


LEAVES = st.sampled_from([
    "'a'", "'x' * 1000", "bos_token", "eos_token", "m", "m['content']", "m.role", "messages", "messages[0]",
    "messages[-1]['content']", "messages | length", "add_generation_prompt", "loop.index", "ns.s", "n", "1", "0",
    "none", "undefined_name", "undefined_name.attr", "m['missing']['x']", "cycler.__init__.__globals__",
    "''.__class__.__mro__", "range.__self__", "strftime_now('%Y')", "raise_exception('RAISED: ' ~ m.role)",
    "{'a': 1}", "[1, 2] | sum", "messages | map(attribute='role') | join(',')", "namespace(s='x').s",
])
EXPRS = st.recursive(LEAVES, _expr, max_leaves=4)
TEXT = st.sampled_from(["<|user|>\n", "\n", " ", "A", "{#c#}", "}", "%", "\\", "é", "<|assistant|>"])


def _stmt(body):
    n = st.sampled_from(NUMBERS).map(str)
    return st.one_of(
        body.map(lambda b: f"{{% for m in messages %}}{b}{{% endfor %}}"),
        st.tuples(n, body, st.sampled_from(["", "{% if loop.index > 2 %}{% break %}{% endif %}", "{% continue %}"]))
        .map(lambda t: f"{{% for i in range({t[0]}) %}}{t[1]}{t[2]}{{% endfor %}}"),
        st.tuples(EXPRS, body, body).map(lambda t: f"{{% if {t[0]} %}}{t[1]}{{% else %}}{t[2]}{{% endif %}}"),
        EXPRS.map(lambda e: f"{{% set ns = namespace(s={e}) %}}"),
        st.just("{% set ns.s = ns.s ~ ns.s %}"),
        body.map(lambda b: f"{{% macro f(n) %}}{b}{{{{ f(n) }}}}{{% endmacro %}}{{{{ f(1) }}}}"),
        body.map(lambda b: f"{{% generation %}}{b}{{% endgeneration %}}"),
        st.lists(body, min_size=2, max_size=3).map("".join),
    )


ATOMS = st.one_of(EXPRS.map(lambda e: "{{ " + e + " }}"), TEXT)
TEMPLATES = st.recursive(ATOMS, _stmt, max_leaves=6).map(
    lambda b: "{% set ns = namespace(s='x') %}" + b)

ROLES = st.sampled_from(["system", "user", "assistant", "tool", "", "ROLE"])
CONTENT = st.one_of(st.text(max_size=20), st.sampled_from(["a" * 10_000, "{{ bos_token }}", "\x00"]), st.none(),
                    st.integers(),
                    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}), max_size=3))
MESSAGES = st.lists(st.fixed_dictionaries({"role": ROLES, "content": CONTENT}), min_size=1, max_size=4)


@st.composite
def template_source(draw):
    src = draw(TEMPLATES)
    if draw(st.integers(0, 9)) == 0:                       # a typo somewhere
        i = draw(st.integers(0, len(src)))
        typo = draw(st.sampled_from(["{", "}", "%", "{%", "%}", "{{", "}}", ")", "(", "'", "", "{% break %}"]))
        src = src[:i] + typo + src[i + draw(st.integers(0, 2)):]
    return src


# ---- the check ------------------------------------------------------------------------------------------

def render_case(src: str, messages, seconds: float):
    """Build and render under the limits; returns the outcome, checked."""
    kind, got = outcome(lambda: ChatTemplate(src, SPECIAL, ORIGIN).render(messages), (TemplateError,),
                        seconds=seconds + 10, max_bytes=96 * MiB)
    if kind == "ok":
        assert isinstance(got, str) and len(got) <= MAX_OUTPUT_CHARS
        return kind, got
    msg = str(got)
    if msg.startswith("RAISED"):                           # the template's own words, one line
        check_refusal(got, ["RAISED"])
    else:
        check_refusal(got, [ORIGIN])
    return kind, got


def _timed(src, messages, limit):
    t0 = time.perf_counter()
    kind, got = render_case(src, messages, limit)
    took = time.perf_counter() - t0
    # one template line may finish the work it started (each bounded by the size checks) after the limit
    assert took < limit + 2.0, f"the render took {took:.2f} s (limit {limit} s)"
    return kind, got, took


@pytest.fixture
def short_limit(monkeypatch):
    monkeypatch.setattr(ct, "RENDER_SECONDS", FUZZ_SECONDS)


@fuzz(ci=120, deadline_ms=15_000)
@given(src=template_source(), messages=MESSAGES)
def test_fuzz_chat_template(short_limit, src, messages):
    kind, got, took = _timed(src, messages, FUZZ_SECONDS)
    if kind == "ok":
        note("rendered")
    else:
        msg = str(got)
        note("refused: " + ("time limit" if "ran longer than" in msg else "output limit" if "wrote more" in msg else
                            "value limit" if "built" in msg else "parse" if "does not parse" in msg else
                            "raise_exception" if msg.startswith("RAISED") else "failed"))


# ---- the limits, and what the fuzzing found -----------------------------------------------------------------

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
MEGABYTES = "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}"
MSGS = [{"role": "user", "content": "Hi"}]


def test_the_limits_are_two_seconds_and_one_mebibyte():
    assert (ct.RENDER_SECONDS, ct.MAX_OUTPUT_CHARS, ct.MAX_CALL_DEPTH) == (2.0, 2**20, 64)


def test_a_loop_that_writes_nothing_ends_at_the_time_limit():
    kind, err, took = _timed(LOOP, MSGS, RENDER_SECONDS)
    assert kind == "error" and f"ran longer than its {RENDER_SECONDS:g} s limit" in str(err)
    assert RENDER_SECONDS <= took < RENDER_SECONDS + 1


@pytest.mark.parametrize("src, needle", [
    (MEGABYTES, "wrote more than 1,048,576 characters"),
    ("{{ 'x' * 1000000000 }}", "'*'"),
    ("{{ 'x' | center(1000000000) }}", "filter 'center'"),
    ("{{ '{:>999999999}'.format(1) }}", "format(): a field width"),
    ("{{ '%999999999d' % 1 }}", "'%': a field width"),
    ("{{ 10 ** 1000000000 }}", "'**'"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "'~'"),
    ("{{ (['x' * 1000000] * 1000) | join }}", "filter 'join'"),
    ("{{ lipsum(1000000) }}", "lipsum()"),
])
def test_what_would_take_the_memory_is_refused_before_it_is_built(src, needle):
    kind, err, took = _timed(src, MSGS, RENDER_SECONDS)
    assert kind == "error" and needle in str(err) and took < 1.5, (str(err), took)


@pytest.mark.parametrize("src", [
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{% macro g(x) %}{{ x | upper }}{% endmacro %}{% macro f(n) %}{% for m in messages %}{{ g(m.role) }}{% endfor %}"
    "{{ (f(n) ~ 'a') | replace('a', 'b') }}{% endmacro %}{{ f(1) }}",
    "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
])
def test_a_macro_calling_itself_ends_at_the_call_depth_limit(src):
    """A macro recursing through loops and filters, under the render's trace function, crashed the
    long fuzz run with a segmentation fault (the C stack, before Python's recursion limit); calls
    are now nested at most MAX_CALL_DEPTH deep.  Rendered from 400 frames down, as under a server."""
    def deep(k):
        return deep(k - 1) if k else _timed(src, MSGS, RENDER_SECONDS)

    kind, err, _ = deep(400)
    assert kind == "error" and f"nests calls more than {ct.MAX_CALL_DEPTH} deep" in str(err)


def test_the_sandbox_stays():
    kind, err, _ = _timed("{{ cycler.__init__.__globals__ }}", MSGS, RENDER_SECONDS)
    assert kind == "error" and "unsafe" in str(err)


@pytest.mark.parametrize("files, needle", [
    # not UTF-8: UnicodeDecodeError escaped from_folder
    ({"chat_template.jinja": b"\xff\xfe{{ x }}"}, "chat_template.jinja: cannot read the chat template"),
    # tokenizer_config.json a list: AttributeError ('list' object has no attribute 'get')
    ({"tokenizer_config.json": b"[]"}, "tokenizer_config.json: expected a JSON object"),
    ({"tokenizer_config.json": b"[" * 100_000}, "tokenizer_config.json: cannot read it"),
    # nesting past the parser's recursion: RecursionError escaped the constructor
    ({"chat_template.jinja": b"{{ " + b"(" * 100_000 + b"1" + b")" * 100_000 + b" }}"}, "does not parse"),
    ({"tokenizer_config.json": json.dumps({"chat_template": "{{ " + "[" * 50_000 + "1" + "]" * 50_000 + " }}"})
      .encode()}, "does not parse"),
])
def test_template_files_found_by_fuzzing_are_refused_by_name(tmp_path, files, needle):
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    kind, err = outcome(lambda: ChatTemplate.from_folder(tmp_path), (TemplateError,), seconds=30)
    assert kind == "error" and needle in check_refusal(err, [tmp_path])


def test_a_raise_exception_message_is_one_line():
    with pytest.raises(TemplateError) as e:
        ChatTemplate("{{ raise_exception('roles must\nalternate') }}", {}, ORIGIN).render(MSGS)
    assert str(e.value) == "roles must alternate"


def test_break_outside_a_loop_is_a_parse_error():
    """Jinja compiles it to Python that does not compile: SyntaxError escaped the constructor (the
    server would not start on such a checkpoint)."""
    with pytest.raises(TemplateError, match="does not parse: SyntaxError: 'break' outside loop") as e:
        ChatTemplate("{% if true %}{% break %}{% endif %}", {}, ORIGIN)
    check_refusal(e.value, [ORIGIN])


def test_the_previous_trace_function_is_put_back():
    import sys

    calls = []

    def tracer(frame, event, arg):
        calls.append(event)
        return None

    sys.settrace(tracer)
    try:
        ChatTemplate("{{ messages | length }}", {}, "t").render(MSGS)
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


# ---- over HTTP: a 400 on messages, and the server goes on serving --------------------------------------------

@pytest.fixture(scope="module")
def srv(random_llm):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from workbench.engine import LLMEngine
    from workbench.kv.paged import PagedKVConfig
    from workbench.sched import SchedulerConfig
    from workbench.serve import ServerConfig, start_server

    eng = LLMEngine(random_llm, kv=PagedKVConfig(block_size=16, num_blocks=64),
                    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128))
    with start_server(eng, ServerConfig(port=0, model_name="fuzz")) as handle:
        yield handle


def test_the_server_answers_a_runaway_template_with_a_400_and_goes_on(srv):
    httpx = pytest.importorskip("httpx")
    state = srv.app.state.server
    saved = state.chat_template
    body = {"messages": MSGS, "max_tokens": 2, "temperature": 0}
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            for src, needle in ((LOOP, "s limit"), (MEGABYTES, "wrote more than")):
                state.chat_template = ChatTemplate(src, {}, "fuzz chat template")
                t0 = time.perf_counter()
                r = http.post("/v1/chat/completions", json=body)
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["param"] == "messages" and needle in err["message"]
                assert "fuzz chat template" in err["message"]
                assert time.perf_counter() - t0 < RENDER_SECONDS + 5
            state.chat_template = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}", {}, "fine")
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
            assert http.get("/health").status_code == 200
    finally:
        state.chat_template = saved
