"""claim_verdicts names where its GPU rows come from (a committed table, or this run's own rows)."""

from workbench.bench.quant import claim_verdicts

ROW = {"m": 1, "N": 4096, "K": 4096, "w4a16_ms": 0.02, "w4a16_ms_min": 0.019, "w4a16_ms_max": 0.021,
       "dense_ms": 0.05, "dense_ms_min": 0.049, "dense_ms_max": 0.051}


def test_the_gpu_claim_says_where_its_rows_come_from():
    committed = [v for v in claim_verdicts(gpu_rows=[ROW]) if "GPU" in v["claim"]]
    here = [v for v in claim_verdicts(gpu_rows=[ROW], gpu_where="measured in this run") if "GPU" in v["claim"]]
    assert "(latest committed table, m = 1)" in committed[0]["claim"]
    assert "(measured in this run, m = 1)" in here[0]["claim"] and here[0]["verdict"] == "supported"
    none = [v for v in claim_verdicts() if "GPU" in v["claim"]]
    assert none[0]["verdict"] == "not measured here"
