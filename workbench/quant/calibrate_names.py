"""The calibrator's names and defaults, without torch.

``workbench``'s command line builds every subcommand's parser at start-up; ``calibrate-quant``'s
choices come from here, so building its parser does not import torch (1-2 s on a 2-core machine),
and ``calibrate-quant`` reads its dataset, and refuses it, before torch loads.
:mod:`workbench.quant.calibrate` and :mod:`workbench.quant.quality` use the same names.
"""

from __future__ import annotations

METRICS = ("ppl", "kl", "top1", "exact_match")
OBJECTIVES = ("latency", "memory")
# The default search space by device: on a CPU W8A8 runs through torch._int_mm (int8 activations, the
# fastest prefill there) and W8A16 through a compiled int8 reduction; on a GPU the Triton kernels.
DEFAULT_SPACES = {"cpu": "w8a16,w8a8,w4a16:g128,w4a8", "cuda": "w8a16,w4a16:g128,w4a8"}

__all__ = ["DEFAULT_SPACES", "METRICS", "OBJECTIVES"]
