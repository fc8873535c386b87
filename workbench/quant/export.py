"""Quantize a model and write it as a compressed-tensors checkpoint: what ``workbench quantize`` runs.

::

    quantize_checkpoint("bundled", "w4a16:g128", "out/")                       # RTN: no calibration
    quantize_checkpoint("path/to/llama", "w4a16:g128:awq", "out/", dataset="my.jsonl")
    quantize_checkpoint("bundled", "recipe.json", "out/")                       # a recipe file, its own text

AWQ, GPTQ and SmoothQuant calibrate on, in this order: ``dataset`` (a JSONL text file, packed
into windows of ``min(512, context)`` tokens, :func:`workbench.data.jsonl_windows`), the text a
recipe file names (:func:`workbench.data.windows_from_spec`), or the calibration half of the
bundled held-out corpus (8 windows, as ``LLM(quant=...)`` does).  Where the text came from is
written into the checkpoint's recipe side file, so a reload knows how it was made.
"""

from __future__ import annotations

from pathlib import Path

from workbench.errors import ConfigError
from workbench.data import heldout_split, jsonl_windows, windows_from_spec
from workbench.model.tokenizer import Tokenizer
from workbench.quant.recipe import resolve_recipe


def _calibration(recipe, doc: dict | None, tokenizer, context: int, dataset, text_field: str,
                 max_windows: int | None) -> tuple[list | None, dict | None]:
    """``(windows, spec)`` the recipe calibrates on, or ``(None, None)`` when it reads no activations."""
    if not recipe.needs_calibration:
        if dataset is not None:
            raise ConfigError(f"--dataset: {recipe.name} does not calibrate (only awq, gptq and smooth read "
                              "activations); drop --dataset or pick a calibrated method")
        return None, None
    if tokenizer is None:
        raise ConfigError(f"{recipe.name} calibrates on text and this model has no tokenizer (a shape preset?)")
    if dataset is not None:
        windows, spec = jsonl_windows(dataset, tokenizer, context, max_windows, split="all", text_field=text_field)
        if not windows:
            raise ConfigError(f"{dataset}: too little text for one calibration window of {context} tokens")
        return windows, spec
    if doc and doc.get("calibration"):
        return windows_from_spec(doc["calibration"], tokenizer), doc["calibration"]

    split = heldout_split(tokenizer, context)
    windows = split["calibration"][:8]
    return windows, {"source": "bundled held-out corpus, calibration half (workbench.data.heldout_split)",
                     "context": context, "windows": len(windows), "documents": split["calibration_docs"][:8]}


def quantize_checkpoint(model: str | Path | None, recipe, out: str | Path, dataset: str | Path | None = None,
                        text_field: str = "text", max_windows: int | None = 8, device=None, dtype=None,
                        check_finite: bool = True) -> dict:
    """Load ``model`` (a folder, ``"bundled"`` / None, or ``"preset:<name>"``), quantize it with
    ``recipe`` (a :class:`~workbench.quant.recipe.QuantRecipe`, a scheme string or a recipe
    file's path), calibrate as the module docstring says, and write ``out`` with
    :func:`~workbench.quant.compressed.save_compressed`.  ``dtype``: of the dense tensors
    written (default: the source checkpoint's).  Returns save_compressed's summary plus
    ``recipe`` (its name), ``calibration`` (the spec or None) and ``source``."""
    # lazy: torch (~3 s) only once a model is quantized: `workbench quantize` imports this module first and
    # answers a bad flag at once
    from workbench.model.loader import BUNDLED_MODEL, load_model, parse_dtype
    from workbench.quant.apply import quantize_model
    from workbench.quant.compressed import is_compressed_checkpoint, save_compressed

    recipe, doc = resolve_recipe(recipe)
    spec = "bundled" if model in (None, "bundled") else str(model)
    if is_compressed_checkpoint(spec):
        raise ConfigError(f"{spec}: already a quantized checkpoint (compressed-tensors); quantize a dense one")
    out = Path(out).expanduser()
    if Path(spec).expanduser().resolve() == out.resolve():
        raise ConfigError(f"--out {out}: the same folder as the model; write the checkpoint elsewhere")
    write_dtype = parse_dtype(dtype)
    net = load_model(spec, device=device, check_finite=check_finite)
    if write_dtype is None:          # the source checkpoint's dtype (bf16 stays bf16: nothing lost)
        try:
            write_dtype = parse_dtype(net.config.torch_dtype)
        except ConfigError:
            write_dtype = None
    folder = None if spec.startswith("preset:") else (BUNDLED_MODEL if spec == "bundled" else Path(spec))
    tok = Tokenizer(folder) if folder is not None and (folder / "tokenizer.json").is_file() else None
    context = min(512, net.config.max_position_embeddings)
    windows, cal = _calibration(recipe, doc, tok, context, dataset, text_field, max_windows)
    quantize_model(net, recipe, calibration=windows)
    has_tok = folder is not None and any((folder / f).is_file()
                                         for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
    info = save_compressed(net, out, tokenizer_folder=folder if has_tok else None, dtype=write_dtype,
                           extra={"calibration": cal, "source": str(folder or spec),
                                  "written_by": "workbench quantize"})
    return dict(info, recipe=recipe.name, calibration=cal, source=str(folder or spec))
