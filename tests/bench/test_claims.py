"""The claims lab's core (workbench.bench.claims): selection, one failing claim never ends the run,
the rules that make a run incomplete, the JSON document and the CLI.  The claims themselves are
tested in test_claims_serving.py, test_claims_model.py and test_claims_gpu.py."""

from __future__ import annotations

import json

import pytest

from workbench.bench import claims as lab
from workbench.bench.claims import core
from workbench.cli.main import main
from workbench.errors import ConfigError


def _fake_claims():
    def holds(ctx):
        return lab.Finding(lab.HOLDS, "1.0 -> 2.0 ms", "beyond the noise", values={"ratio": 2.0, "nan": float("nan")})

    def boom(ctx):
        raise RuntimeError("no such pool")

    def untestable(ctx):
        return lab.Finding(lab.UNTESTABLE, "-", "needs a GPU")

    def gpu(ctx):
        return lab.Finding(lab.NOT_MEASURED, "-", "no committed GPU results")

    return [lab.Claim("a_holds", "A is 2x", "A §1", "engine", "cpu", holds),
            lab.Claim("b_boom", "B", "A §2", "kv", "cpu", boom),
            lab.Claim("c_untestable", "C", "B §3", "kv", "cpu", untestable),
            lab.Claim("d_gpu", "D is 4x", "B §1", "stack", "gpu", gpu)]


@pytest.fixture()
def fake(monkeypatch):
    monkeypatch.setattr(core, "all_claims", _fake_claims)       # what select() (and run_claims) reads
    monkeypatch.setattr(lab, "all_claims", _fake_claims)        # what `workbench claims --list` reads


def test_a_failing_claim_is_recorded_and_the_run_goes_on(fake):
    res = lab.run_claims(mode="smoke")
    assert [r.id for r in res] == ["a_holds", "b_boom", "c_untestable", "d_gpu"]
    boom = res[1]
    assert boom.verdict == lab.ERROR and "RuntimeError: no such pool" in boom.error
    assert res[0].verdict == lab.HOLDS and res[3].verdict == lab.NOT_MEASURED
    bad = lab.problems(res)
    # the error and the CPU claim without a measured verdict; a GPU claim may be "not measured"
    assert len(bad) == 2 and bad[0].startswith("b_boom") and bad[1].startswith("c_untestable")
    assert lab.verdict_counts(res) == {lab.HOLDS: 1, lab.UNTESTABLE: 1, lab.NOT_MEASURED: 1, lab.ERROR: 1}


def test_selection_by_id_and_unknown_ids(fake):
    assert [c.id for c in lab.select("d_gpu, a_holds")] == ["d_gpu", "a_holds"]
    with pytest.raises(ConfigError, match="unknown claim id.*'nope'.*known: a_holds"):
        lab.select(["nope"])


def test_finding_rejects_an_unknown_verdict():
    with pytest.raises(ValueError, match="verdict 'maybe'"):
        lab.Finding("maybe", "1", "x")


def test_context_checks_the_mode():
    with pytest.raises(ConfigError, match="mode must be one of"):
        lab.ClaimContext(mode="quick")
    ctx = lab.ClaimContext(mode="full")
    assert ctx.size(1, 2) == 2 and not ctx.smoke


def test_json_document_and_text(fake):
    res = lab.run_claims(["a_holds", "d_gpu"])
    doc = json.loads(lab.dumps(res))
    assert doc["meta"]["format"] == "workbench-claims/1"
    assert [c["id"] for c in doc["claims"]] == ["a_holds", "d_gpu"]
    assert doc["claims"][0]["values"] == {"ratio": 2.0, "nan": None}      # NaN is not JSON
    assert doc["problems"] == []
    text = lab.format_claims(res)
    assert "[HOLDS] a_holds" in text and "measured: 1.0 -> 2.0 ms" in text
    assert "2 claims: 1 holds, 1 not measured" in text
    table = lab.claims_table(res)
    assert list(table.index) == ["a_holds", "d_gpu"] and table.loc["a_holds", "verdict"] == "holds"


def test_cli_json_and_exit_status(fake, capsys, tmp_path):
    out = tmp_path / "claims.json"
    assert main(["claims", "--json", "--mode", "smoke", "--only", "a_holds,d_gpu", "--out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["verdict"] for c in doc["claims"]] == ["holds", "not measured"]
    assert json.loads(out.read_text())["claims"][0]["id"] == "a_holds"
    assert main(["claims", "--mode", "smoke", "--only", "b_boom"]) == 1          # an error makes the run incomplete
    captured = capsys.readouterr()
    assert "[ERROR] b_boom" in captured.out and "b_boom: RuntimeError: no such pool" in captured.err
    assert main(["claims", "--only", "nope"]) == 2                                 # a bad id: one line, exit 2
    assert "unknown claim id" in capsys.readouterr().err
    assert main(["claims", "--list"]) == 0
    assert "a_holds" in capsys.readouterr().out


def test_every_registered_claim_is_well_formed():
    claims = lab.all_claims()
    for c in claims:
        assert c.device in ("cpu", "gpu"), c.id
        assert c.source[0] in lab.SOURCES and "§" in c.source, (c.id, c.source)
        assert c.claim and c.layer and callable(c.measure), c.id
