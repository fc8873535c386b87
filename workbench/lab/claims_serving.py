"""Claims of the source articles (see workbench.lab.claims): serving."""

from __future__ import annotations

CLAIMS: list = []
