"""The claims lab's core: a claim, its finding, the run's context, and running them.

Every testable claim of the two source articles, measured here, with a verdict (the package
:mod:`workbench.bench.claims`; the claims themselves are listed in
:mod:`~workbench.bench.claims.catalogue`, the table / text / JSON of a run are in
:mod:`~workbench.bench.claims.report`).

::

    results = run_claims(mode="smoke")                 # every claim, small sizes (about a minute on 2 cores)
    results = run_claims(["prefix_ttft_spread"], mode="full")
    print(format_claims(results)); claims_table(results)   # text / DataFrame
    workbench claims --json                               # the same from the command line

A claim (:class:`Claim`) is one sentence of an article with its number, where it comes from
(``A §…`` is ``seeds/000_…``, the "GPT Pro 4x" field report; ``B §…`` is ``seeds/001_…``, the
architecture teardown), the layer it is about, and a ``measure`` function that returns a
:class:`Finding`: the measured figure, the verdict and the reason for it.

**Verdicts.**

* ``holds`` / ``does not hold``: measured in this run.  A verdict rests on a comparison beyond
  the machine's measured noise (:mod:`workbench.measure.compare`: interleaved runs, ranges that
  do not overlap, ratios beyond the noise floor) or on an exact count (bytes, hit rates,
  launches).  A claimed effect that this run cannot separate from the noise *does not hold*
  here, and the finding says how large an effect the run could have seen.
* ``cannot be tested here``: the claim needs something this machine does not have; the reason
  says what.  Claims marked ``device="cpu"`` are built to be measured on any CPU, so for them
  this verdict is recorded as a defect (:func:`~workbench.bench.claims.report.problems`).
* ``not measured``: a GPU claim with no committed GPU results (``results/gpu/``) to read.
* ``error``: the measurement raised; the error is recorded and the other claims still run.

The article's absolute numbers (ms on an H100, QPS of a hosted service) are not this machine's;
each finding says which part of a claim is checked: the mechanism and its direction, the ratio,
or the exact figure when the claim is arithmetic (bytes of a KV cache).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

HOLDS = "holds"
FAILS = "does not hold"
UNTESTABLE = "cannot be tested here"
NOT_MEASURED = "not measured"
ERROR = "error"
VERDICTS = (HOLDS, FAILS, UNTESTABLE, NOT_MEASURED, ERROR)
MODES = ("smoke", "full")

SOURCES = {"A": "seeds/000_065ae5fdb3d95309.txt (the 'GPT Pro 4x' field report)",
           "B": "seeds/001_0eb65aeb4169625e.txt (the architecture teardown)"}


@dataclass
class Finding:
    """What a measurement found: the verdict, the figure in one line, and why."""

    verdict: str
    figure: str                                   # "TTFT sd 3.1 -> 0.4 ms; hit rate 96.0 %"
    reason: str                                   # the comparison and the noise behind the verdict
    values: dict[str, Any] = field(default_factory=dict)    # the numbers, JSON-ready
    table: list[dict] | None = None               # rows behind the figure (optional)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"Finding: verdict {self.verdict!r} is not one of {VERDICTS}")


@dataclass(frozen=True)
class Claim:
    """One testable claim of an article and the function that measures it."""

    id: str
    claim: str                                    # the article's statement, with its number
    source: str                                   # "A §2 (layer 2)", "B §5.3"
    layer: str                                    # "prefix cache", "scheduler", "serving", ...
    device: str                                   # "cpu": measured on any machine; "gpu": read from results/gpu
    measure: Callable[[ClaimContext], Finding]


@dataclass
class ClaimResult:
    """One row of the claims table."""

    id: str
    claim: str
    source: str
    layer: str
    device: str
    verdict: str
    figure: str
    reason: str
    values: dict[str, Any]
    table: list[dict] | None
    seconds: float
    error: str | None = None

    def to_dict(self) -> dict:
        return _jsonable(asdict(self))


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and v != v:            # NaN -> null
        return None
    if hasattr(v, "item") and getattr(v, "shape", None) == ():
        return _jsonable(v.item())
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


class ClaimContext:
    """What the claims share in one run: the mode, one loaded model, the noise floor, a scratch dict.

    ``ctx.llm()`` loads the model once (the thread count measured once) and returns the same
    ``LLM``; build other engines on ``ctx.llm().loaded`` (``LLMEngine(ctx.llm().loaded, ...)``)
    so that nothing loads twice.  ``ctx.size(smoke, full)`` picks a size by mode.
    ``ctx.noise`` is the relative noise floor of this machine (one probe per run).
    ``ClaimContext(llm=llm, probe=probe)`` reuses a model and a noise probe a notebook has already.
    """

    def __init__(self, mode: str = "smoke", model=None, device: str | None = "cpu", threads=None,
                 gpu_root=None, llm=None, probe=None) -> None:
        if mode not in MODES:
            from workbench.errors import ConfigError
            raise ConfigError(f"claims: mode must be one of {MODES}, got {mode!r}")
        self.mode, self.model, self.device, self.threads, self.gpu_root = mode, model, device, threads, gpu_root
        self.smoke = mode == "smoke"
        self.scratch: dict[str, Any] = {}
        self._llm = llm             # an LLM already loaded (a notebook's): reused, not loaded again
        self._probe = probe         # a noise probe already taken (the notebook's), else one when first needed
        self._closers: list[Callable[[], None]] = []    # on_close() / close(): resources of this run

    def size(self, smoke, full):
        return smoke if self.smoke else full

    def llm(self):
        if self._llm is None:
            from workbench.engine.llm import LLM

            self._llm = LLM(self.model, device=self.device, threads=self.threads)
        return self._llm

    @property
    def probe(self):
        if self._probe is None:
            from workbench.measure.probe import noise_probe

            self._probe = noise_probe()
        return self._probe

    @property
    def noise(self) -> float:
        return float(self.probe.threshold)

    # ---- resources a run opens (a server, engine threads): released by close() -------------------
    def on_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when this run's resources are released (:meth:`close`; :func:`run_claims`
        calls it when its claims are done): stop a server or engine thread a claim started and
        cached in ``scratch``.  Called last-registered first."""
        self._closers.append(fn)

    def close(self) -> None:
        """Release what the claims opened (every ``on_close`` function, last first; one that raises
        does not stop the others).  The loaded model stays; a later claim may open things again."""
        errors = []
        while self._closers:
            fn = self._closers.pop()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - release the rest, then say what failed
                errors.append(f"{getattr(fn, '__qualname__', fn)}: {type(e).__name__}: {e}")
        if errors:
            raise RuntimeError("claims: closing the run's resources failed: " + "; ".join(errors))
    # ---- end of on_close / close -------------------------------------------------------------------

    def gpu_table(self, name: str):
        """The newest committed GPU table ``name`` (``workbench.measure.gpu_results.latest``), or None."""
        from workbench.measure import gpu_results

        return gpu_results.latest(name, root=self.gpu_root)


