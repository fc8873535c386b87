"""What ``workbench bench`` found (:func:`workbench.bench.vs_transformers.run_bench`): :class:`BenchResult`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass


@dataclass
class BenchResult(Mapping):
    """The engine's configurations against transformers.generate, one run.  :meth:`as_dict` is its JSON
    (``workbench bench --json``, the partial save); ``result["key"]`` (and ``.get``, ``in``, iteration)
    reads that JSON view, for callers written against the dict.  The top-level rows are the smallest
    batch size's; the per-configuration rows stay JSON dicts."""

    # the run's facts
    model: str
    device: str
    device_name: str
    dtype: str
    threads: int
    threads_policy: dict                      # how the thread count was chosen (ThreadChoice.as_dict)
    noise: dict                               # the noise floor of the verdicts (NoiseProbe.as_dict)
    torch: str
    transformers: str
    config: dict                              # the BenchConfig, as a dict
    # the reference configuration against transformers, at the smallest batch size
    batch: int
    workbench: dict                           # the reference configuration's statistics
    transformers_generate: dict               # transformers.generate's statistics
    decode_speedup: float                     # decode tokens/s p50, reference / transformers
    ttft_ratio: float                         # TTFT p50, reference / transformers
    decode_verdict: str
    ttft_verdict: str
    decode_winner: str | None
    ttft_winner: str | None
    greedy_token_agreement: float
    # every configuration
    configs: dict[str, dict]                  # name -> its row (statistics, ratio, verdict, agreement, quality)
    skipped: dict[str, str]                   # name -> why it was not measured
    fastest: str
    fastest_within_quality: str | None        # the fastest row within max_rel_ppl of the unquantized model
    max_rel_ppl: float
    vs_llamacpp: dict[str, float]             # that row's decode rate / each llama.cpp row's
    backends: dict                            # the measured model's per-op backends
    quality: dict[str, dict]                  # quantized row -> its perplexity against the unquantized model
    batches: dict[str, dict]                  # batch size -> its configs, fastest, paged pairs, transformers
    paged_vs_contiguous: dict[str, dict]      # batch size -> "paged... vs ..." -> ratio, verdict, winner
    raw: dict                                 # every measurement (per side; per batch size with several)
    front_overhead: dict | None = None        # with the bare loop measured: what the LLM front + engine add

    def as_dict(self) -> dict:
        """The JSON view: the keys, in order, and values ``workbench bench --json --raw`` prints
        (``front_overhead`` only when the bare loop was measured)."""
        return {name: self[name] for name in self}

    def __getitem__(self, key: str):
        if key not in _RESULT_KEYS or (key == "front_overhead" and self.front_overhead is None):
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_RESULT_KEYS if self.front_overhead is not None else _RESULT_KEYS[:-1])

    def __len__(self) -> int:
        return len(_RESULT_KEYS) - (self.front_overhead is None)


_RESULT_KEYS = tuple(f.name for f in dataclasses.fields(BenchResult))
