"""The KV cache as text: a block map of characters and readable pool / tier / server reports.

Inputs are the plain reports of :mod:`workbench.kv.inspect`; no plotly or ipywidgets, so the
CLI (``workbench model kv-inspect``) prints them with neither installed.  The figures and the
live view are in :mod:`workbench.lab.kv_view`, which re-exports these names.
"""

from __future__ import annotations

from workbench.kv.inspect import CHARS, PAGED_STATES


def text_block_map(states, width: int = 64) -> str:
    """One character per block (``. free  o owned  S shared  c cached``; tier zones ``H w C F x``),
    ``width`` per line, each line prefixed with its first block id (``width=0``: one bare line).
    ``states`` may also be such a string already (the inspector's ``record["block_map"]``)."""
    s = states if isinstance(states, str) else "".join(CHARS.get(x, "?") for x in states)
    if not width:
        return s
    pad = len(str(max(len(s) - 1, 0)))
    return "\n".join(f"{i:>{pad}}  {s[i:i + width]}" for i in range(0, len(s), width))


def zone_runs(names) -> list[tuple[str, int, int]]:
    """Run-length encoding of a per-position zone list: [(zone, start, end), ...]."""
    runs: list[tuple[str, int, int]] = []
    for i, z in enumerate(names):
        if runs and runs[-1][0] == z:
            runs[-1] = (z, runs[-1][1], i + 1)
        else:
            runs.append((z, i, i + 1))
    return runs


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x, fmt=".2f") -> str:
    return "-" if x is None else format(x, fmt)


def format_pool_report(rep: dict, width: int = 64, max_rows: int = 20) -> str:
    b, pc, by = rep["blocks"], rep["prefix_cache"], rep["bytes"]
    lines = [f"paged KV pool: {rep['num_blocks']} blocks x {rep['block_size']} tokens; {by['per_block']:,} B per block "
             f"({by['per_token']:,} B per token), {by['pool_tensors']:,} B of tensors",
             "blocks now: " + ", ".join(f"{b[s]} {s}" for s in PAGED_STATES),
             f"prefix cache: {'on (' + pc['eviction'] + ' eviction)' if pc['enabled'] else 'off'}; hit rate "
             f"{_pct(pc['hit_rate'])} ({pc['hit_tokens']:,} / {pc['prompt_tokens']:,} prompt tokens over "
             f"{pc['requests']} requests); full hits {pc['full_hits']}, partial hits {pc['partial_hits']}",
             "miss reasons: " + (", ".join(f"{k} {v}" for k, v in sorted(pc["miss_reasons"].items())) or "none"),
             f"evictions {pc['evictions']}, copy-on-write copies {pc['cow_copies']}, "
             f"blocks restored from the offload tier {pc['restored_blocks']}"]
    off = rep.get("offload")
    if off:
        s = off["stats"]
        lines.append(f"offload tier ({off['kind']}): {off['blocks_held']} / {off['capacity_blocks']} blocks held, "
                     f"{off['bytes_held']:,} B; {s['puts']} spilled ({s['bytes_out']:,} B in "
                     f"{s['seconds_out'] * 1e3:.2f} ms), {s['gets']} restored ({s['bytes_in']:,} B in "
                     f"{s['seconds_in'] * 1e3:.2f} ms)")
    lines.append(f"bookkeeping: {rep['manager_seconds'] * 1e3:.2f} ms in the block manager")
    legend = "  ".join(f"{CHARS[s]} {s}" for s in PAGED_STATES)
    lines += [f"block map now ({legend}):", text_block_map(rep["block_states"], width)]
    if rep["sequences"]:
        lines.append("live sequences: " + "; ".join(f"{s['seq_id']} {s['tokens']} tokens in {s['num_blocks']} blocks"
                                                      for s in rep["sequences"]))
    fin = rep.get("finished") or []
    if fin:
        lines.append(f"finished requests (last {min(len(fin), max_rows)} of {len(fin)} kept):")
        lines.append(f"{'request':<12}{'prompt':>7}{'cached':>8}{'reuse':>8}  {'miss reason':<20}{'blocks':>7}"
                     f"{'shared':>7}{'restored':>9}")
        for r in list(fin)[-max_rows:]:
            lines.append(f"{r['seq_id']:<12}{r.get('prompt_tokens', '-'):>7}{r.get('cached_tokens', '-'):>8}"
                         f"{_pct(r.get('reuse_ratio')):>8}  {str(r.get('miss_reason') or 'full hit'):<20}"
                         f"{r['num_blocks']:>7}{r['shared_blocks']:>7}{r.get('restored_blocks', '-'):>9}")
        last = list(fin)[-1]
        if last.get("block_map"):
            lines += [f"block map as {last['seq_id']} ended (before its blocks were released):",
                      text_block_map(last["block_map"], width)]
    return "\n".join(lines)


