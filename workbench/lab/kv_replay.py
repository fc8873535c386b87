"""Replays of notebook 02's views: the KV pool state by state, the prefix cache's hits and misses
request by request, and the tiered cache's hot / warm / cold zones token by token.

A live block map redraws a few times in a few tens of ms on a CPU, so a learner sees only its end.
The views therefore *record* every state they see, compactly and cheaply, while the run goes on
(:class:`~workbench.lab.kv_view.KVBlockMapView` does it on every pool event and every token), and
the functions here turn the recording into one plotly figure with frames, play / pause, speeds and
a scrubber (:func:`workbench.lab.replay.replay_figure`), which replays the same in a live notebook,
a saved one and the HTML report.

What is recorded (the ``data[0]`` of each :class:`~workbench.lab.replay.Frame`):

* a pool state, :func:`pool_state`: the block states as one character each
  (:data:`~workbench.kv.inspect.CHARS`), each live sequence's block table, and what every request
  admitted so far reused (prompt tokens, reused tokens, miss reason);
* a zone state, :func:`zone_state`: per layer, the zone of every position as one character, as
  the newest token's query sees them.

Figures: :func:`pool_replay_figure` (block map on top, hits and misses per request below),
:func:`record_frames` (the same frames from a :class:`~workbench.kv.inspect.KVInspector`'s
records: one per finished request, nothing more to record), :func:`zone_replay_figure`.
"""

from __future__ import annotations

import math
from collections import Counter

from workbench.kv.inspect import CHARS, PAGED_STATES, TIER_ZONES, allocation_record
from workbench.lab.replay import MAX_FRAMES, Frame, replay_figure

NAME_OF = {c: name for name, c in CHARS.items()}
HIT_COLOR, MISS_COLOR = "#009E73", "#D55E00"        # PALETTE's green and vermillion (colour-blind safe)
MAX_ZONE_COLS = 128                                  # a zone map's cells per row in a replay (frames stay small)


# ---- recording (during the run: cheap) ----------------------------------------------------------
def pool_state(pool, requests: dict) -> dict:
    """The pool now, compactly: ``states`` (one character per block), ``tables`` (live sequence
    -> its blocks) and ``requests`` (every request admitted so far -> ``(prompt tokens, reused
    tokens, miss reason)``, in admission order)."""
    m = pool.manager
    return {"states": "".join(CHARS[s] for s in m.block_states()),
            "tables": tuple((sid, tuple(m.block_table(sid))) for sid in m.seq_ids()),
            "requests": tuple(requests.items())}


def admission(pool, seq_id: str) -> tuple:
    """``(prompt tokens, reused tokens, miss reason or None)`` of a request just admitted."""
    a = allocation_record(pool.admissions[seq_id])
    return a["prompt_tokens"], a["cached_tokens"], a["miss_reason"]


def zone_state(rep: dict) -> dict:
    """A tier report (:func:`~workbench.kv.inspect.tier_report`) compactly: ``zones`` (per layer,
    one character per position), ``length`` and the zone counts."""
    return {"zones": tuple("".join(CHARS[z] for z in row) for row in rep["zone_map"]), "length": rep["length"],
            "counts": tuple(sorted(rep["zones"].items()))}


def cache_zone_state(cache) -> dict:
    """:func:`zone_state` of a tiered cache now, without the rest of a tier report (key norms,
    bytes): the zone map of :func:`~workbench.kv.inspect.tier_report` - the zones as the newest
    token's query sees them, ``fetched`` where routing fetched a position for any KV head - at a
    fraction of its cost, since a live view records it on every token."""
    import torch

    from workbench.kv.tier_config import zone_masks
    from workbench.kv.tier_inspect import _fetched_tokens     # the report's own rule for "fetched"

    cfg, n = cache.cfg, cache.length
    z = cache.zone_counts()
    drop = cfg.cold_mode == "drop"
    counts = {"hot": z.hot, "warm": z.warm, "cold": z.cold_tokens, "cold_chunks": z.cold_chunks,
              "dropped": z.cold_tokens if drop else 0, "offloaded": n - z.hot - (z.cold_tokens if drop else 0)}
    if not n:
        return {"zones": (), "length": 0, "counts": tuple(sorted(counts.items()))}
    m = zone_masks(n - 1, 1, cfg)
    hot, warm, cold = m.hot[0].cpu(), m.warm[0].cpu(), m.cold[0].cpu()
    routable = warm | (cold if not drop else torch.zeros_like(cold))
    base = torch.full((n,), ord(CHARS["warm"]), dtype=torch.uint8)
    base[cold] = ord(CHARS["dropped" if drop else "cold"])
    base[hot] = ord(CHARS["hot"])
    rows = []
    for layer in range(cache.model_cfg.num_hidden_layers):
        f = _fetched_tokens(cache, layer, n, routable)
        row = base if f is None else torch.where(f[0].any(0).cpu(), ord(CHARS["fetched"]), base).to(torch.uint8)
        rows.append(bytes(row.tolist()).decode("ascii"))
    return {"zones": tuple(rows), "length": n, "counts": tuple(sorted(counts.items()))}


