"""Looking at the KV cache: a block-map figure, a live block map (text: :mod:`workbench.lab.kv_text`).

Inputs are the plain reports of :mod:`workbench.kv.inspect`; plotly and ipywidgets are imported
inside the functions that draw, so the text helpers (used by the CLI) need neither.  ::

    print(format_report(report(llm, insp)))            # text: pool, hit rate, miss reasons, block map
    block_map_figure(llm.kv_pool.manager.block_states())   # static go.Figure, one cell per block
    view = KVBlockMapView()
    view.run(llm, prompts, params)                      # live heatmap while the requests run
    view.static_figure()                                # a plain go.Figure of the same state, for reports

Paged mode draws one cell per *physical* block (free / owned / shared / cached), ``cols`` blocks
per row.  Tiered mode draws one row per layer and one cell per token position (``cell_tokens``
positions per cell: the cell shows its most frequent zone) coloured hot / warm / cold / fetched /
dropped, as the last query sees the cache (see :func:`workbench.kv.inspect.tier_report`).
"""

from __future__ import annotations

import time
from collections import Counter

from workbench.kv.inspect import CHARS, PAGED_STATES, TIER_ZONES, live_sequences, tier_report
from workbench.lab.kv_text import (format_pool_report, format_report, format_server_header,  # noqa: F401  (re-exported)
                                   format_tier_report, text_block_map, zone_runs)  # noqa: F401  (re-exported)

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


def _heatmap_kwargs(names, z, text, y_labels=None, x=None):
    gap = 1 if z and len(z[0]) <= 128 else 0        # cell borders, unless the cells are too thin for them
    return dict(z=z, text=text, y=y_labels, x=x, hovertemplate="%{text}<extra></extra>", xgap=gap, ygap=1,
                colorscale=discrete_colorscale(names), zmin=-0.5, zmax=len(names) - 0.5,
                colorbar=dict(tickvals=list(range(len(names))), ticktext=list(names), title="state"))


def block_map_figure(states, names=None, cols: int | None = None, hover=None, title: str | None = None,
                     row_labels=None, height: int | None = None, x=None):
    """Static heatmap of block (or token-zone) states with a discrete colour legend.

    ``states``: state names, 1-D (one per physical block, ``cols`` per row), 2-D (rows given:
    steps, or layers x positions), or a string of :data:`~workbench.kv.inspect.CHARS` (an
    inspector record's ``block_map``).  ``x``: column coordinates (first token of each cell)."""
    import plotly.graph_objects as go

    states = _decode(states)
    two_d = bool(states) and isinstance(states[0], (list, tuple))
    names = list(names or (TIER_ZONES if two_d else PAGED_STATES))
    z, text = block_map_grid(states, names, cols, hover)
    if row_labels is None and not two_d and z:
        row_labels = [f"{r * len(z[0])}" for r in range(len(z))]     # first block id of each row
    blocks = set(names) <= set(PAGED_STATES)
    x_title = ("block id" if two_d else "block id - row start") if blocks else "token position"
    fig = go.Figure(go.Heatmap(**_heatmap_kwargs(names, z, text, row_labels, x)))
    fig.update_layout(title=title or f"KV block map ({len(states)} {'rows' if two_d else 'blocks'})",
                      height=height or max(220, 90 + 22 * len(z)), margin=dict(l=70, r=20, t=50, b=40),
                      xaxis=dict(showgrid=False, zeroline=False, title=x_title), plot_bgcolor="white",
                      yaxis=dict(autorange="reversed", type="category"))
    return fig


