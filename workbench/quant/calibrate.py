"""The precision calibrator: per-layer precision searched against quality *and* measured cost,
on a user's JSONL text (``workbench calibrate-quant``).

::

    res = calibrate("data/calibration/prose.jsonl", target_metric="ppl", max_degradation=0.02,
                    search_space="w8a16,w4a16:g128,w4a8", objective="memory")
    res.recommendation.label, res.recommendation.reasons     # a CalibrationResult; res.as_dict(): its JSON
    write_outputs(res, "runs/calib")      # recipe.json, pareto.csv, sensitivity.csv, report.json, recommendation.txt

**Steps** (every number measured in this run; steps 3 to 7 are the stages of
:mod:`workbench.quant.calibrate_stages`, each with a typed result):

1. **Data.** The file's rows (:func:`workbench.data.read_jsonl`: a bad line is an error naming it)
   are split by row into a *calibration* part (AWQ / GPTQ / SmoothQuant statistics) and an
   *evaluation* part, itself split into a *search* half (every figure the search decides on)
   and a *confirmation* half (:func:`workbench.data.dataset_split`), packed into windows of
   ``context`` tokens; the
   diagnostics say how many tokens each part has, how long the rows are, and how much of the text
   repeats the evaluation part and the bundled held-out perplexity split (8-token n-grams).
2. **Reference.** The unquantized model on the evaluation windows, once
   (:class:`~workbench.quant.quality.Reference`).
3. **Sensitivity.** Every layer alone under every option of the search space
   (:mod:`workbench.quant.sensitivity`): the target metric's degradation per (layer, option).
4. **Costs.** Every (layer, option) measured (:mod:`workbench.quant.costs`): resident bytes
   (``objective="memory"``) or one matrix-vector product's time (``"latency"``).
5. **Candidates.** The uniform mixes (every layer the same option) and the mixes of the
   predicted Pareto front (:func:`~workbench.quant.search.lagrangian_front`); a binary search
   along the front, cheapest first, finds where the *measured* degradation crosses the limit,
   and more front points fill up to ``max_measured`` measured mixes.  Each measured mix is
   quantized for real (:func:`~workbench.quant.apply.quantize_model`, on ``backend``) and scored
   on the search windows: the quality figures in the table are measured, never summed.
6. **Cost, measured.** ``memory``: the whole model's resident bytes (storages + the backend's
   copies).  ``latency``: single-sequence decode steps of every measured mix and of the
   unquantized model, interleaved over ``rounds`` (each round's median of ``decode_steps`` steps
   is one sample), compared with the noise-aware rule of :mod:`workbench.measure.compare`.
7. **Recommendation.** The measured mix of least cost whose measured degradation is within the
   limit on the search text *and* on the confirmation text (the unquantized model always is),
   with its reasons: which layers kept more precision and why, what the uniform alternatives
   measured, and whether its gain over the unquantized model is beyond the noise.  Choosing the
   cheapest mix that passes on one sample of text favours mixes whose noise happened to help
   there (single-layer deltas of a few tenths of a percent are often below their standard
   error); the confirmation half of the evaluation rows never took part in the choice, so the
   figure reported for the recommendation (and written into its recipe file) is measured on text
   the search did not see.
"""

from __future__ import annotations

import dataclasses
import time

from workbench.errors import ConfigError, WorkbenchError
from workbench.quant.calibrate_names import DEFAULT_SPACES, OBJECTIVES   # torch-free: the CLI's parser reads them
from workbench.quant.calibrate_stages import (CalibrationData, CalibrationResult, CalibrationSettings, MixBuilder,
                                              References, Search, SearchResult, Setup, check_given_sensitivity,
                                              confirm, measure_sensitivity)
from workbench.quant.quality import EvalSet, Reference, measure, parse_degradation
from workbench.quant.search import search_space
from workbench.quant.sensitivity import layer_units, linear_targets
from workbench.data import (DATASET_TOKENS_LIMIT, dataset_split, encode_rows, group_field_of, heldout_documents,
                            heldout_split, jsonl_windows, ngram_overlap, read_jsonl)
from workbench.measure.allocation import check_allocation, format_bytes, parse_bytes
from workbench.model.tokenizer import Tokenizer
from workbench.quant.compressed import is_compressed_checkpoint