# ---- the pool ----------------------------------------------------------------------------------
def _owners(tables) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for sid, table in tables:
        for b in table:
            out.setdefault(b, []).append(sid)
    return out


def _pool_traces(state: dict, order: list[str], cols: int) -> list[dict]:
    """One frame's traces: the block map (heatmap), reused and computed prompt tokens per request."""
    from workbench.lab.kv_view import block_map_grid

    names = [NAME_OF[c] for c in state["states"]]
    owners = _owners(state["tables"])
    hover = [f"block {i}: {s}" + (f"<br>used by {', '.join(owners[i])}" if i in owners else "")
             for i, s in enumerate(names)]
    z, text = block_map_grid(names, list(PAGED_STATES), cols, hover)
    heat = {"z": z, "text": text}           # the rows' labels do not change: the first frame's stay
    got = dict(state["requests"])
    hit = [got[r][1] if r in got else None for r in order]
    miss = [got[r][0] - got[r][1] if r in got else None for r in order]
    why = [("" if got[r][2] is None else got[r][2]) if r in got else "" for r in order]
    return [{"type": "heatmap", **heat},
            {"type": "bar", "x": order, "y": hit},
            {"type": "bar", "x": order, "y": miss, "text": why, "customdata": why}]


def _pool_title(state: dict, label: str) -> str:
    c = Counter(NAME_OF[ch] for ch in state["states"])
    reqs = state["requests"]
    prompt = sum(p for _, (p, _, _) in reqs)
    hit = sum(h for _, (_, h, _) in reqs)
    rate = f"; prefix cache: {hit:,} of {prompt:,} prompt tokens reused ({hit / prompt:.0%})" if prompt else ""
    return (f"KV pool{' · ' + label if label else ''}<br><sup>" + ", ".join(f"{c[s]} {s}" for s in PAGED_STATES)
            + f" (of {len(state['states'])} blocks){rate}</sup>")


def pool_replay_figure(frames: list[Frame], cols: int = 32, note: str | None = None, max_frames: int = MAX_FRAMES):
    """The pool's recorded states (frames whose ``data[0]`` is a :func:`pool_state`) as one replay:
    on top the block map (free / owned / shared / cached, ``cols`` blocks per row), below it the
    prompt tokens of every request admitted so far, reused from the prefix cache (hit) or computed
    (miss, labelled with its reason).  Each frame's title says what changed (the frame's label) and
    counts the states and the prefix cache's hits so far."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from workbench.lab.kv_view import _heatmap_kwargs, wrapped_row_labels

    if not frames:
        raise ValueError("pool_replay_figure: no frames recorded")
    order = [sid for sid, _ in frames[-1].data[0]["requests"]]
    for f in frames:                                 # a request the last frame does not name (a view used twice)
        order += [sid for sid, _ in f.data[0]["requests"] if sid not in order]
    built = [Frame(f.t_ms, _pool_traces(f.data[0], order, cols), f.label,
                   {"title": {"text": _pool_title(f.data[0], f.label), "x": 0.01,
                              "xanchor": "left"}})
             for f in frames]
    first = built[0].data
    n_rows = len(first[0]["z"])
    first[0]["y"] = wrapped_row_labels(len(frames[0].data[0]["states"]), cols)
    fig = make_subplots(rows=2, cols=1, row_heights=[0.62, 0.38], vertical_spacing=0.2,
                        subplot_titles=("",      # above the map: the replay's buttons
                                        "prefix cache, per request: prompt tokens reused (hit) or computed "
                                        "(miss: reason)"))
    heat = _heatmap_kwargs(list(PAGED_STATES), first[0]["z"], first[0]["text"], first[0]["y"])
    heat["colorbar"].update(len=0.55, y=1.0, yanchor="top", x=1.01, title="block state<br><sub>(hover: users)</sub>")
    fig.add_trace(go.Heatmap(**heat), row=1, col=1)
    fig.add_trace(go.Bar(x=order, y=first[1]["y"], name="reused (hit)", marker_color=HIT_COLOR,
                         hovertemplate="%{x}: %{y} prompt tokens reused<extra></extra>"), row=2, col=1)
    fig.add_trace(go.Bar(x=order, y=first[2]["y"], name="computed (miss)", marker_color=MISS_COLOR,
                         text=first[2]["text"], customdata=first[2]["customdata"], textposition="outside",
                         cliponaxis=False, textfont={"color": "#333", "size": 11},
                         hovertemplate="%{x}: %{y} prompt tokens computed<br>miss reason: "
                                       "%{customdata}<extra></extra>"),
                  row=2, col=1)
    fig.update_yaxes(autorange="reversed", type="category", row=1, col=1)
    fig.update_xaxes(showgrid=False, zeroline=False, title_text="block (column within the row)",
                     dtick=1 if cols <= 16 else 2, row=1, col=1)
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=order,
                     title_text="request (admission order)", row=2, col=1)
    most = max((p for f in frames for _, (p, _, _) in f.data[0]["requests"]), default=1)
    fig.update_yaxes(title_text="prompt tokens", range=[0, most * 1.2], row=2, col=1)
    fig.update_layout(barmode="stack", plot_bgcolor="white", height=260 + 22 * n_rows + 220,
                      margin={"l": 90, "r": 150, "t": 90, "b": 60},
                      legend={"x": 1.01, "y": 0.0, "yanchor": "bottom", "xanchor": "left",
                              "title": {"text": "prompt tokens"}},
                      title=built[0].layout["title"])
    return readable_current(replay_figure(fig, built, max_frames=max_frames, redraw=True, note=note))


def readable_current(fig):
    """The slider's current value ("t = 12.3 ms · req-1 begins") in a colour of its own: a replay of
    many frames hides the step labels with a transparent font, which the current value would inherit."""
    if fig.layout.sliders:
        fig.layout.sliders[0].currentvalue.font.color = "#333"
    return fig


def record_frames(records, block_size: int | None = None) -> list[Frame]:
    """One pool frame per finished request, from a :class:`~workbench.kv.inspect.KVInspector`'s
    records (made with ``block_maps=True``): the pool as the request ended, and every request's
    reuse up to it.  Times: the requests' durations added up (they ran one after another)."""
    out, requests, t = [], {}, 0.0
    for rec in records:
        if "block_map" not in rec:
            raise ValueError("record_frames: the inspector kept no block maps (KVInspector(..., block_maps=True))")
        requests[rec["seq_id"]] = (rec["prompt_tokens"] or 0, rec["cached_tokens"] or 0, rec["miss_reason"])
        requests = dict(requests)
        t += (rec.get("seconds") or 0.0) * 1e3
        state = {"states": rec["block_map"], "tables": ((rec["seq_id"], tuple(rec["block_table"])),),
                 "requests": tuple(requests.items())}
        out.append(Frame(t, [state], f"{rec['seq_id']} ends"))
    return out


