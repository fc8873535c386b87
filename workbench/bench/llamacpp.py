"""llama.cpp as an optional CPU anchor: GGUF export and a greedy decode-rate row.

llama.cpp is what a user would run on a CPU instead of this engine, so a benchmark that
claims a CPU decode rate should put it beside llama.cpp's.  Nothing here is a dependency:

* :func:`export_gguf` (in :mod:`workbench.bench.gguf_export`, re-exported here; its
  conversion notes are there) writes a GGUF file of a Hugging Face–format Llama-family folder
  with the light, pure-Python ``gguf`` package (``pip install gguf``), imported only when called;
* :func:`llamacpp_decode_rate` streams a greedy decode through llama-cpp-python
  (``import llama_cpp``; it compiles llama.cpp at install time, which takes minutes);
* :func:`llamacpp_row` is the benchmark row: ``{"available": False, "reason": ...}`` when
  either package is missing, otherwise the GGUF is exported once into a cache folder (keyed
  by the model folder and its files' mtimes) and measured.

Timing follows :mod:`workbench.engine.metrics`: TTFT is first token minus start, the decode rate is
``(n - 1) / (t_last - t_first)``.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from workbench.bench.gguf_export import (_GGUF_HINT, EXPORT_FORMAT_VERSION, export_gguf,  # noqa: F401  (re-exported)
                                        gguf_tensor_name, permute_qk)  # noqa: F401  (re-exported)
from workbench.errors import CheckpointError, ConfigError, WorkbenchError

_LLAMA_CPP_HINT = ("llama-cpp-python is not installed (pip install llama-cpp-python; it compiles "
                   "llama.cpp, which takes several minutes)")


# ---- optional imports ------------------------------------------------------------------------

def _import_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise WorkbenchError(_LLAMA_CPP_HINT) from None
    return llama_cpp


def llamacpp_unavailable_reason() -> str | None:
    """Why the llama.cpp row cannot be measured here, or None when it can."""
    missing = []
    for module, hint in (("llama_cpp", _LLAMA_CPP_HINT), ("gguf", _GGUF_HINT)):
        try:
            __import__(module)
        except ImportError:
            missing.append(hint)
        except Exception as e:  # a broken build (missing shared library, ...) is "unavailable" too
            missing.append(f"`import {module}` failed: {type(e).__name__}: {e}")
    return "; ".join(missing) or None


# ---- measurement -----------------------------------------------------------------------------

def _greedy_run(llm, prompt: list[int], n_tokens: int) -> tuple[list[int], float, float]:
    """One greedy run of a loaded ``llama_cpp.Llama`` from an empty KV cache (every run
    prefills), streamed token by token: (token ids, TTFT s, decode tokens/s)."""
    llm.reset()
    ids, times = [], []
    start = time.perf_counter()
    for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0,
                            repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter())
        ids.append(int(tok))
        if len(ids) >= n_tokens:
            break
    return ids, times[0] - start, (len(times) - 1) / (times[-1] - times[0])


def llamacpp_decode_rate(gguf_path: str | os.PathLike, prompt_ids: Sequence[int], n_tokens: int, threads: int,
                         runs: int = 3, warmup: int = 1) -> dict:
    """Greedy-decode ``n_tokens`` after ``prompt_ids`` with llama-cpp-python, streaming token by
    token, ``warmup`` untimed runs then ``runs`` timed ones, each from an empty KV cache.

    Returns JSON-ready values: median TTFT (ms) and decode tokens/s with their per-run values,
    the generated ids of the first timed run (EOS is not a stop: like ``ignore_eos=True``), and
    llama_cpp's version.
    """
    llama_cpp = _import_llama_cpp()
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ConfigError("llamacpp_decode_rate: the prompt is empty")
    if n_tokens < 2:
        raise ConfigError("llamacpp_decode_rate: n_tokens must be >= 2 to measure decoding")
    if runs < 1 or threads < 1:
        raise ConfigError("llamacpp_decode_rate: runs and threads must be >= 1")
    path = Path(gguf_path)
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    n_ctx = len(prompt) + n_tokens + 8
    t_load = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                          n_batch=min(512, n_ctx), verbose=False)
    load_s = time.perf_counter() - t_load
    n_vocab = llm.n_vocab()
    bad = [t for t in prompt if not 0 <= t < n_vocab]
    if bad:
        raise ConfigError(f"llamacpp_decode_rate: prompt token id {bad[0]} is outside the vocabulary [0, {n_vocab})")

    def one_run() -> tuple[list[int], float, float]:
        return _greedy_run(llm, prompt, n_tokens)

    try:
        for _ in range(warmup):
            one_run()
        measured = [one_run() for _ in range(runs)]
    finally:
        if hasattr(llm, "close"):
            llm.close()
    ttfts = [m[1] * 1e3 for m in measured]
    rates = [m[2] for m in measured]
    return {
        "engine": "llama.cpp", "llama_cpp_version": str(getattr(llama_cpp, "__version__", "unknown")),
        "gguf_path": str(path), "threads": int(threads), "prompt_tokens": len(prompt), "n_tokens": int(n_tokens),
        "runs": int(runs), "warmup": int(warmup), "load_s": load_s,
        "ttft_ms_p50": statistics.median(ttfts), "decode_tokens_per_s_p50": statistics.median(rates),
        "ttft_ms": ttfts, "decode_tokens_per_s": rates,
        "token_ids": measured[0][0],
        "deterministic": all(m[0] == measured[0][0] for m in measured),
    }


# ---- the benchmark row -----------------------------------------------------------------------

def default_cache_dir() -> Path:
    """``$WORKBENCH_CACHE/gguf``, else ``$XDG_CACHE_HOME/workbench/gguf`` (~/.cache by default)."""
    if os.environ.get("WORKBENCH_CACHE"):
        return Path(os.environ["WORKBENCH_CACHE"]).expanduser() / "gguf"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return base / "workbench" / "gguf"


def _model_folder(model_source) -> Path:
    from workbench.model.loader import BUNDLED_MODEL

    if model_source in (None, "bundled"):
        return BUNDLED_MODEL
    if str(model_source).startswith("preset:"):
        raise ConfigError(f"{model_source}: a shape preset has no checkpoint to convert to GGUF")
    return Path(model_source).expanduser()


def cached_gguf(model_source=None, cache_dir: str | os.PathLike | None = None, dtype: str = "f32") -> Path:
    """The GGUF of a model folder, exported on first use into ``cache_dir``.  The file name
    carries a hash of the folder's resolved path and its files' sizes and mtimes, so editing
    the checkpoint exports a fresh file."""
    from workbench.model.loader import checkpoint_files

    folder = _model_folder(model_source).resolve()
    files = [folder / "config.json", folder / "tokenizer.json", folder / "tokenizer_config.json",
             folder / "generation_config.json", *checkpoint_files(folder)]
    stamp = [str(folder), dtype, str(EXPORT_FORMAT_VERSION)]
    for f in files:
        if f.is_file():
            st = f.stat()
            stamp.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    key = hashlib.sha256("\n".join(stamp).encode()).hexdigest()[:16]
    out = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    out = out / f"{folder.name}-{key}-{dtype}.gguf"
    if not out.is_file():
        export_gguf(folder, out, dtype=dtype)
    return out


def llamacpp_row(model_source, prompt_ids: Sequence[int], n_tokens: int, threads: int,
                 cache_dir: str | os.PathLike | None = None, dtype: str = "f32", runs: int = 3,
                 warmup: int = 1) -> dict:
    """The optional llama.cpp benchmark row.

    ``{"available": False, "reason": ...}`` when llama-cpp-python or gguf is not importable
    (or the model is a weightless shape preset); otherwise ``{"available": True, ...}`` with
    :func:`llamacpp_decode_rate`'s fields plus the GGUF export's dtype, path and time.
    """
    reason = llamacpp_unavailable_reason()
    if reason is None and str(model_source).startswith("preset:"):
        reason = f"{model_source}: a shape preset has no checkpoint to convert to GGUF"
    if reason is not None:
        return {"available": False, "engine": "llama.cpp", "reason": reason}
    t0 = time.perf_counter()
    path = cached_gguf(model_source, cache_dir, dtype=dtype)
    export_s = time.perf_counter() - t0
    row = llamacpp_decode_rate(path, prompt_ids, n_tokens, threads, runs=runs, warmup=warmup)
    return {"available": True, **row, "gguf_dtype": dtype, "gguf_prepare_s": export_s}


def quantized_gguf(f32_path: Path, ftype: str = "q8_0") -> Path:
    """``f32_path`` quantized by llama.cpp's own quantizer (``llama_model_quantize``), cached next to it."""
    llama_cpp = _import_llama_cpp()
    codes = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
    if ftype not in codes:
        raise ConfigError(f"quantized_gguf: {ftype!r} is not offered here; choose one of {', '.join(codes)}")
    out = f32_path.with_name(f32_path.name.replace("-f32.gguf", "") + f"-{ftype}-llamacpp.gguf")
    if not out.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = codes[ftype]
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        rc = llama_cpp.llama_model_quantize(str(f32_path).encode(), str(tmp).encode(), params)
        if rc != 0 or not tmp.is_file():
            tmp.unlink(missing_ok=True)
            raise WorkbenchError(f"llama.cpp's quantizer failed on {f32_path} ({ftype}, return code {rc})")
        os.replace(tmp, out)
    return out