# Host bytes one dataset token takes while the calibrator holds it: its id in a Python list (an int
# object and a pointer) in the diagnostics and the windows, and its 8-gram tuple in the overlap sets
# (two at a time).  Measured: 190 B a token at dataset_diagnostics' peak (tracemalloc, 400k tokens of
# distinct text, bundled tokenizer); doubled for the text itself, the windows and the allocator.
HELD_BYTES_PER_TOKEN = 400
DEFAULT_SPACE = DEFAULT_SPACES["cpu"]


def default_search_space(device) -> str:
    """:data:`DEFAULT_SPACES` of ``device`` ("cpu", "cuda", "cuda:1", a torch.device)."""
    return DEFAULT_SPACES["cuda" if str(device).startswith("cuda") else "cpu"]


def _quantiles(xs: list[int]) -> dict:
    s = sorted(xs)
    q = lambda f: s[min(len(s) - 1, int(f * (len(s) - 1) + 0.5))]  # noqa: E731
    return {"rows": len(s), "min": s[0], "p10": q(0.1), "median": q(0.5), "p90": q(0.9), "max": s[-1]}


def dataset_diagnostics(tokenizer, calib_rows, eval_rows, heldout_eval_ids, heldout_texts=()) -> dict:
    """Token counts, row-length spread and n-gram overlap of a split dataset (see step 1);
    ``heldout_*``: the bundled perplexity split's documents (token ids, texts)."""
    cal_ids = [tokenizer.encode(r["text"]) for r in calib_rows]
    ev_ids = [tokenizer.encode(r["text"]) for r in eval_rows]
    lengths = [len(x) for x in cal_ids + ev_ids]
    return {"rows": len(lengths), "calibration_rows": len(cal_ids), "evaluation_rows": len(ev_ids),
            "tokens": sum(lengths), "calibration_tokens": sum(map(len, cal_ids)),
            "evaluation_tokens": sum(map(len, ev_ids)),
            "row_tokens": _quantiles(lengths),
            "overlap_calibration_vs_evaluation_8gram": ngram_overlap(cal_ids, ev_ids, 8) if cal_ids and ev_ids else 0.0,
            "overlap_with_heldout_perplexity_split_8gram": ngram_overlap(cal_ids + ev_ids, heldout_eval_ids, 8),
            "rows_verbatim_in_heldout": sum(any(r["text"] in h for h in heldout_texts) for r in calib_rows + eval_rows)}


def _heldout_eval_ids(tokenizer) -> tuple[list[list[int]], list[str]]:
    """Token ids and texts of the bundled held-out corpus's evaluation documents (the
    perplexity split of :func:`workbench.data.heldout_split`); empty without the corpus."""
    try:
        paths = set(heldout_split(tokenizer, 1024)["evaluation_docs"])
        docs = [d for d in heldout_documents() if d["path"] in paths]
    except WorkbenchError:
        return [], []
    return [tokenizer.encode(d["text"]) for d in docs], [d["text"] for d in docs]