# ---- the tiered cache's zones ------------------------------------------------------------------
def _zone_cells(row: str, k: int) -> list[str]:
    """A layer's per-position zone characters -> one zone name per cell of ``k`` positions (its most
    frequent zone; a cell where routing fetched any position shows ``fetched``)."""
    out = []
    for a in range(0, len(row), k):
        part = row[a:a + k]
        out.append("fetched" if CHARS["fetched"] in part else NAME_OF[Counter(part).most_common(1)[0][0]])
    return out


def zone_replay_figure(frames: list[Frame], title: str = "Tiered KV cache, token by token",
                       max_cols: int = MAX_ZONE_COLS, note: str | None = None, max_frames: int = MAX_FRAMES):
    """The tiered cache's recorded zones (frames whose ``data[0]`` is a :func:`zone_state`) as one
    replay: rows are layers, columns cells of ``k`` token positions (``k`` so that the longest
    frame has at most ``max_cols`` cells), coloured hot / warm / cold / fetched / dropped."""
    import plotly.graph_objects as go

    from workbench.lab.kv_view import _heatmap_kwargs, x_axis_title

    if not frames:
        raise ValueError("zone_replay_figure: no frames recorded")
    names = list(TIER_ZONES)
    longest = max(f.data[0]["length"] for f in frames)
    k = max(1, math.ceil(longest / max_cols))
    built = []
    for f in frames:
        s = f.data[0]
        cells = [_zone_cells(row, k) for row in s["zones"]]
        z = [[names.index(c) for c in row] for row in cells]
        counts = dict(s["counts"])
        head = (f"{s['length']} tokens: hot {counts.get('hot', 0)}, warm {counts.get('warm', 0)}, "
                f"cold {counts.get('cold', 0)}" + (f", dropped {counts['dropped']}" if counts.get("dropped") else ""))
        built.append(Frame(f.t_ms, [{"type": "heatmap", "z": z, "x": list(range(0, s["length"], k))}],
                           f.label, {"title": {"text": f"{title}: {head}<br><sup>cells of {k} positions "
                                                       "(a cell shows its most frequent zone, or fetched when routing "
                                                       "fetched any of it)</sup>",
                                               "x": 0.01, "xanchor": "left"}}))
    first = built[0].data[0]
    key = ", ".join(f"{i} {z}" for i, z in enumerate(names))        # no text per cell and frame: frames stay small
    heat = _heatmap_kwargs(names, first["z"], None, [f"layer {i}" for i in range(len(first["z"]))], first["x"],
                           f"%{{y}}, {k} positions from %{{x}}: zone %{{z}}<br>({key})<extra></extra>")
    fig = go.Figure(go.Heatmap(**heat))
    fig.update_layout(title=built[0].layout["title"],
                      height=max(260, 150 + 26 * len(first["z"])), margin={"l": 70, "r": 20, "t": 70, "b": 50},
                      plot_bgcolor="white", xaxis={"showgrid": False, "zeroline": False,
                                                   "title": x_axis_title(names, True), "range": [-k / 2, longest]},
                      yaxis={"autorange": "reversed", "type": "category"})
    return readable_current(replay_figure(fig, built, max_frames=max_frames, redraw=True, note=note))