def source_gguf(model_source) -> Path | None:
    """The GGUF file a folder was imported from (``workbench import-gguf`` records it), if it still exists."""
    import json

    try:
        info = json.loads((_model_folder(model_source) / "import_gguf.json").read_text())
    except (OSError, ValueError, ConfigError):
        return None
    p = Path(info.get("source", ""))
    return p if p.is_file() else None


# llama.cpp's rows of `workbench bench`: which GGUF each measures
VARIANTS = {"f32": "the model exported as an f32 GGUF", "q8_0": "the f32 GGUF quantized by llama.cpp's own "
            "quantizer to Q8_0 (8.5 bits a weight: the equal-bits yardstick of an int8 engine)",
            "source": "the GGUF file the folder was imported from (workbench import-gguf), as it is"}


def llamacpp_side(model_source, llm, n_tokens: int, threads: int, cache_dir: str | os.PathLike | None = None,
                  dtype: str = "f32", variant: str = "f32") -> dict:
    """llama.cpp as one side of ``workbench bench`` (interleaved with the others, like them):
    ``{"available": True, "run": fn(prompt_ids) -> (token ids, TTFT s, decode tokens/s),
    "description": ...}``, or ``{"available": False, "reason": ...}``.  ``variant``: which GGUF
    (:data:`VARIANTS`).  The model is loaded once, with a context of ``llm.max_model_len``; every run
    starts from an empty KV cache."""
    reason = llamacpp_unavailable_reason()
    if reason is None and str(model_source).startswith("preset:"):
        reason = f"{model_source}: a shape preset has no checkpoint to convert to GGUF"
    if reason is None and variant == "source" and source_gguf(model_source) is None:
        reason = "the model folder was not imported from a GGUF file (workbench import-gguf), or that file is gone"
    if reason is not None:
        return {"available": False, "reason": reason}
    llama_cpp = _import_llama_cpp()
    if variant == "source":
        path, label = source_gguf(model_source), "its source GGUF"
    else:
        path = cached_gguf(model_source, cache_dir, dtype=dtype)
        path, label = (quantized_gguf(path), "Q8_0 GGUF (llama.cpp's quantizer)") if variant == "q8_0" \
            else (path, f"{dtype} GGUF")
    model = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads,
                            n_ctx=llm.max_model_len, n_batch=min(512, llm.max_model_len), verbose=False)

    def run(prompt_ids):
        return _greedy_run(model, [int(t) for t in prompt_ids], n_tokens)

    version = getattr(llama_cpp, "__version__", "unknown")
    return {"available": True, "run": run, "gguf": str(path),
            "description": f"llama-cpp-python {version}, {label} ({path.name}), {threads} threads (same process)"}
