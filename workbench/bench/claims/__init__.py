"""The claims lab: every testable claim of the two source articles, measured here, with a verdict.

::

    from workbench.bench.claims import format_claims, run_claims
    results = run_claims(mode="smoke")                 # every claim, small sizes (about a minute on 2 cores)
    results = run_claims(["prefix_ttft_spread"], mode="full")
    print(format_claims(results)); claims_table(results)   # text / DataFrame
    workbench claims --json                               # the same from the command line

* ``core``: :class:`Claim`, :class:`Finding`, :class:`ClaimResult`, :class:`ClaimContext` (what the
  claims of one run share), :func:`select`, :func:`measure_claim`, :func:`run_claims`; the verdicts;
* ``report``: :func:`claims_table`, :func:`format_claims`, :func:`claims_report` / :func:`dumps`
  (``workbench claims --json``), :func:`problems`, :func:`verdict_counts`;
* ``catalogue``: every claim, in the order of the articles' layers;
* the claims, measured: ``serving_engine``, ``serving_load``, ``serving_requests`` (on the engine,
  ``workbench serve`` and the load generator; their rules in ``serving_rules``, shared pieces in
  ``serving_setup``), ``model_compute``, ``model_memory``, ``model_quality`` (the model, its KV
  memory and its precision; shared pieces in ``model_setup``), ``gpu_stack``, ``gpu_bandwidth``
  (read from the committed GPU results; ``gpu_tables``).

The claims table's view in a notebook is :func:`claims_table` (a DataFrame); the report's front
page (:mod:`workbench.lab.front_page`) shows the table notebook 06 saved.
"""

from workbench.bench.claims.core import (
    ERROR,
    FAILS,
    HOLDS,
    MODES,
    NOT_MEASURED,
    SOURCES,
    UNTESTABLE,
    VERDICTS,
    Claim,
    ClaimContext,
    ClaimResult,
    Finding,
    all_claims,
    measure_claim,
    run_claims,
    select,
)
from workbench.bench.claims.report import (
    claims_report,
    claims_table,
    dumps,
    format_claims,
    problems,
    verdict_counts,
)

__all__ = [
    "ERROR",
    "FAILS",
    "HOLDS",
    "MODES",
    "NOT_MEASURED",
    "SOURCES",
    "UNTESTABLE",
    "VERDICTS",
    "Claim",
    "ClaimContext",
    "ClaimResult",
    "Finding",
    "all_claims",
    "claims_report",
    "claims_table",
    "dumps",
    "format_claims",
    "measure_claim",
    "problems",
    "run_claims",
    "select",
    "verdict_counts",
]
