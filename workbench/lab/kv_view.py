"""Looking at the KV cache: a block-map figure, a live block map (text: :mod:`workbench.lab.kv_text`).

Inputs are the plain reports of :mod:`workbench.kv.inspect`; plotly and ipywidgets are imported
inside the functions that draw, so the text helpers (used by the CLI) need neither.  ::

    print(format_report(report(llm, insp)))            # text: pool, hit rate, miss reasons, block map
    block_map_figure(llm.kv_pool.manager.block_states())   # static go.Figure, one cell per block
    view = KVBlockMapView()
    view.run(llm, prompts, params)                      # live heatmap while the requests run
    view.static_figure()                                # a plain go.Figure of the same state, for reports

Paged mode draws one cell per *physical* block (free / owned / shared / cached), ``cols`` blocks
per row (rows labelled "blocks 0-31", ...).  Tiered mode draws one row per layer and one cell per
token position (``cell_tokens`` positions per cell: the cell shows its most frequent zone)
coloured hot / warm / cold / fetched / dropped, as the last query sees the cache (see
:func:`workbench.kv.inspect.tier_report`).  The live view redraws only when what it draws changed,
and at most ``max_hz`` times a second.

The live view is over in a few tens of ms on a CPU, so it also *records* every state it sees (every
pool event, every token of a tiered request; unchanged states dropped), cheaply and whether or not
it is displayed: :meth:`KVBlockMapView.replay` turns the recording into one plotly figure a learner
steps through frame by frame (:mod:`workbench.lab.kv_replay`); :meth:`KVBlockMapView.record_cost`
says what the recording cost per event.
"""

from __future__ import annotations

import time
from collections import Counter

from workbench.kv.inspect import CHARS, PAGED_STATES, TIER_ZONES, live_sequences, tier_report
from workbench.lab.kv_lab import pareto_figure  # noqa: F401  (re-exported: scripts/kv_tier_sweep.py)
from workbench.lab.kv_replay import admission, cache_zone_state, pool_replay_figure, pool_state, zone_replay_figure
from workbench.lab.replay import Recorder, thin
from workbench.lab.viz import store_figure_state
from workbench.lab.kv_text import (format_pool_report, format_report, format_server_header,  # noqa: F401  (re-exported)
                                   format_tier_report, text_block_map, zone_runs)  # noqa: F401  (re-exported)

MAX_RECORDED = 2000      # states a view keeps; past it, every other one goes (a replay shows 120 anyway)
COLORS = {"free": "#e6e6e6", "owned": "#4c78a8", "shared": "#f58518", "cached": "#54a24b",
          "hot": "#d62728", "warm": "#ffbf00", "cold": "#1f77b4", "fetched": "#9467bd", "dropped": "#bdbdbd"}


# ---- figures ------------------------------------------------------------------------------------
def _decode(states):
    """A string of :data:`CHARS` (an inspector record's ``block_map``) -> state names."""
    if isinstance(states, str):
        by_char = {c: name for name, c in CHARS.items()}
        return [by_char[c] for c in states]
    return states


