"""What a notebook scales down for the model it runs on, said out loud.

Every notebook's ``smoke`` sizes are chosen for the bundled model on a 2-core CPU.  A real checkpoint
(``workbench run-notebooks --model DIR``) reads many times its bytes per token: SmolLM2-135M is about
20x, so the same sizes would take an hour.  A notebook therefore asks, before it builds anything::

    SCALE = model_scale(model, device)          # from the config alone, no weights read
    if SCALE.large and mode == "smoke":
        ...                                      # smaller workloads, a shorter context
    print(SCALE.describe({"trace": "16 requests instead of 40", ...}))

``large``: on a CPU, a model with at least :data:`LARGE_RATIO` times the bundled model's parameters.
On a GPU nothing is scaled down: the sizes there are the ``full`` ones, chosen for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

LARGE_RATIO = 4.0          # parameters against the bundled model's, from which a CPU run scales down
CONTEXT_CAP = 1024         # tokens: the longest context a scaled-down notebook builds requests for


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


__all__ = ["CONTEXT_CAP", "LARGE_RATIO", "ModelScale", "model_scale"]
