"""Notebook 06's exercise: the configuration to recommend for a stated SLO."""

from __future__ import annotations

from workbench.bench.e2e_recommend import SLO, recommend
from workbench.exercises.core import Case, Exercise, show


def _pick(rows: list[dict], ttft_p95_ms: float, max_rel_ppl: float, noise: float) -> str | None:
    return recommend(rows, SLO(ttft_p95_ms=ttft_p95_ms, max_rel_ppl=max_rel_ppl), noise=noise)["pick"]


def _row(name: str, layers: int, ttft: list[float], tps: list[float], rel_ppl: float | None = 0.0,
         memory: int | None = 1000) -> dict:
    return {"name": name, "layers": [f"layer{i}" for i in range(layers)], "ttft_ms_p95": list(ttft),
            "tokens_per_s": list(tps), "rel_ppl": rel_ppl, "agreement": None, "memory_bytes": memory}


def _cases() -> list[Case]:
    base = _row("baseline", 0, [400, 410, 420], [100, 101, 102])
    paged = _row("paged+prefix", 2, [200, 205, 210], [150, 152, 155])
    quant = _row("w8a8", 1, [150, 160, 170], [200, 205, 210], rel_ppl=0.001)
    return [
        Case("the highest throughput that meets the SLO", dict(rows=[base, paged, quant], ttft_p95_ms=450.0,
                                                                max_rel_ppl=0.02, noise=0.05)),
        Case("nothing meets the SLO: None", dict(rows=[base, paged, quant], ttft_p95_ms=100.0, max_rel_ppl=0.02,
                                                  noise=0.05)),
        Case("nothing was measured", dict(rows=[], ttft_p95_ms=500.0, max_rel_ppl=0.02, noise=0.05)),
        Case("within the bound at the median but not in every run: it does not meet it",
             dict(rows=[base, _row("window", 1, [300, 310, 480], [300, 305, 310])], ttft_p95_ms=450.0,
                  max_rel_ppl=0.02, noise=0.05)),
        Case("a bound equal to the slowest run is met", dict(rows=[base, paged], ttft_p95_ms=210.0, max_rel_ppl=0.02,
                                                              noise=0.05)),
        Case("fast enough, but the quality is not: it does not meet the SLO",
             dict(rows=[base, paged, _row("int4", 1, [100, 105, 110], [400, 410, 420], rel_ppl=0.05)],
                  ttft_p95_ms=450.0, max_rel_ppl=0.02, noise=0.05)),
        Case("no perplexity measured (None): exact, it counts as 0",
             dict(rows=[base, _row("priorities", 1, [300, 305, 310], [110, 111, 112], rel_ppl=None)],
                  ttft_p95_ms=450.0, max_rel_ppl=0.0, noise=0.05)),
        Case("a tie within noise: the fewest layers win",
             dict(rows=[_row("stack", 4, [150, 155, 160], [200, 215, 230]), quant], ttft_p95_ms=450.0,
                  max_rel_ppl=0.02, noise=0.05)),
        Case("a tie on throughput and layers: the least memory wins",
             dict(rows=[_row("tiers", 2, [200, 205, 210], [150, 151, 152], memory=500), paged],
                  ttft_p95_ms=450.0, max_rel_ppl=0.02, noise=0.05)),
        Case("two runs a side: too few for a verdict, so everything that meets the SLO ties",
             dict(rows=[_row("stack", 3, [100, 110], [400, 410]), _row("paged", 1, [300, 310], [100, 105])],
                  ttft_p95_ms=450.0, max_rel_ppl=0.02, noise=0.05)),
    ]


def _strategy():
    from hypothesis import strategies as st

    @st.composite
    def kw(draw):
        runs = draw(st.integers(1, 4))
        rows = []
        for i in range(draw(st.integers(0, 4))):
            rows.append({"name": f"c{i}", "layers": [f"l{j}" for j in range(draw(st.integers(0, 3)))],
                         "ttft_ms_p95": [float(draw(st.integers(1, 8)) * 50) for _ in range(runs)],
                         "tokens_per_s": [float(draw(st.integers(90, 110)) if draw(st.booleans())
                                                else draw(st.integers(1, 8)) * 50) for _ in range(runs)],
                         "rel_ppl": draw(st.sampled_from([None, 0.0, 0.01, 0.02, 0.05])), "agreement": None,
                         "memory_bytes": draw(st.sampled_from([None, 100, 200, 300]))})
        return dict(rows=rows, ttft_p95_ms=float(draw(st.integers(1, 8)) * 50),
                    max_rel_ppl=draw(st.sampled_from([0.0, 0.01, 0.02])),
                    noise=draw(st.sampled_from([0.0, 0.05, 0.2])))
    return kw()