def format_tier_report(rep: dict) -> str:
    z, by = rep["zones"], rep["bytes"]
    red = f"{by['reduction']:.2f}x less" if by["reduction"] else "-"
    lines = [f"tiered KV cache {rep['config_name']}: {rep['length']} tokens, batch {rep['batch_size']}, "
             f"{rep['num_layers']} layers x {rep['num_kv_heads']} KV heads",
             f"zones for the last query (every layer): hot {z['hot']}, warm {z['warm']}, cold {z['cold']} "
             f"({z['cold_chunks']} chunks), dropped {z['dropped']}; offloaded (full precision only in the offload "
             f"tier) {z['offloaded']}",
             f"bytes (at {by['element_bytes']} B per element): resident {by['resident']:,} vs full cache "
             f"{by['full']:,} ({red}; PCA basis {by['basis']:,}); fetched at the last step "
             f"{by['fetched_last_step']:,.0f} B ({by['fetched_tokens_last_step']:.0f} token-heads over all layers)"]
    hdr = (f"{'layer':>5}{'hot':>6}{'warm':>6}{'cold':>6}{'dropped':>8}{'offloaded':>10}{'fetched/head':>13}"
           f"{'|k| hot':>14}{'|k| warm':>14}{'|k| cold':>14}{'warm err':>9}")
    lines += ["key norms: mean / max over tokens (cold: chunk means) and heads", hdr]
    for r in rep["layers"]:
        kn = r.get("key_norms", {})
        cell = lambda k: f"{_num(kn.get(k, {}).get('mean'))}/{_num(kn.get(k, {}).get('max'))}"  # noqa: E731
        lines.append(f"{r['layer']:>5}{r['hot']:>6}{r['warm']:>6}{r['cold']:>6}{r['dropped']:>8}{r['offloaded']:>10}"
                     f"{_num(r.get('fetched', 0), '.1f') + '/' + str(r.get('fetched_max_head', 0)):>13}"
                     f"{cell('hot'):>14}{cell('warm'):>14}{cell('cold'):>14}{_pct(kn.get('warm_rel_error')):>9}")
    if rep.get("zone_map"):
        lines.append("zone map per layer, [start, end) positions (fetched: by at least one KV head):")
        for i, names in enumerate(rep["zone_map"]):
            lines.append(f"  layer {i}: " + " ".join(f"{z}[{a},{b})" for z, a, b in zone_runs(names)))
    return "\n".join(lines)


def format_server_header(rep: dict) -> str:
    """The first line of a pool report a server sent (:func:`workbench.kv.inspect.fetch_pool_report`):
    model, engine thread and queue, and how stable the snapshot is."""
    srv = rep.get("server") or {}
    eng, snap = srv.get("engine") or {}, srv.get("snapshot") or {}
    alive = "engine running" if srv.get("engine_alive") else "engine thread NOT running" + (
        f" (last error: {srv['last_error']})" if srv.get("last_error") else "")
    queue = ", ".join(f"{eng[k]} {k}" for k in ("running", "waiting", "swapped", "finished") if k in eng)
    how = ("stable snapshot" if snap.get("stable") else "snapshot taken while the pool changed (not stable)") + (
        f" after {snap['attempts']} read(s)" if snap.get("attempts") else "")
    return (f"server: model {srv.get('model', '?')}; {alive}" + (f" at step {eng['steps']}" if "steps" in eng else "")
            + (f"; {queue}" if queue else "") + f"; {how}")


def format_report(rep: dict, width: int = 64) -> str:
    """Readable text for any report of :mod:`workbench.kv.inspect` (a server's pool report:
    :func:`format_server_header`, then the pool)."""
    if rep["mode"] == "paged":
        text = format_pool_report(rep, width)
        return format_server_header(rep) + "\n" + text if "server" in rep else text
    if rep["mode"] == "contiguous":
        return (f"{rep['message']}\nKV bytes per token {rep['kv_bytes_per_token']:,}; a full context of "
                f"{rep['max_model_len']} tokens takes {rep['bytes_full_context']:,} B")
    if "layers" in rep:
        return format_tier_report(rep)
    parts = [format_tier_report(r) for r in rep["active"].values()]
    if rep.get("last"):
        parts.append("last finished request:\n" + format_tier_report(rep["last"]))
    return "\n\n".join(parts) or f"tiered engine ({rep['config_name']}): no request has run yet"