def block_map_grid(states, names, cols: int | None = None, hover=None):
    """(z, text) for a heatmap: ``states`` 1-D (wrapped ``cols`` per row; padding cells None) or
    2-D (rows given); z holds the index of each state in ``names``."""
    states = _decode(states)
    if states and isinstance(states[0], (list, tuple)):
        z = [[names.index(s) for s in row] for row in states]
        text = hover or [[s for s in row] for row in states]
        return z, text
    n = len(states)
    cols = cols or max(1, min(n, 32))
    rows = -(-n // cols) if n else 0
    z = [[names.index(states[r * cols + c]) if r * cols + c < n else None for c in range(cols)] for r in range(rows)]
    hv = hover or [f"block {i}: {s}" for i, s in enumerate(states)]
    text = [[hv[r * cols + c] if r * cols + c < n else "" for c in range(cols)] for r in range(rows)]
    return z, text


def discrete_colorscale(names) -> list:
    """Plotly colorscale with one flat band per state (z = index into ``names``)."""
    k, out = len(names), []
    for i, s in enumerate(names):
        out += [[i / k, COLORS[s]], [(i + 1) / k, COLORS[s]]]
    return out


def _is_blocks(names) -> bool:
    return set(names) <= set(PAGED_STATES)


def _heatmap_kwargs(names, z, text, y_labels=None, x=None, hovertemplate=None):
    gap = 1 if len(z) and len(z[0]) <= 128 else 0   # cell borders, unless the cells are too thin for them
    return dict(z=z, text=text, y=y_labels, x=x, hovertemplate=hovertemplate or "%{text}<extra></extra>",
                xgap=gap, ygap=1,
                colorscale=discrete_colorscale(names), zmin=-0.5, zmax=len(names) - 0.5,
                colorbar=dict(tickvals=list(range(len(names))), ticktext=list(names),
                              title="block state" if _is_blocks(names) else "zone"))


def wrapped_row_labels(n: int, cols: int) -> list[str]:
    """Labels of the rows of ``n`` blocks wrapped ``cols`` per row: ``["blocks 0-31", "blocks 32-63", ...]``
    (the last row may be short: ``"blocks 160-163"``; a row of one block: ``"block 7"``)."""
    rows = [(a, min(a + cols, n) - 1) for a in range(0, n, cols)]
    return [f"block {a}" if a == b else f"blocks {a}-{b}" for a, b in rows]


def x_axis_title(names, two_d: bool) -> str:
    """What a block map's columns are: physical blocks wrapped into rows (1-D), block ids (one
    row per step), or token positions (tier zones, one row per layer)."""
    if not _is_blocks(names):
        return "token position (oldest at the left)"
    return "block id" if two_d else "block (column within the row)"


def block_map_figure(states, names=None, cols: int | None = None, hover=None, title: str | None = None,
                     row_labels=None, height: int | None = None, x=None, hovertemplate: str | None = None):
    """Static heatmap of block (or token-zone) states with a discrete colour legend.

    ``states``: state names, 1-D (one per physical block, ``cols`` per row, rows labelled by
    :func:`wrapped_row_labels`), 2-D (rows given: steps, or layers x positions), or a string of
    :data:`~workbench.kv.inspect.CHARS` (an inspector record's ``block_map``).  ``x``: column
    coordinates (first token of each cell); ``hovertemplate``: plotly's, over ``hover`` as
    ``%{text}`` (default: the hover text alone)."""
    import plotly.graph_objects as go

    states = _decode(states)
    two_d = bool(states) and isinstance(states[0], (list, tuple))
    names = list(names or (TIER_ZONES if two_d else PAGED_STATES))
    z, text = block_map_grid(states, names, cols, hover)
    if row_labels is None and not two_d and z:
        row_labels = wrapped_row_labels(len(states), len(z[0]))
    xaxis = {"showgrid": False, "zeroline": False, "title": x_axis_title(names, two_d)}
    if _is_blocks(names) and z and len(z[0]) <= 32:
        xaxis["dtick"] = 1 if len(z[0]) <= 16 else 2     # block ids a learner can read off, not 0, 5, 10
    fig = go.Figure(go.Heatmap(**_heatmap_kwargs(names, z, text, row_labels, x, hovertemplate)))
    sub = 20 if "<br>" in (title or "") else 0            # a subtitle line: more room above, same plot height
    fig.update_layout(title=title or f"KV block map ({len(states)} {'rows' if two_d else 'blocks'})",
                      height=height or max(220, 90 + 22 * len(z)) + sub, margin=dict(l=70, r=20, t=50 + sub, b=40),
                      xaxis=xaxis, plot_bgcolor="white",
                      yaxis=dict(autorange="reversed", type="category"))
    return fig


# ---- the live view ------------------------------------------------------------------------------
class KVBlockMapView:
    """A live heatmap of the KV cache while requests run (paged: physical blocks; tiered: layers
    x positions), redrawn inside ``fig.batch_update()`` only when what it draws changed, and at
    most ``max_hz`` times a second::

        view = KVBlockMapView(max_hz=10)
        outs = view.run(llm, prompts, SamplingParams(temperature=0, max_tokens=16))
        view.static_figure()       # a plain go.Figure: saved FigureWidget state is stale

    ``attach(llm)`` subscribes to a paged pool's listeners (it looks on its begin / step / end
    events, also when someone else drives the engine); a tiered engine has no pool and no events,
    so :meth:`run` looks between tokens (each token moves the zones), or call :meth:`refresh`.
    A look that finds the same picture as the last one draws nothing (``skipped``).  The widget
    (classes ``wb-live`` and ``wb-live-block-map``) is built when the view is first displayed;
    until then nothing is drawn (``static_figure`` always works).  ``updates`` / ``update_seconds``:
    redraws and the seconds spent looking and redrawing.

    ``record`` (default True): every state is also recorded (:attr:`recorder`, frames of
    :func:`~workbench.lab.kv_replay.pool_state` / :func:`~workbench.lab.kv_replay.zone_state`),
    displayed or not; :meth:`replay` is the figure to step through, :meth:`record_cost` its cost.
    A view attached to a long run keeps at most :data:`MAX_RECORDED` states (evenly thinned).
    """

    def __init__(self, max_hz: float = 10.0, cols: int = 32, cell_tokens: int = 1, title: str | None = None,
                 height: int | None = None, record: bool = True) -> None:
        if not 0 < max_hz <= 60:
            raise ValueError(f"KVBlockMapView: max_hz must be in (0, 60], got {max_hz}")
        if cell_tokens < 1:
            raise ValueError(f"KVBlockMapView: cell_tokens must be >= 1, got {cell_tokens}")
        self.max_hz, self.min_interval, self.cols, self.cell_tokens = max_hz, 1.0 / max_hz, cols, cell_tokens
        self.title, self.height = title, height
        self.llm = self.pool = None
        self.fig = self.label = self.widget = None
        from workbench.lab.live_output import LiveOutput

        self._live = LiveOutput()                 # the widget's output while a run shows it
        self.updates, self.update_seconds, self.events, self.skipped = 0, 0.0, 0, 0
        self._last = 0.0
        self._drawn_key = self._drawn = None      # what the widget shows now (a cheap key, the snapshot)
        self._length = 0
        self.recorder = Recorder(clock=time.monotonic) if record else None
        self.record_events, self.record_seconds = 0, 0.0      # looks recorded, and what they cost in all
        self._requests: dict[str, tuple] = {}                 # request -> (prompt, reused, miss reason), in order
        self._ended: list[str] = []                           # requests ended since the last state recorded

    # ---- state --------------------------------------------------------------------------------
    def attach(self, llm) -> KVBlockMapView:
        self.detach()
        self.llm = llm
        self._drawn_key = self._drawn = None
        if llm.kv_pool is not None:
            self.pool = llm.kv_pool
            self.pool.listeners.append(self._on_event)
        elif llm.tiers is None:
            raise ValueError("KVBlockMapView needs a paged (LLM(kv=...)) or tiered (LLM(tiers=...)) engine; "
                             "the contiguous reference cache has no blocks to draw")
        return self

    def detach(self) -> None:
        if self.pool is not None and self._on_event in self.pool.listeners:
            self.pool.listeners.remove(self._on_event)
        self.pool = None

    def _on_event(self, event: str, seq_id: str) -> None:
        self.events += 1
        if self.recorder is not None:
            t0 = time.monotonic()
            if event == "begin":
                self._requests[seq_id] = admission(self.pool, seq_id)
            if event == "end":                  # told before its blocks go back: the next look shows them released
                self._ended.append(seq_id)
            else:
                verb = "begins" if event == "begin" else "+1 token" if event == "step" else event
                self._record([pool_state(self.pool, self._requests)], f"{seq_id} {verb}", t0)
        if self.fig is not None and time.monotonic() - self._last >= self.min_interval:
            self._redraw()

    # ---- recording ----------------------------------------------------------------------------
    def _record(self, data: list, label: str, t0: float) -> None:
        if self._ended:                         # what changed since the last look comes first in the label
            label = f"{', '.join(self._ended)} released · {label}"
        if self.recorder.add(data, label):
            self._ended = []
            if len(self.recorder.frames) > MAX_RECORDED:    # a view left on a long run: memory stays bounded
                self.recorder.frames = thin(self.recorder.frames, MAX_RECORDED // 2)
        self.record_events += 1
        self.record_seconds += time.monotonic() - t0

    def record_now(self, label: str = "now") -> None:
        """Record the state as it is now (a tiered view between tokens; a pool after its last event)."""
        if self.recorder is None or self.llm is None:
            return
        t0 = time.monotonic()
        if self.pool is not None:
            self._record([pool_state(self.pool, self._requests)], label, t0)
            return
        cache = self._tier_cache()
        if cache is not None and cache.length:
            self._record([cache_zone_state(cache)], label, t0)

    def record_cost(self) -> str:
        """One line: states kept, looks recorded, and what recording cost in all and per look."""
        if self.recorder is None or not self.record_events:
            return "nothing recorded"
        n = len(self.recorder.frames)
        return (f"recorded {n} states ({self.record_events - n} looks found no change) in "
                f"{self.record_seconds * 1e3:.1f} ms: {self.record_seconds / self.record_events * 1e6:,.0f} µs per "
                f"{'pool event' if self.pool is not None or self._requests else 'token'}")

    def replay(self, title: str | None = None):
        """The recorded states as one plotly figure with frames, play / pause, speeds and a scrubber
        (paged: the block map and every request's hits and misses; tiered: the zone map)."""
        if self.recorder is None or not self.recorder.frames:
            raise ValueError("KVBlockMapView.replay: nothing recorded (record=True, then run or attach)")
        if "states" in self.recorder.frames[0].data[0]:
            return pool_replay_figure(self.recorder.frames, cols=self.cols, note=self.record_cost())
        return zone_replay_figure(self.recorder.frames, note=self.record_cost(),
                                  **({"title": title} if title else {}))

    def _tier_cache(self):
        llm = self.llm
        return next(reversed(llm.active_caches.values()), None) if llm.active_caches else llm.last_cache

    def state_key(self):
        """A cheap key of what a tiered view would draw: the zones are a function of the cache
        and its length (the last query's routing included), so an unchanged key means an unchanged
        picture and no snapshot is taken.  None for a paged pool (its snapshot is the check)."""
        if self.llm is None or self.llm.kv_pool is not None:
            return None
        cache = self._tier_cache()
        return None if cache is None else (cache, cache.length)     # the cache itself: compared by identity

    def snapshot(self) -> dict:
        """What is drawn now: states (1-D paged, 2-D tiered), state names, hover text, title."""
        if self.llm is None:
            raise ValueError("KVBlockMapView: attach(llm) or run(llm, ...) first")
        if self.llm.kv_pool is not None:
            return self._paged_snapshot(self.llm.kv_pool.manager)
        return self._tier_snapshot(self._tier_cache())

    def _paged_snapshot(self, m) -> dict:
        states = m.block_states()
        owners: dict[int, list[str]] = {}
        for sid in live_sequences(m):
            for b in m.block_table(sid):
                owners.setdefault(b, []).append(sid)
        hover = [f"block {i}: {s}" + (f"<br>used by {', '.join(owners[i])}" if i in owners else
                                      "<br>committed prefix, no user (reusable; evicted last-used first)"
                                      if s == "cached" else "") for i, s in enumerate(states)]
        c = Counter(states)
        title = self.title or ("KV pool: " + ", ".join(f"{c[s]} {s}" for s in PAGED_STATES)
                               + f" (of {len(states)} blocks x {m.block_size} tokens)")
        return {"mode": "paged", "states": states, "names": list(PAGED_STATES), "hover": hover, "title": title,
                "row_labels": None, "x": None, "length": None, "hovertemplate": None}

    def _tier_snapshot(self, cache) -> dict:
        if cache is None or not cache.length:
            return {"mode": "tiered", "states": [], "names": list(TIER_ZONES), "hover": None,
                    "title": "tiered KV cache: no request yet", "row_labels": None, "x": None, "length": 0,
                    "hovertemplate": None}
        rep = tier_report(cache)
        k, nkv = self.cell_tokens, rep["num_kv_heads"]
        states, hover = [], []
        for layer, (names, heads) in enumerate(zip(rep["zone_map"], rep["fetched_heads"])):
            if k == 1:     # one cell per position, the live view's hot path: no counting, the shortest hover text
                srow = list(names)          # (layer and position come from the hovertemplate, not from 3,000 strings)
                hrow = [f"fetched by {h} of {nkv} KV heads" if s == "fetched" else s for s, h in zip(names, heads)]
            else:
                srow, hrow = [], []
                for a in range(0, len(names), k):
                    cnt = Counter(names[a:a + k])
                    srow.append(cnt.most_common(1)[0][0])
                    hrow.append(f"layer {layer}, positions [{a}, {min(a + k, len(names))}): "
                                + ", ".join(f"{z} {n}" for z, n in cnt.most_common()))
            states.append(srow)
            hover.append(hrow)
        z = rep["zones"]
        title = self.title or (f"Tiered KV cache, {rep['length']} tokens: hot {z['hot']}, warm {z['warm']}, "
                               f"cold {z['cold']}, dropped {z['dropped']}; resident "
                               f"{rep['bytes']['resident'] / max(rep['bytes']['full'], 1):.0%} of full"
                               "<br><sup>zones as the newest token's query sees them; fetched: warm or cold tokens "
                               "that routing brought back exactly for that query</sup>")
        return {"mode": "tiered", "states": states, "names": list(TIER_ZONES), "hover": hover, "title": title,
                "row_labels": [f"layer {i}" for i in range(len(states))], "x": list(range(0, rep["length"], k)),
                "length": rep["length"],
                "hovertemplate": "%{y}, position %{x}: %{text}<extra></extra>" if k == 1 else None}

    def _length_now(self) -> int:
        cache = self._tier_cache()
        return cache.length if cache is not None else 0

    # ---- drawing ------------------------------------------------------------------------------
    def static_figure(self):
        """A plain ``go.Figure`` of the current state (safe to save in reports)."""
        return self._figure(self.snapshot())

    def _figure(self, s: dict):
        return block_map_figure(s["states"], s["names"], self.cols, s["hover"], s["title"], s["row_labels"],
                                self.height, s["x"], s["hovertemplate"])

    def _build(self) -> None:
        import ipywidgets as widgets
        import plotly.graph_objects as go

        fig = go.Figure(go.Heatmap())
        if self.llm is not None:
            s = self.snapshot()
            fig = self._figure(s)
            self._drawn_key, self._drawn, self._length = self.state_key(), self._signature(s), s["length"] or 0
        self.fig = go.FigureWidget(fig)
        self.label = widgets.HTML(value=self.label_text())
        self.widget = widgets.VBox([self.label, self.fig])
        self.widget.add_class("wb-live")                # what a browser test looks for (workbench.lab.browser)
        self.widget.add_class("wb-live-block-map")

    def label_text(self) -> str:
        """The line above the map: what it shows, how often it is redrawn, what that cost."""
        cost = f"{self.updates} redraws, {self.update_seconds * 1e3:.0f} ms"
        if self.llm is not None and self.llm.kv_pool is None:
            return (f"zones per layer for the newest query ({self._length} tokens), redrawn when they change "
                    f"(at most {self.max_hz:g}/s): {cost}")
        return f"pool blocks, redrawn when one changes (at most {self.max_hz:g}/s): {cost}, {self.events} pool events"

    @staticmethod
    def _signature(s: dict):
        return (s["title"], s["states"], s["hover"], s["row_labels"], s["x"])

    def _redraw(self) -> bool:
        """Look; redraw if the picture changed.  True when it redrew."""
        import numpy as np

        t0 = time.monotonic()
        key, drawn = self.state_key(), self._drawn_key
        if key is not None and drawn is not None and key[0] is drawn[0] and key[1] == drawn[1]:
            return self._skip(t0)
        s = self.snapshot()
        sig = self._signature(s)
        if sig == self._drawn:
            self._drawn_key = key
            return self._skip(t0)
        z, text = block_map_grid(s["states"], s["names"], self.cols, s["hover"])
        labels = (s["row_labels"] or wrapped_row_labels(len(s["states"]), len(z[0]))) if z else None
        # object arrays: plotly validates and compares them whole, not cell by cell (3,000+ cells here), and
        # sends them as lists with None padding (a float array's NaN would not survive the widget's JSON)
        zz = np.array(z, dtype=object) if z else np.zeros((0, 0), dtype=object)
        tt = np.array(text, dtype=object) if text else None
        with self.fig.batch_update():
            self.fig.data[0].update(**_heatmap_kwargs(s["names"], zz, tt, labels, None if s["x"] is None else
                                                      np.asarray(s["x"]), s["hovertemplate"]))
            self.fig.layout.title = s["title"]
            if "<br>" in s["title"] and self.fig.layout.margin.t != 70:   # a subtitle: room for it (once)
                self.fig.layout.margin.t, self.fig.layout.height = 70, (self.fig.layout.height or 220) + 20
        self._drawn_key, self._drawn, self._length = key, sig, s["length"] or 0
        self.updates += 1
        self.update_seconds += time.monotonic() - t0
        self.label.value = self.label_text()
        self._last = time.monotonic()
        return True

    def _skip(self, t0: float) -> bool:
        self.skipped += 1
        self.update_seconds += time.monotonic() - t0
        self._last = time.monotonic()
        return False

    def refresh(self) -> bool:
        """Look now (not rate-limited); redraw if the picture changed."""
        return self._redraw() if self.fig is not None else False

    def display(self) -> KVBlockMapView:
        """Show the live widget; :meth:`run` replaces it with a line when its run ends (the replay
        has the states: a saved notebook then holds no widget, see
        :class:`~workbench.lab.live_output.LiveOutput`)."""
        from workbench.lab.live_output import LiveOutput

        if self.fig is None or self._live.shown:
            self._build()
        self._live = LiveOutput()
        self._live.show(self.widget, self.fig, self.label)
        return self

    def _repr_mimebundle_(self, **kwargs):
        if self.fig is None:
            self._build()
        return self.widget._repr_mimebundle_(**kwargs)

    def run(self, llm, prompts, params=None, display: bool = True, interleave: bool = False):
        """Run the prompt(s) while the view updates.  A str or a list of token ids is one prompt
        (returns its RequestOutput); a list of prompts returns a list.  ``interleave=True``
        advances the requests' streams in turn, one token each (all of them hold blocks at
        once, so a shared prefix shows up as *shared* blocks); otherwise one after another."""
        from workbench.engine.llm import RequestOutput

        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        plist = [prompts] if single else list(prompts)
        if self.llm is not llm:
            self.attach(llm)
        if display:
            self.display()
        outs = [RequestOutput(request_id="", prompt=None, prompt_token_ids=[]) for _ in plist]
        streams = [llm.stream(p, params, output=o) for p, o in zip(plist, outs)]
        groups = [streams] if interleave else [[s] for s in streams]
        together = llm.batching(len(plist) if interleave else 1)
        together.__enter__()
        try:
            for group in groups:
                live = list(group)
                while live:
                    for st in list(live):
                        if next(st, None) is None:      # finished (a stream's last event has finished=True)
                            live.remove(st)
                            continue
                        if self.pool is None:           # tiered: no pool events; record and redraw between tokens
                            self.record_now(f"{self._length_now()} tokens")
                            if self.fig is not None and time.monotonic() - self._last >= self.min_interval:
                                self._redraw()
                self.refresh()                          # the finished requests' blocks are released now
                if self.pool is not None:
                    self.record_now("every request done")
        finally:
            for st in streams:                          # on an error: every request gives its blocks back
                st.close()
            together.__exit__(None, None, None)
        if self._live.shown:                            # its place: a line; the replay steps through the run
            self._live.end(note=f"The live view has ended: {self.updates} redraws after {self.events} pool events "
                                f"and {self.skipped} looks that found nothing new. Its replay (replay()) steps "
                                "through every state it recorded.")
            self.fig = None
        elif self.fig is not None:
            store_figure_state(self.fig, send=True)     # a view the browser draws late shows the end of the run
        return outs[0] if single else outs

