"""Measuring honestly on a noisy machine.

* :mod:`.threads`: the CPU thread policy (how many intra-op threads the engine uses, chosen by
  measuring decode steps of the loaded model; never more than the cores this process may use).
* :mod:`.allocation`: sizes checked before allocation (a pool, caches, a dataset against the
  machine's available memory or a ``--memory-budget``, refused in one line naming the flag).
* :mod:`.compare`: interleaved A/B comparisons with medians, spreads and a verdict stated only
  beyond the spread; :func:`.probe.noise_probe` measures how noisy this machine is right now.
* :mod:`.timing`: timing work that may run on a GPU (CUDA events, or a synchronize around the
  host clock; ``perf_counter`` on a CPU): :func:`.timing.device_timer`, :func:`.timing.time_call`.
* :mod:`.gpu_results`: the GPU tables committed under ``results/gpu/<device>-<date>/`` by
  ``scripts/device_check.sh``, shown next to CPU figures.
"""

from workbench._exports import exports, lazy

# (`compare` and `agreement` are modules here, as their functions are named: import them from there)
_EXPORTS = exports({
    "workbench.measure.compare": "Comparison compare_samples compare_quantile",
    "workbench.measure.probe": "NoiseProbe noise_probe available_cores",
    "workbench.measure.threads": "ThreadChoice choose_threads apply_thread_policy",
    "workbench.measure.agreement": "first_divergence divergence_margin",
    "workbench.measure.memory": "storage_bytes",
    "workbench.measure.allocation": "MemoryPlan check_allocation available_memory parse_bytes format_bytes",
    "workbench.measure.timing": "DeviceTimer device_timer time_call",
})
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)
