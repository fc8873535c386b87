"""One request's failure never ends another's: failures injected per request (sampling) and per
step (the forward) while others run; every request not in the failed step finishes with its
exact tokens, and the engine keeps serving.  Sampling is safe for every value validation accepts."""

from __future__ import annotations

import asyncio

import pytest

from workbench import LLMEngine, SamplingParams, SchedulerConfig
from workbench.errors import WorkbenchError
from workbench.kv.paged import PagedKVConfig
from workbench.engine import AsyncEngine

PROMPTS = ["The list type", "A function is", "Python's for statement", "To create a virtual environment",
           "The logging module", "When an exception is raised", "Classes provide a means", "The with statement"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(random_llm):
    eng = LLMEngine(random_llm, scheduler=SchedulerConfig(max_num_seqs=1), kv=PagedKVConfig(block_size=4))
    return {p: eng.generate([p], GREEDY)[0].token_ids for p in PROMPTS}


def _engine(random_llm, **sched):
    return LLMEngine(random_llm, scheduler=SchedulerConfig(**{"max_num_seqs": 3, "max_num_batched_tokens": 16,
                                                              **sched}),
                     kv=PagedKVConfig(block_size=4, num_blocks=64))


def fail_step(eng, step: int, message: str) -> dict:
    """Make the forward of engine step ``step`` raise; returns {"ids": the requests in it} once it has."""
    execute, in_step = eng.runner.execute, {}

    def flaky(scheduled):
        if eng.scheduler.step_no == step:
            in_step["ids"] = {s.seq.request_id for s in scheduled}
            raise RuntimeError(message)
        return execute(scheduled)

    eng.runner.execute = flaky
    return in_step


def test_a_failed_step_ends_only_its_requests(random_llm, alone):
    eng = _engine(random_llm)
    in_step = fail_step(eng, 4, "injected forward failure")
    outs = eng.generate(PROMPTS, GREEDY)
    failed = {o.request_id for o in outs if o.finish_reason == "error"}
    assert failed == in_step["ids"] and failed, "exactly the requests of the failed step"
    for o in outs:
        if o.request_id in failed:
            assert "injected forward failure" in o.error and "step 4" in o.error
        else:
            assert o.finish_reason == "length" and o.token_ids == alone[o.prompt], o.request_id
    assert len(failed) < len(PROMPTS) and eng.pool.manager.num_used_blocks == 0
    assert eng.generate(PROMPTS[:1], GREEDY)[0].token_ids == alone[PROMPTS[0]], "the engine keeps serving"


def test_a_failed_sampling_ends_only_its_request(random_llm, alone, failing_sampling):
    eng = _engine(random_llm)
    params = [SamplingParams(temperature=0.7, seed=failing_sampling, max_tokens=8) if i == 2 else GREEDY
              for i in range(len(PROMPTS))]
    outs = eng.generate(PROMPTS, params)
    assert outs[2].finish_reason == "error" and outs[2].error.startswith("sampling failed: RuntimeError")
    assert [o.token_ids for i, o in enumerate(outs) if i != 2] == [alone[p] for i, p in enumerate(PROMPTS) if i != 2]
    assert eng.pool.manager.num_used_blocks == 0


def test_the_offline_front_raises_what_the_engine_isolated(random_llm):
    import workbench

    llm = workbench.LLM(random_llm.model, tokenizer=random_llm.tokenizer)
    execute = llm.engine.runner.execute
    llm.engine.runner.execute = lambda scheduled: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(WorkbenchError, match="boom") as info:
        llm.generate(["The list type", "A function is"], GREEDY)
    assert isinstance(info.value.__cause__, RuntimeError)
    llm.engine.runner.execute = execute
    assert not llm.engine.seqs and llm.generate("The list type", GREEDY)[0].finish_reason == "length"


@pytest.mark.parametrize("params", [SamplingParams(temperature=1e-45, max_tokens=6),
                                    SamplingParams(top_p=1e-46, max_tokens=6, seed=1),
                                    SamplingParams(temperature=1e-30, top_p=1e-46, top_k=1, max_tokens=6)])
def test_sampling_is_safe_for_every_accepted_value(random_llm, alone, params):
    """Once, these ended every stream in the batch ("probability tensor contains inf, nan ...")."""
    eng = _engine(random_llm)
    outs = eng.generate(PROMPTS[:3], [GREEDY, params, GREEDY])
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert outs[0].token_ids == alone[PROMPTS[0]] and outs[2].token_ids == alone[PROMPTS[2]]
    assert outs[1].token_ids == alone[PROMPTS[1]][:6], "a vanishing temperature or top_p is greedy"


def test_under_load_the_async_engine_isolates_and_keeps_serving(random_llm, alone):
    """Streams through the engine thread: one step fails mid-run; the requests outside it
    finish with their exact tokens, the server-side engine stays alive."""
    eng = _engine(random_llm)
    boom = fail_step(eng, 6, "injected")

    async def run():
        with AsyncEngine(eng) as ae:
            async def one(i, p):
                toks, last = [], None
                async for ev in ae.stream(p, GREEDY, request_id=f"r{i}"):
                    if ev.token_id >= 0:
                        toks.append(ev.token_id)
                    last = ev
                return f"r{i}", p, toks, last
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

    results = asyncio.run(run())
    failed = {rid for rid, _, _, last in results if last.finish_reason == "error"}
    assert failed == boom["ids"] and failed
    for rid, p, toks, last in results:
        if rid not in failed:
            assert last.finish_reason == "length" and toks == alone[p], rid
    assert eng.pool.manager.num_used_blocks == 0


def test_generate_cli_with_a_vanishing_temperature(capsys):
    from workbench.cli.main import main

    assert main(["generate", "--model", "preset:tiny", "--device", "cpu", "--token-ids", "1 2 3",
                 "--temperature", "1e-45", "--max-tokens", "4", "--quiet"]) == 0
    assert "Traceback" not in capsys.readouterr().err
