"""Measuring honestly on a noisy machine.

* :mod:`.threads`: the CPU thread policy (how many intra-op threads the engine uses, chosen by
  measuring decode steps of the loaded model).
* :mod:`.compare`: interleaved A/B comparisons with medians, spreads and a verdict stated only
  beyond the spread; :func:`.probe.noise_probe` measures how noisy this machine is right now.
* :mod:`.gpu_results`: the GPU tables committed under ``results/gpu/<device>-<date>/`` by
  ``scripts/device_check.sh``, shown next to CPU figures.
"""
