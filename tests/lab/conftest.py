"""Fixtures shared by the lab tests."""

from __future__ import annotations

import os

import pytest

REQUIRED = os.environ.get("WORKBENCH_BROWSER_TESTS", "") == "1"


@pytest.fixture(scope="module")
def chromium():
    """A headless Chromium (Playwright) for the module; skipped where there is none, a failure under
    ``WORKBENCH_BROWSER_TESTS=1`` (CI)."""
    from workbench.lab.browser_session import chromium_available

    why = chromium_available()
    if why:
        if REQUIRED:
            pytest.fail(f"WORKBENCH_BROWSER_TESTS=1 but no browser here: {why}")
        pytest.skip(f"no browser: {why}")
    from workbench.lab.browser_session import Browser

    with Browser() as browser:
        yield browser