def load_setup(dataset, s: CalibrationSettings, sensitivity: list[dict] | None = None) -> Setup:
    """The settings checked, the dataset's rows read and tokenized within their limits (what they
    will hold checked against the host's memory), then the model loaded and its units formed;
    ``sensitivity`` rows given are checked to cover the search.  Bad input fails here, before any work."""
    # lazy: looked up per call (tests/quant/test_dataset_limits.py swaps loader.load_model to prove the data
    # are checked before any model loads)
    from workbench.model.loader import BUNDLED_MODEL, load_model

    if s.objective not in OBJECTIVES:
        raise ConfigError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {s.objective!r}")
    if s.memory not in ("stored", "resident"):
        raise ConfigError(f"memory must be 'stored' or 'resident', got {s.memory!r}")
    limit = parse_degradation(s.target_metric, s.max_degradation)
    options = search_space(s.search_space_spec or default_search_space(s.device))
    budget = parse_bytes(s.memory_budget, "memory_budget (--memory-budget)")
    max_tokens = DATASET_TOKENS_LIMIT if s.max_dataset_tokens is None else s.max_dataset_tokens
    for name, v in (("context", s.context), ("eval_windows", s.eval_windows), ("calib_windows", s.calib_windows),
                    ("max_measured", s.max_measured), ("decode_steps", s.decode_steps), ("rounds", s.rounds),
                    ("max_dataset_tokens", max_tokens)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"calibrate: {name} must be an integer >= 1, got {v!r}")
    folder = BUNDLED_MODEL if s.model in (None, "bundled") else s.model
    if str(folder).startswith("preset:"):
        raise ConfigError("calibrate: a preset has random weights and no tokenizer: quality cannot be measured on "
                          "it; give a trained model folder")
    if is_compressed_checkpoint(folder):
        raise ConfigError(f"calibrate: {folder} is a quantized (compressed-tensors) checkpoint; give the unquantized "
                          "model it was made from")
    rows = read_jsonl(dataset, s.text_field)            # a bad file fails before any model loads
    group = group_field_of(rows, s.group_field, dataset)
    tok = Tokenizer(folder)
    # every row is tokenized (diagnostics, windows): bounded first, row by row, then what it holds checked
    tokens = sum(map(len, encode_rows(rows, tok, max_tokens, dataset)))
    check_allocation("calibration data", tokens * HELD_BYTES_PER_TOKEN,
                     "max_dataset_tokens / --max-dataset-tokens (or give a sample of the file)", budget, "cpu",
                     f"{tokens:,} tokens of {dataset} x {format_bytes(HELD_BYTES_PER_TOKEN)} a token (ids and the "
                     "8-gram sets of the overlap diagnostics)")
    base = load_model(folder, device=s.device, dtype=s.dtype).eval()
    s = dataclasses.replace(s, context=min(s.context, base.config.max_position_embeddings))
    targets = linear_targets(base)
    units = layer_units(targets, s.tie_fused, s.unit)
    given = None if sensitivity is None else check_given_sensitivity(sensitivity, units, options, s.target_metric)
    return Setup(s, limit, options, folder, rows, group, tok, max_tokens, base, targets, units, given)


def prepare_data(dataset, setup: Setup) -> CalibrationData:
    """Step 1: the rows split into calibration / search / confirmation parts (refused when a part
    is empty), their diagnostics, their windows, and warnings about what they cannot show."""
    s, rows, group, tok = setup.settings, setup.rows, setup.group, setup.tokenizer
    parts = {k: dataset_split(rows, k, s.evaluation_fraction, group)
             for k in ("calibration", "evaluation", "search", "confirmation")}
    if min(len(v) for v in parts.values()) == 0:
        what = f"{len({r[group] for r in rows})} {group!r} groups" if group else f"{len(rows)} row(s)"
        raise ConfigError(f"{dataset}: {what}: the calibrator needs at least 4 (calibration, and evaluation split "
                          "into a search half and a confirmation half)")
    heldout_ids, heldout_texts = _heldout_eval_ids(tok)
    diag = dataset_diagnostics(tok, parts["calibration"], parts["evaluation"], heldout_ids, heldout_texts)
    win, spec = {}, {}
    for k, n in (("calibration", s.calib_windows), ("search", s.eval_windows), ("confirmation", s.eval_windows)):
        win[k], spec[k] = jsonl_windows(dataset, tok, s.context, n, k, s.evaluation_fraction, s.text_field, group,
                                        max_tokens=setup.max_tokens)
    diag.update(group_field=group, groups={k: spec[k]["groups"] for k in spec}, context=s.context,
                **{f"{k}_rows": len(parts[k]) for k in ("search", "confirmation")},
                **{f"{k}_windows": len(win[k]) for k in win}, **{f"{k}_rows_used": spec[k]["rows_used"] for k in spec},
                **{f"{k}_scored_tokens": sum(len(w) - 1 for w in win[k]) for k in ("search", "confirmation")})
    warnings = []
    for k in ("search", "confirmation"):
        if diag[f"{k}_scored_tokens"] < 1000:
            warnings.append(f"only {diag[f'{k}_scored_tokens']} {k} tokens: standard errors will be large")
    if diag["overlap_calibration_vs_evaluation_8gram"] > 0.2:
        warnings.append(f"{100 * diag['overlap_calibration_vs_evaluation_8gram']:.0f}% of the calibration part's "
                        "8-grams also occur in the evaluation part: quality may be overstated for new text")
    if group is None:
        warnings.append("rows are split one by one (no 'source' field): rows cut from one document can land in "
                        "both halves, which makes the halves less independent than they look (--group-field)")
    return CalibrationData(parts, diag, win, spec, warnings)