def _compare(kw: dict, got, expected) -> str | None:
    if got is not None and not isinstance(got, str):
        return f"return a configuration's name (a str) or None, got {type(got).__name__} {show(got)}"
    if got == expected:
        return None
    slo = SLO(ttft_p95_ms=kw["ttft_p95_ms"], max_rel_ppl=kw["max_rel_ppl"])
    rec = recommend(kw["rows"], slo, noise=kw["noise"])
    table = {t["config"]: t for t in rec["table"]}
    head = f"expected {show(expected)}, got {show(got)}\n"
    if got is not None and got not in table:
        return head + f"{got!r} is not one of the measured configurations ({', '.join(table) or 'none'})"
    if got is not None and not table[got]["meets"]:
        return head + f"{got} does not meet the SLO: {table[got]['why']}"
    if expected is None:
        return head + f"{rec['reason']}: return None"
    if got is None:
        return (head + f"{expected} meets the SLO (its slowest run's P95 TTFT {table[expected]['ttft_ms_p95_worst']:g} "
                f"ms <= {kw['ttft_p95_ms']:g} ms, perplexity within +{100 * kw['max_rel_ppl']:g} %): recommend the "
                "best of those that meet it")
    g, e = table[got], table[expected]
    lead = max((t for t in rec["table"] if t["meets"]), key=lambda t: t["tokens_per_s_median"])
    if got not in rec["tied"]:
        return (head + f"{got}'s throughput ({g['tokens_per_s_median']:g} tokens/s, median) is lower than "
                f"{lead['config']}'s ({lead['tokens_per_s_median']:g}) beyond noise (compare_samples: a winner): of "
                "the configurations that meet the SLO, the highest median throughput leads, and only those within "
                "noise of it tie")
    return (head + f"{got} and {expected} tie within noise of the highest throughput ({lead['config']}): of the tied, "
            f"the fewest layers win ({got}: {g['layers']}, {expected}: {e['layers']}), then the least memory "
            f"({got}: {g['memory_bytes']}, {expected}: {e['memory_bytes']}; None counts as 0), then the higher median "
            f"throughput ({g['tokens_per_s_median']:g}, {e['tokens_per_s_median']:g}), then the earlier row")


EXERCISES = [
    Exercise(
        id="06.pick", notebook="06_end_to_end", title="The configuration to recommend for an SLO",
        teaches="why an SLO is met only when every run meets it, why a faster configuration within noise is not "
                "faster, and how a tie is broken towards the simpler configuration",
        statement=(
            "`rows` are the measured configurations (`name`, `layers`: a list, `ttft_ms_p95` and `tokens_per_s`: "
            "one value per run, `rel_ppl`: the relative perplexity increase or `None` for exact, `memory_bytes`). "
            "A configuration *meets* the SLO when every run's P95 TTFT is at most `ttft_p95_ms` and its `rel_ppl` "
            "is at most `max_rel_ppl`. Of those, the highest median throughput leads, and every other one whose "
            "throughput is within noise of it ties with it; of the tied, return the one with the fewest layers, "
            "then the least memory. Return its `name`, or `None` when nothing meets the SLO. \"Within noise\" is "
            "the workbench's rule for every comparison: `compare_samples(a, b, names=(..., ...), noise=noise, "
            "lower_is_better=False).winner is None`."),
        hints=["Keep the configurations that meet the SLO: `max(row[\"ttft_ms_p95\"]) <= ttft_p95_ms` (the slowest "
               "run, not the median) and `rel_ppl` None or `<= max_rel_ppl`. None left: return None.",
               "The leader is the one with the highest `statistics.median(tokens_per_s)`; the tied are the leader "
               "and every other whose `compare_samples(...)` against it has no winner.",
               "`min(tied, key=lambda r: (len(r[\"layers\"]), r[\"memory_bytes\"] or 0, -median(r[\"tokens_per_s\"])))"
               "[\"name\"]`, with the leader first in `tied`, then the others in row order."],
        stub=('import statistics\n\n'
              'from workbench.measure.compare import compare_samples   # the noise rule every comparison uses\n\n\n'
              'def pick(rows: list[dict], ttft_p95_ms: float, max_rel_ppl: float, noise: float) -> str | None:\n'
              '    """The name of the configuration to recommend for the SLO, or None when none meets it."""\n'
              '    # your code here\n'
              '    raise NotImplementedError'),
        reference=_pick, cases=_cases, strategy=_strategy, compare=_compare,
        plugs_into="section 6: the recommendation printed for the stated SLO, and every position of the SLO "
                   "explorer's slider (slo_choices(..., pick=pick))",
        examples=100),
]
