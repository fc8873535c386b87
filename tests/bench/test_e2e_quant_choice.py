"""The stack's quantization scheme chosen per model (workbench.bench.e2e_quant_choice), on the
bundled model at tiny sizes.

Timings are this machine's: which scheme wins is not asserted, only that the choice follows the
rule from the measured rows.  Asserted: every row is measured; the perplexity change is the
number the ablation itself reports for that scheme; a bound below every candidate leaves the
stack without quantization, saying why; the cache answers a repeated call, is keyed on the
bound and the model's files, and a corrupt cache file is measured again and rewritten.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time

import pytest

from workbench.bench.e2e_quant_choice import (
    QuantChoice,
    choose_stack_quant,
    device_candidates,
    model_identity,
    stack_quant_key,
)
from workbench.errors import ConfigError

TINY = dict(eval_docs=1, eval_context=64, eval_tokens=32)
PAIR = ("w8a8", "w8a16")


@pytest.fixture(scope="module")
def llm(bundled_llm):
    return bundled_llm


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("stack-quant")


@pytest.fixture(scope="module")
def first(llm, cache):
    return choose_stack_quant(llm, None, 0.02, candidates=PAIR, rounds=3, cache_dir=cache, **TINY)


def test_the_choice_follows_the_rule_from_measured_rows(first):
    assert isinstance(first, QuantChoice) and not first.cached
    assert first.scheme in (None, *PAIR)
    assert [r["scheme"] for r in first.table] == [None, *PAIR]
    for r in first.table:
        for k in ("prefill_ms", "decode_b1_ms", "decode_b8_ms", "score"):
            assert r[k] > 0 and math.isfinite(r[k]), (r["scheme"], k, r[k])
        assert len(r["scores"]) == 3
        assert math.isfinite(r["rel_ppl"]) and r["rel_ppl_se"] >= 0
    for r in first.table[1:]:
        assert r["within_bound"] == (r["rel_ppl"] <= 0.02)
        assert isinstance(r["faster_than_fp"], bool) and r["verdict"]
    qualified = [r for r in first.table[1:] if r["within_bound"] and r["faster_than_fp"]]
    want = min(qualified, key=lambda r: r["score"])["scheme"] if qualified else None
    assert first.scheme == want
    assert [r["scheme"] for r in first.table if r["chosen"]] == [first.scheme]
    assert (first.scheme or "no quantization layer") in first.reason
    text = first.describe()
    assert all(s in text for s in PAIR) and "unquantized" in text and first.reason in text


def test_rel_ppl_is_the_number_the_ablation_reports(first, llm):
    from workbench.bench.end_to_end import Ablation, E2EConfig, WorkloadConfig, build_workload

    cfg = E2EConfig.preset("tiny", quant="w8a8", alone=(), stack=("quant",), reference_row=False, **TINY)
    wl = build_workload(llm.tokenizer, WorkloadConfig.preset("tiny"), max_model_len=llm.max_model_len)
    ab = Ablation(llm, wl, cfg, model=None).build()
    try:
        ab.measure_quality()
    finally:
        ab.close()
    q = ab.config("stack: quant").quality
    row = next(r for r in first.table if r["scheme"] == "w8a8")
    assert row["rel_ppl"] == pytest.approx(q["rel_ppl"], rel=1e-9, abs=1e-12)
    assert row["rel_ppl_se"] == pytest.approx(q["rel_ppl_se"], rel=1e-9, abs=1e-12)


def test_a_repeated_call_is_answered_by_the_cache(first, llm, cache):
    t0 = time.perf_counter()
    again = choose_stack_quant(llm, None, 0.02, candidates=PAIR, rounds=3, cache_dir=cache, **TINY)
    assert time.perf_counter() - t0 < 1.0
    assert again.cached and again.key == first.key and again.scheme == first.scheme
    assert again.table == json.loads(json.dumps(first.table)) and again.reason == first.reason
    assert (cache / f"{first.key}.json").is_file()


def test_a_bound_below_every_candidate_leaves_no_quantization_layer(llm, cache):
    qc = choose_stack_quant(llm, None, -1.0, candidates=("w8a8",), rounds=1, cache_dir=cache, **TINY)
    assert qc.scheme is None and not qc.cached
    assert "no quantization layer" in qc.reason and "perplexity" in qc.reason and "w8a8" in qc.reason
    assert [r["chosen"] for r in qc.table] == [True, False] and not qc.table[1]["within_bound"]
    k_low, _ = stack_quant_key(llm, None, -1.0, ("w8a8",), rounds=1, **TINY)
    k_slo, _ = stack_quant_key(llm, None, 0.02, ("w8a8",), rounds=1, **TINY)
    assert qc.key == k_low and k_low != k_slo


def test_a_corrupt_cache_file_is_measured_again_and_rewritten(llm, tmp_path):
    kw = dict(candidates=("w8a8",), rounds=1, cache_dir=tmp_path, **TINY)
    qc = choose_stack_quant(llm, None, 0.02, **kw)
    path = tmp_path / f"{qc.key}.json"
    for bad in ("{ not json", json.dumps({"format": "workbench-stack-quant", "key": qc.key, "scheme": "w4a8"})):
        path.write_text(bad)
        redo = choose_stack_quant(llm, None, 0.02, **kw)
        assert not redo.cached and redo.key == qc.key
        assert json.loads(path.read_text())["key"] == qc.key
        assert choose_stack_quant(llm, None, 0.02, **kw).cached
    assert not choose_stack_quant(llm, None, 0.02, refresh=True, **kw).cached


def test_the_key_follows_the_models_files(llm, tmp_path):
    import workbench

    folder = tmp_path / "model"
    shutil.copytree(workbench.BUNDLED_MODEL, folder)
    before = model_identity(folder)
    assert before["folder"] == str(folder.resolve()) and "model.safetensors" in [f[0] for f in before["files"]]
    assert model_identity(None)["folder"] == str(workbench.BUNDLED_MODEL.resolve())
    key = stack_quant_key(llm, folder, 0.02)[0]
    st = (folder / "model.safetensors").stat()
    os.utime(folder / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert stack_quant_key(llm, folder, 0.02)[0] != key
    assert stack_quant_key(llm, folder, 0.02, ("w8a8",))[0] != stack_quant_key(llm, folder, 0.02)[0]
    assert stack_quant_key(llm, folder, 0.02, eval_docs=1)[0] != stack_quant_key(llm, folder, 0.02)[0]


def test_bad_input_is_one_line_naming_it(llm, tmp_path):
    assert device_candidates("cpu") == ("w8a8", "w8a16:head", "w8a16")
    assert device_candidates("cuda:0") == ("w4a16:g128", "w8a16")
    for kw, words in ((dict(candidates=("w3a16",)), "candidate 'w3a16'"), (dict(candidates=()), "candidates"),
                      (dict(candidates=("w8a8", "w8a8")), "twice"), (dict(eval_context=1), "eval_context"),
                      (dict(rounds=0), "rounds")):
        with pytest.raises(ConfigError, match=words) as e:
            choose_stack_quant(llm, None, 0.02, cache_dir=tmp_path, **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="max_rel_ppl"):
        choose_stack_quant(llm, None, "2 %", cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="no model folder"):
        choose_stack_quant(llm, tmp_path / "missing", 0.02, cache_dir=tmp_path)
    assert not list(tmp_path.iterdir())