def build_references(setup: Setup, data: CalibrationData) -> References:
    """Step 2: the unquantized model on the search and the confirmation windows (exact match: a
    warning in ``data.warnings`` when there are few prompts)."""
    s, em = setup.settings, setup.settings.exact_match
    exact = s.target_metric == "exact_match"
    refs = References(Reference(setup.base, EvalSet.build(data.windows["search"], **em), exact_match=exact),
                      Reference(setup.base, EvalSet.build(data.windows["confirmation"], **em), exact_match=exact))
    n_s, n_c = len(refs.search.evalset.prompts), len(refs.confirmation.evalset.prompts)
    if exact and min(n_s, n_c) < 20:
        data.warnings.append(f"exact_match on {n_s} search / {n_c} confirmation prompts: each prompt moves the figure "
                             "by several points (more or longer windows, or shorter --em-prompt)")
    return refs


_DEFAULTS = CalibrationSettings()


def calibrate(dataset, target_metric: str = "ppl", max_degradation=0.02, search_space_spec=None,
              objective: str = "memory", *, sensitivity: list[dict] | None = None, progress=None, on_partial=None,
              settings: CalibrationSettings | None = None, **options) -> CalibrationResult:
    """Run the calibrator (see the module docstring) on ``dataset`` (a JSONL file).

    The other keyword ``options`` are the fields of :class:`CalibrationSettings` (``model``,
    ``device``, ``context``, ``eval_windows``, ``backend``, ``max_measured``, ``rounds``...);
    ``settings``: all of them at once, instead of the separate arguments.
    ``sensitivity``: the ``"sensitivity"`` rows of an earlier result on the same model, data,
    evaluation settings, units and search space (e.g. to run the other objective without
    measuring every unit again); they must cover every (unit, option) of this search.
    ``progress(message)``: called as each phase starts.  ``on_partial(result)``: called with the
    result so far after each measured mix and once every mix has its measured cost
    (``candidates``: the mixes measured until then, in the order measured; ``recommendation``
    None), so a run stopped part way keeps its rows (``workbench calibrate-quant`` saves it for
    the device check's time cap).

    The dataset's rows are read line by line within :func:`workbench.data.read_jsonl`'s limits and
    tokenized row by row up to ``max_dataset_tokens``; what the text then holds
    (:data:`HELD_BYTES_PER_TOKEN` a token) is checked against the host's available memory and
    ``memory_budget`` before the model loads.  Returns a :class:`CalibrationResult`
    (``result.as_dict()``: its JSON; ``result["key"]`` reads that view)."""
    t_start = time.perf_counter()
    say = progress or (lambda msg: None)
    first = dict(target_metric=target_metric, max_degradation=max_degradation, search_space_spec=search_space_spec,
                 objective=objective)
    if settings is None:
        settings = CalibrationSettings(**first, **options)
    elif options or any(v != getattr(_DEFAULTS, k) for k, v in first.items()):
        raise TypeError("calibrate: give settings= or the separate options, not both")
    setup = load_setup(dataset, settings, sensitivity)
    data = prepare_data(dataset, setup)                                        # 1. data
    say("reference: the unquantized model on the search and confirmation windows")
    refs = build_references(setup, data)                                       # 2. reference
    calibration = data.windows["calibration"] if setup.needs_calibration else None
    sens = measure_sensitivity(setup, refs.search, calibration, say)           # 3. and 4.

    def partial(found: SearchResult) -> None:
        if on_partial is not None:
            on_partial(CalibrationResult.build(dataset, setup, data, refs, sens, found, None, t_start))

    build = MixBuilder(setup.base, calibration, setup.settings.backend)
    found = Search(setup, sens, refs.search, build, measure, say, partial).run()     # 5. and 6.
    say("confirm the pick on the confirmation text")
    rec = confirm(setup, sens, found, refs.confirmation, build, measure)      # 7.
    return CalibrationResult.build(dataset, setup, data, refs, sens, found, rec, t_start)
