"""Claims of the source articles (see workbench.lab.claims): gpu."""

from __future__ import annotations

CLAIMS: list = []
