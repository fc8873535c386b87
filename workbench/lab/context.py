"""Notebooks 00 and 02-05 still import the run's facts from here; they live in
:mod:`workbench.bench.run_facts` (the claims lab's report carries them too, and bench does not
import lab).  Import them from there."""

from workbench.bench.run_facts import describe_run, run_facts

__all__ = ["describe_run", "run_facts"]
