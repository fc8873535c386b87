"""Text labels that do not overlap: a plotly ``textposition`` per marker such that no two labels
overlap each other, any marker, a line or the plot's edge (:func:`label_positions`), and which
marker of a close group carries the group's label (:func:`label_leaders`).  The roofline of
notebook 01 (:func:`workbench.lab.kernels_view.roofline_figure`) places its labels with these."""

from __future__ import annotations

import itertools

# plotly textpositions in order of preference; each is (vertical, horizontal) placement of the label box
_POSITIONS = ("top center", "bottom center", "middle right", "middle left", "top right", "top left",
              "bottom right", "bottom left")


def label_box(px: float, py: float, position: str, w: float, h: float, r: float) -> tuple:
    """The pixel box ``(x0, y0, x1, y1)`` (y up) of a ``w`` x ``h`` text label at ``position`` around a
    marker of radius ``r`` at ``(px, py)``, as plotly places it (approximately)."""
    vert, horiz = position.split()
    y0 = {"top": py + r, "bottom": py - r - h, "middle": py - h / 2}[vert]
    if horiz == "center":
        x0 = px - w / 2
    elif vert == "middle":
        x0 = px + r if horiz == "right" else px - r - w
    else:                                        # a corner: the label starts (ends) at the marker's centre
        x0 = px if horiz == "right" else px - w
    return (x0, y0, x0 + w, y0 + h)


def _overlap(a: tuple, b: tuple) -> float:
    return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))


def label_positions(points, labels, x_range, y_range, size=(640, 320), char_px: float = 6.6,
                    line_px: float = 14.0, marker_px: float = 6.0, sweeps: int = 6, obstacles=()) -> list[str]:
    """A plotly ``textposition`` per point such that no two text labels overlap each other, any
    marker, a line drawn through ``obstacles`` (points along it, in axis units, each a 4 px
    square), or the plot's edge, where that is possible.  Greedy in the order of ``points`` (the
    first position of :data:`_POSITIONS` that is free, else the one that overlaps least), then
    ``sweeps`` passes that move each label to its least-overlapping position given the others.

    ``points`` are ``(x, y)`` in axis units (log10 of the value on a log axis), ``x_range`` /
    ``y_range`` the axes' ranges in the same units, ``size`` the plot area in pixels: an estimate
    (the figure is as wide as the page), and a smaller one than the real plot only spreads labels
    further apart.  Example: two points on top of each other get ``top center`` and ``bottom center``."""
    W, H = size
    sx, sy = W / (x_range[1] - x_range[0]), H / (y_range[1] - y_range[0])
    pix = [((x - x_range[0]) * sx, (y - y_range[0]) * sy) for x, y in points]
    markers = [(px - marker_px, py - marker_px, px + marker_px, py + marker_px) for px, py in pix]
    lines = [((x - x_range[0]) * sx - 2, (y - y_range[0]) * sy - 2,
              (x - x_range[0]) * sx + 2, (y - y_range[0]) * sy + 2)
             for x, y in obstacles]
    widths = [char_px * len(str(label)) for label in labels]
    boxes = [{pos: label_box(px, py, pos, w, line_px, marker_px) for pos in _POSITIONS}
             for (px, py), w in zip(pix, widths)]

    def cost(i: int, pos: str, chosen: dict) -> float:
        box = boxes[i][pos]
        return (widths[i] * line_px - _overlap(box, (0, 0, W, H))               # outside the plot
                + sum(_overlap(box, boxes[j][p]) for j, p in chosen.items() if j != i)
                + sum(_overlap(box, m) for j, m in enumerate(markers) if j != i)
                + sum(_overlap(box, o) for o in lines))

    def best(i: int, chosen: dict) -> str:
        costs = [(cost(i, pos, chosen), k, pos) for k, pos in enumerate(_POSITIONS)]
        return min(costs)[2]                      # ties: the earlier position of _POSITIONS

    chosen: dict[int, str] = {}
    for i in range(len(pix)):
        chosen[i] = best(i, chosen)
    for _ in range(sweeps):
        moved = False
        for i in range(len(pix)):
            pos = best(i, chosen)
            if cost(i, pos, chosen) < cost(i, chosen[i], chosen):
                chosen[i], moved = pos, True
        if not moved:
            break
    return [chosen[i] for i in range(len(pix))]


def label_leaders(ops, ys, merge: float) -> list[int]:
    """For each point, the point that carries its op's label (itself when it is labelled): the
    points of one op closer than ``merge`` to the next in ``y`` share one label, on the top one;
    points of the op farther apart get their own.  On a roofline an op's points stand in one
    column (its intensity is the same for every provider), so a GPU's eager, compile and triton
    points close together get one label, while a CPU's interpreter points far below get theirs."""
    leaders = list(range(len(ops)))
    by_op: dict = {}
    for i, op in enumerate(ops):
        by_op.setdefault(op, []).append(i)
    for idx in by_op.values():
        idx.sort(key=lambda i: -ys[i])
        for prev, i in itertools.pairwise(idx):
            if ys[prev] - ys[i] <= merge:
                leaders[i] = leaders[prev]
    return leaders

