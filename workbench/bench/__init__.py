"""Every benchmark: tables of ratios side by side in one run, quality next to speed.

* ``vs_transformers``: the engine's configurations against transformers' ``generate`` (``workbench bench``);
* ``kernels``: each Triton kernel against its torch reference (``workbench kernels-bench``);
* ``sched``: throughput, chunked prefill, micro-batch window, overhead (``workbench sched-bench``);
* ``prefix``: cross-request prefix reuse (``workbench prefix-bench``);
* ``tier_eval``: perplexity / KL / top-1 of the tiered KV cache, sweeps and the Pareto front;
* ``profile``: where a decode step's time goes;
* ``llamacpp``: the optional llama.cpp side (GGUF export, its decode rate);
* ``claims``: the claims lab (``workbench claims``): each testable claim of the source articles
  measured here, with a verdict;
* ``run_facts``: the facts a notebook prints atop its numbers (machine, threads, noise).
"""

from workbench._exports import exports, lazy

_EXPORTS = exports({
    "workbench.bench.vs_transformers": "BenchConfig run_bench format_bench",
    "workbench.bench.sched": "SchedBenchConfig run_sched_bench format_sched_bench",
    "workbench.bench.prefix": "PrefixBenchConfig run_prefix_bench format_prefix_bench",
    "workbench.bench.kernels": "KernelBenchConfig run_kernel_bench",
})
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)