# ---- the live view ------------------------------------------------------------------------------
class KVBlockMapView:
    """A live heatmap of the KV cache while requests run (paged: physical blocks; tiered: layers
    x positions), redrawn at most ``max_hz`` times a second inside ``fig.batch_update()``::

        view = KVBlockMapView(max_hz=10)
        outs = view.run(llm, prompts, SamplingParams(temperature=0, max_tokens=16))
        view.static_figure()       # a plain go.Figure: saved FigureWidget state is stale

    ``attach(llm)`` subscribes to a paged pool's listeners (redraws on its begin / step / end
    events, also when someone else drives the engine); a tiered engine has no listeners, so
    :meth:`run` redraws between tokens, or call :meth:`refresh`.  The widget is built when the
    view is first displayed; until then nothing is drawn (``static_figure`` always works).
    """

    def __init__(self, max_hz: float = 10.0, cols: int = 32, cell_tokens: int = 1, title: str | None = None,
                 height: int | None = None) -> None:
        if not 0 < max_hz <= 60:
            raise ValueError(f"KVBlockMapView: max_hz must be in (0, 60], got {max_hz}")
        if cell_tokens < 1:
            raise ValueError(f"KVBlockMapView: cell_tokens must be >= 1, got {cell_tokens}")
        self.min_interval, self.cols, self.cell_tokens = 1.0 / max_hz, cols, cell_tokens
        self.title, self.height = title, height
        self.llm = self.pool = None
        self.fig = self.label = self.widget = None
        self.updates, self.update_seconds, self.events = 0, 0.0, 0
        self._last = 0.0

    # ---- state --------------------------------------------------------------------------------
    def attach(self, llm) -> "KVBlockMapView":
        self.detach()
        self.llm = llm
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
        if self.fig is not None and time.perf_counter() - self._last >= self.min_interval:
            self._redraw()

    def snapshot(self) -> dict:
        """What is drawn now: states (1-D paged, 2-D tiered), state names, hover text, title."""
        if self.llm is None:
            raise ValueError("KVBlockMapView: attach(llm) or run(llm, ...) first")
        if self.llm.kv_pool is not None:
            return self._paged_snapshot(self.llm.kv_pool.manager)
        cache = next(reversed(self.llm.active_caches.values()), None) if self.llm.active_caches else self.llm.last_cache
        return self._tier_snapshot(cache)

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
                "row_labels": None, "x": None}

    def _tier_snapshot(self, cache) -> dict:
        if cache is None or not cache.length:
            return {"mode": "tiered", "states": [], "names": list(TIER_ZONES), "hover": None,
                    "title": "tiered KV cache: no request yet", "row_labels": None, "x": None}
        rep = tier_report(cache)
        k = self.cell_tokens
        states, hover = [], []
        for layer, (names, heads) in enumerate(zip(rep["zone_map"], rep["fetched_heads"])):
            srow, hrow = [], []
            for a in range(0, len(names), k):
                cnt = Counter(names[a:a + k])
                srow.append(cnt.most_common(1)[0][0])
                where = f"position {a}" if k == 1 else f"positions [{a}, {min(a + k, len(names))})"
                what = (names[a] + (f" by {heads[a]} of {rep['num_kv_heads']} KV heads" if names[a] == "fetched" else "")
                        if k == 1 else ", ".join(f"{z} {n}" for z, n in cnt.most_common()))
                hrow.append(f"layer {layer}, {where}: {what}")
            states.append(srow)
            hover.append(hrow)
        z = rep["zones"]
        title = self.title or (f"Tiered KV cache, {rep['length']} tokens: hot {z['hot']}, warm {z['warm']}, "
                               f"cold {z['cold']}, dropped {z['dropped']}; resident "
                               f"{rep['bytes']['resident'] / max(rep['bytes']['full'], 1):.0%} of full")
        return {"mode": "tiered", "states": states, "names": list(TIER_ZONES), "hover": hover, "title": title,
                "row_labels": [f"layer {i}" for i in range(len(states))], "x": list(range(0, rep["length"], k))}

    # ---- drawing ------------------------------------------------------------------------------
    def static_figure(self):
        """A plain ``go.Figure`` of the current state (safe to save in reports)."""
        s = self.snapshot()
        return block_map_figure(s["states"], s["names"], self.cols, s["hover"], s["title"], s["row_labels"],
                                self.height, s["x"])

    def _build(self) -> None:
        import ipywidgets as widgets
        import plotly.graph_objects as go

        self.fig = go.FigureWidget(self.static_figure() if self.llm is not None else go.Figure(go.Heatmap()))
        self.label = widgets.HTML(value="")
        self.widget = widgets.VBox([self.label, self.fig])

    def _redraw(self) -> None:
        t0 = time.perf_counter()
        s = self.snapshot()
        z, text = block_map_grid(s["states"], s["names"], self.cols, s["hover"])
        labels = (s["row_labels"] or [f"{r * len(z[0])}" for r in range(len(z))]) if z else None
        with self.fig.batch_update():
            self.fig.data[0].update(**_heatmap_kwargs(s["names"], z, text, labels, s["x"]))
            self.fig.layout.title = s["title"]
        self.updates += 1
        self.update_seconds += time.perf_counter() - t0
        self.label.value = (f"redraws: {self.updates} ({self.update_seconds * 1e3:.0f} ms), "
                            f"pool events seen: {self.events}")
        self._last = time.perf_counter()

    def refresh(self) -> None:
        if self.fig is not None:
            self._redraw()

    def display(self) -> "KVBlockMapView":
        from IPython.display import display

        if self.fig is None:
            self._build()
        display(self.widget)
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
                        elif self.pool is None and self.fig is not None and \
                                time.perf_counter() - self._last >= self.min_interval:
                            self._redraw()              # tiered: no pool events, redraw between tokens
                self.refresh()                          # the finished requests' blocks are released now
        finally:
            for st in streams:                          # on an error: every request gives its blocks back
                st.close()
            together.__exit__(None, None, None)
        return outs[0] if single else outs


def pareto_figure(df, x: str = "reduction", y: str = "rel_ppl", max_rel_ppl: float | None = 0.02,
                  title: str = "Tiered KV cache: memory reduction vs perplexity increase"):
    """Plotly scatter of every config, the Pareto front as a line, the quality threshold dashed."""
    import plotly.graph_objects as go

    ok = df[df["error"].isna()] if "error" in df else df
    from workbench.bench.tier_eval import pareto_front

    front = pareto_front(df, x, y)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=ok[x], y=100 * ok[y], mode="markers", name="configs", text=ok["name"],
                             hovertemplate="%{text}<br>reduction %{x:.2f}x<br>ppl %{y:+.2f}%<extra></extra>"))
    fig.add_trace(go.Scatter(x=front[x], y=100 * front[y], mode="lines+markers", name="Pareto front",
                             text=front["name"], hovertemplate="%{text}<extra></extra>"))
    if max_rel_ppl is not None:
        fig.add_hline(y=100 * max_rel_ppl, line_dash="dash", annotation_text=f"+{100 * max_rel_ppl:g}% ppl")
    fig.update_layout(title=title, xaxis_title="KV memory reduction vs full cache (x)",
                      yaxis_title="perplexity change (%)", height=420)
    return fig