def all_claims() -> list[Claim]:
    """Every claim, in the order of the articles' layers."""
    from workbench.bench.claims.catalogue import (
        CLAIMS,  # imported when used: its modules import this one
    )

    out = list(CLAIMS)
    ids = [c.id for c in out]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise RuntimeError(f"claims: duplicate ids {dup}")
    return out


def select(ids=None) -> list[Claim]:
    """The claims named by ``ids`` (a list or a comma-separated string), all when None."""
    claims = all_claims()
    if not ids:
        return claims
    if isinstance(ids, str):
        ids = [i.strip() for i in ids.split(",") if i.strip()]
    by_id = {c.id: c for c in claims}
    unknown = [i for i in ids if i not in by_id]
    if unknown:
        from workbench.errors import ConfigError
        raise ConfigError(f"claims: unknown claim id(s) {unknown}; known: {', '.join(by_id)}")
    return [by_id[i] for i in ids]


def measure_claim(claim: Claim, ctx: ClaimContext) -> ClaimResult:
    """Measure one claim; a measurement that raises becomes an ``error`` row (never raises)."""
    t0 = time.perf_counter()
    err = None
    try:
        f = claim.measure(ctx)
        if not isinstance(f, Finding):
            raise TypeError(f"{claim.id}: measure returned {type(f).__name__}, expected a Finding")
    except Exception as e:  # noqa: BLE001 - one claim's failure must not end the others
        err = f"{type(e).__name__}: {e}"
        tb = traceback.format_exc(limit=4)
        f = Finding(ERROR, "-", f"the measurement raised {err}", values={"traceback": tb})
    return ClaimResult(id=claim.id, claim=claim.claim, source=claim.source, layer=claim.layer, device=claim.device,
                       verdict=f.verdict, figure=f.figure, reason=f.reason, values=dict(f.values), table=f.table,
                       seconds=time.perf_counter() - t0, error=err)


def run_claims(ids=None, mode: str = "smoke", model=None, device: str | None = "cpu", threads=None,
               gpu_root=None, progress=False, ctx: ClaimContext | None = None) -> list[ClaimResult]:
    """Measure the claims named by ``ids`` (all when None), one after another, in one context.
    ``progress``: True prints a line per claim; a callable ``progress(k, n, claim_id)`` is called
    before the k-th of n claims, and with k == n at the end (a notebook's progress bar)."""
    claims = select(ids)
    ctx = ctx or ClaimContext(mode=mode, model=model, device=device, threads=threads, gpu_root=gpu_root)
    out = []
    step = progress if callable(progress) else None
    progress = bool(progress) and step is None
    try:
        for k, c in enumerate(claims):
            if step is not None:
                step(k, len(claims), c.id)
            if progress:
                print(f"[claims] {c.id} ...", flush=True)
            r = measure_claim(c, ctx)
            if progress:
                print(f"[claims] {c.id}: {r.verdict} ({r.seconds:.1f} s): {r.figure}", flush=True)
            out.append(r)
        if step is not None:
            step(len(claims), len(claims), "")
    finally:
        try:
            ctx.close()      # servers / engine threads the claims started (ClaimContext.on_close)
        except RuntimeError as e:   # the results stand; what could not be released is said
            import warnings

            warnings.warn(str(e), RuntimeWarning, stacklevel=2)
    return out
