"""A live widget's output is replaced by plain output when its run ends (workbench.lab.live_output),
so a saved notebook reopened without its kernel holds no widget ("model not found")."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")
go = pytest.importorskip("plotly.graph_objects")

from workbench.lab import live_output  # noqa: E402


class Closable:
    def __init__(self) -> None:
        self.closed = False

    def _repr_mimebundle_(self, **kw):
        return {"application/vnd.jupyter.widget-view+json": {"model_id": "m1"}, "text/plain": "widget"}

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def shown(monkeypatch):
    calls = []
    import IPython.display as d

    monkeypatch.setattr(d, "display", lambda obj, **kw: calls.append(("display", obj, kw)))
    monkeypatch.setattr(d, "update_display", lambda obj, **kw: calls.append(("update", obj, kw)))
    return calls


def test_the_widget_goes_out_raw_under_an_id_and_its_place_takes_the_figure(shown):
    w, part = Closable(), Closable()
    out = live_output.LiveOutput()
    out.show(w, part)
    kind, bundle, kw = shown[0]
    assert kind == "display" and kw == {"raw": True, "display_id": out.display_id}
    assert "application/vnd.jupyter.widget-view+json" in bundle        # raw: a FigureWidget's display drops ids
    out.end(figure=go.Figure(go.Scatter(x=[1], y=[2])))
    kind, bundle, kw = shown[1]
    assert kind == "update" and kw == {"raw": True, "display_id": out.display_id}
    assert "application/vnd.plotly.v1+json" in bundle and not any("widget" in k for k in bundle)
    assert w.closed and part.closed and not out.shown
    out.end(note="again")                     # nothing shown any more: nothing to replace
    assert len(shown) == 2


def test_a_note_takes_the_place_when_there_is_no_figure(shown):
    out = live_output.LiveOutput()
    out.show(Closable())
    out.end(note="The live view has ended: <3 redraws>")
    bundle = shown[1][1]
    assert "&lt;3 redraws&gt;" in bundle["text/html"] and bundle["text/plain"].endswith("<3 redraws>")
    assert 'class="wb-live-ended"' in bundle["text/html"]


def test_views_replace_their_widget_when_the_run_ends(shown, bundled_llm):
    from workbench import SamplingParams
    from workbench.lab.viz import LatencyStreamView

    view = LatencyStreamView()
    view.run(bundled_llm, "The list type", SamplingParams(temperature=0, max_tokens=4))
    kinds = [c[0] for c in shown]
    assert kinds == ["display", "update"] and shown[0][2]["display_id"] == shown[1][2]["display_id"]
    assert "The live view has ended" in shown[1][1]["text/plain"]
    view.run(bundled_llm, "The list type", SamplingParams(temperature=0, max_tokens=4))   # a second run: new widgets
    assert [c[0] for c in shown] == ["display", "update", "display", "update"]
    assert shown[2][2]["display_id"] != shown[0][2]["display_id"]
