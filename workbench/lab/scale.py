"""What a notebook scales down for the model it runs on, said out loud.

Every notebook's ``smoke`` sizes are chosen for the bundled model on a 2-core CPU.  A real checkpoint
(``workbench run-notebooks --model DIR``) reads many times its bytes per token: SmolLM2-135M is about
20x, so the same sizes would take an hour.  A notebook therefore asks, before it builds anything::

    SCALE = model_scale(model, device)          # from the config alone, no weights read
    if SCALE.large and mode == "smoke":
        ...                                      # smaller workloads, a shorter context
    print(SCALE.describe({"trace": "16 requests instead of 40", ...}))

``large``: on a CPU, a model with at least :data:`LARGE_RATIO` times the bundled model's parameters.
On a GPU nothing is scaled down: the sizes there are the ``full`` ones, chosen for one H100 80 GB, and
:func:`memory_fit` checks them by formula (weights + KV, nothing measured) before anything is loaded::

    print(memory_fit(model, kv_tokens=24_000).describe())   # "memory by formula (bundled): ... fits in 80 GB ..."
"""

from __future__ import annotations

from dataclasses import dataclass

LARGE_RATIO = 4.0          # parameters against the bundled model's, from which a CPU run scales down
CONTEXT_CAP = 1024         # tokens: the longest context a scaled-down notebook builds requests for
H100_BYTES = 80 * 10**9    # one H100 80 GB: the GPU that `full` mode's sizes on a GPU are chosen for


@dataclass(frozen=True)
class ModelScale:
    """The model a notebook runs on, against the bundled one its smoke sizes were chosen for."""

    name: str
    parameters: int
    bundled_parameters: int
    device: str
    max_position_embeddings: int

    @property
    def ratio(self) -> float:
        return self.parameters / self.bundled_parameters

    @property
    def large(self) -> bool:
        """Scale the smoke sizes down: a CPU run on a model LARGE_RATIO times the bundled one or more."""
        return not self.device.startswith("cuda") and self.ratio >= LARGE_RATIO

    @property
    def context(self) -> int | None:
        """The context cap for the engines a scaled-down notebook builds (None: the model's own)."""
        return min(CONTEXT_CAP, self.max_position_embeddings) if self.large else None

    def describe(self, changes: dict[str, str] | None = None) -> str:
        """One paragraph: the model against the bundled one, and each size this notebook changed."""
        head = (f"model: {self.name}, {self.parameters / 1e6:,.1f} M parameters = {self.ratio:.1f}x the bundled "
                f"model's {self.bundled_parameters / 1e6:,.1f} M, on {self.device}")
        if not self.large:
            return head + ": the notebook's sizes as written"
        if not changes:
            return head + ": this notebook keeps its smoke sizes"
        lines = [head + f": scaled down (a CPU run on {LARGE_RATIO:g}x the bundled model or more) -"]
        lines += [f"  {what}: {how}" for what, how in (changes or {}).items()]
        return "\n".join(lines)


def model_scale(model=None, device: str = "cpu") -> ModelScale:
    """The :class:`ModelScale` of ``model`` (a folder, ``preset:<name>`` or None for the bundled
    model) on ``device``, from its config alone."""
    from workbench.model.loader import model_config

    cfg, bundled = model_config(model), model_config(None)
    return ModelScale(name=str(model or "bundled"), parameters=cfg.num_parameters(),
                      bundled_parameters=bundled.num_parameters(), device=str(device),
                      max_position_embeddings=cfg.max_position_embeddings)


@dataclass(frozen=True)
class MemoryFit:
    """Device memory by formula: ``weight_copies`` x parameters x element bytes, plus ``kv_tokens``
    x the KV bytes of one token (K and V, every layer). Activations, the CUDA context and the
    allocator's slack are not counted: the margin left under ``budget`` is for them."""

    name: str
    weights: int
    kv: int
    budget: int

    @property
    def total(self) -> int:
        return self.weights + self.kv

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def describe(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        return (f"memory by formula ({self.name}): weights {self.weights / 1e9:.2f} GB + KV {self.kv / 1e9:.2f} GB "
                f"= {self.total / 1e9:.2f} GB: {verdict} in {self.budget / 1e9:.0f} GB "
                f"({self.total / self.budget:.1%}; activations not counted)")


def memory_fit(model=None, kv_tokens: int = 0, weight_copies: int = 1, element_bytes: int = 2,
               budget: int = H100_BYTES) -> MemoryFit:
    """Whether ``model`` (a folder, ``preset:<name>`` or None for the bundled model) with ``kv_tokens``
    tokens of KV held at once fits ``budget`` bytes, from its config alone (no weights read).
    ``element_bytes``: 2 for bfloat16 / float16, a GPU's usual dtype."""
    from workbench.model.loader import model_config

    cfg = model_config(model)
    return MemoryFit(name=str(model or "bundled"),
                     weights=weight_copies * cfg.num_parameters() * element_bytes,
                     kv=kv_tokens * cfg.kv_bytes_per_token(element_bytes), budget=budget)


__all__ = ["CONTEXT_CAP", "H100_BYTES", "LARGE_RATIO", "MemoryFit", "ModelScale", "memory_fit", "model_scale"]
