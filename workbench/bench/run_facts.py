"""What a reader needs to know before trusting a run's numbers: where it ran, with how many
threads and why, and how noisy the machine was.  Every notebook prints this at the top, and the
claims lab's JSON report carries the same facts (:func:`workbench.bench.claims.claims_report`)::

    probe = noise_probe()
    print(describe_run(llm, probe))
    results |= run_facts(llm, probe)          # the same facts as columns of the results row
"""

from __future__ import annotations

import torch

from workbench.bench.vs_transformers import device_name
from workbench.measure.probe import NoiseProbe


def run_facts(llm, probe: NoiseProbe | None = None) -> dict:
    """Flat, JSON-ready facts about this run (for results rows)."""
    choice = getattr(llm, "thread_choice", None)
    facts = {"device_name": device_name(llm.device), "torch": torch.__version__,
             "threads": torch.get_num_threads(), "threads_policy": choice.policy if choice else None}
    if choice is not None and choice.step_ms:
        for t, ms in choice.step_ms.items():
            facts[f"threads_step_ms_{t}"] = ms
    if probe is not None:
        facts.update(noise_spread=probe.spread, noise_iqr=probe.iqr, noise_threshold=probe.threshold,
                     noise_parallel_speedup=probe.parallel_speedup)
    return facts


def describe_run(llm, probe: NoiseProbe | None = None) -> str:
    """A few lines: device, threads and why, machine noise and what it means for verdicts."""
    choice = getattr(llm, "thread_choice", None)
    lines = [f"device: {llm.device} ({device_name(llm.device)}), torch {torch.__version__}"]
    if choice is not None:
        lines.append(f"torch threads: {choice.describe()}")
    if probe is not None:
        lines.append(probe.describe())
        lines.append("every A/B comparison below runs both sides interleaved and states a verdict only when, with "
                     "3+ runs a side, the sides' ranges do not overlap (or one side won 6+ neighbouring rounds) and "
                     "the ratio exceeds that noise floor; otherwise 'within noise'")
    return "\n".join(lines)


__all__ = ["run_facts", "describe_run"]
