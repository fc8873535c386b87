"""workbench serve's start-up line names the SLO guard's settings, not its class."""

from dataclasses import asdict

from workbench.serve.server import _guard_text
from workbench.serve.slo import SLOConfig


def test_the_start_up_line_gives_the_guards_settings():
    text = _guard_text({"type": "SLOGuard", "config": asdict(SLOConfig(factor=3.0, window=20, policy="queue"))})
    assert text == "SLO guard on (opens when P95 TTFT > 3x baseline over 20 requests; queue)"
    assert _guard_text({"type": "MyGuard"}) == "SLO guard on (MyGuard)"
