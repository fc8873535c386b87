"""Claims of the source articles (see workbench.lab.claims): model."""

from __future__ import annotations

CLAIMS: list = []
