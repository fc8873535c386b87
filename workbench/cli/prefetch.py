"""``workbench prefetch-bench``: weight streaming from a slow tier, prefetched d layers ahead,
against all-resident and the synchronous fetch (:mod:`workbench.bench.prefetch`)."""

from __future__ import annotations

import json
import sys


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _spread(d, fmt="{:.3g}", scale=1.0) -> str:
    if d is None:
        return "-"
    return f"{fmt.format(scale * d['median'])} [{fmt.format(scale * d['min'])}..{fmt.format(scale * d['max'])}]"


def _table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([line(cells[0]), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]])


def format_prefetch_bench(res: dict) -> str:
    out = [f"prefetch-bench ({res['mode']}, {res['device']}, {res['threads']} torch thread(s), "
           f"{res['seconds']:.0f} s)", "", "link: GB/s per block size (queued: median [min..max]; one at a time: us)"]
    out.append(_table(["link", "mode", "block", "blocks", "GB/s queued", "us/block", "GB/s alone"],
                      [[r["transport"], r["read_mode"] or "-", _size(r["block_bytes"]), r["blocks"],
                        f"{r['gbps_median']:.3f} [{r['gbps_min']:.3f}..{r['gbps_max']:.3f}]",
                        f"{r['us_per_block']:.0f}", f"{r['sync_gbps']:.3f}"] for r in res["link"]["rows"]]))
    out.append("ceilings: " + ", ".join(f"{k} {v:.3f} GB/s" for k, v in res["link"]["ceiling_gbps"].items()))
    pick = res["pick"]
    out += ["", "copy / compute per streamed layer (copy: d=0 copy events; compute: all-resident hooks)"]
    out.append(_table(["model", "workload", "layer MB", "copy ms", "compute ms", "ratio", "in [0.5, 2]"],
                      [[c["model"], c["workload"], f"{c['layer_bytes'] / 1e6:.1f}", f"{c['copy_ms']:.2f}",
                        f"{c['compute_ms_mean']:.2f}", f"{c['ratio']:.2f}", "yes" if c["in_range"] else "no"]
                       for c in pick["candidates"]]))
    ch = pick["chosen"]
    out.append(f"chosen: {ch['model']} {ch['workload']} (ratio {ch['ratio']:.2f})")
    exp = res["streaming"]
    out += ["", f"streaming: {exp['model']}, {exp['resident_layers']}/{exp['layers']} layers resident, "
                f"{exp['rows'][0]['runs']} interleaved runs each"]
    out.append(_rows_table(exp["rows"]))
    ms = lambda k: f"{exp.get(k, float('nan')) * 1e3:.1f} ms"          # noqa: E731
    out.append(f"t_resident {ms('t_resident')}, t_sync {ms('t_sync')}, t_best {ms('t_best')} ({exp['best']}), "
               f"t_ideal {ms('t_ideal')}, t_lane {ms('t_lane')}; copy {exp['copy_ms_per_layer']:.2f} ms/layer")
    hs, rng = exp.get("hidden_share"), exp.get("hidden_share_range")
    out.append(f"hidden share (t_sync - t_best) / (t_sync - t_ideal) = {_pct(hs)}"
               + (f" [{_pct(rng[0])}..{_pct(rng[1])}]" if rng else "")
               + f"; against the one-lane bound t_lane: {_pct(exp.get('hidden_share_lane'))}")
    sw = res["sweep"]
    out += ["", f"resident fraction at d={sw['distance']}"]
    out.append(_table(["resident", "tokens/s", "resident MB", "hit rate", "same tokens"],
                      [[f"{r['resident_layers']}/{sw['layers']}", _spread(r["tokens_per_s"], "{:.0f}"),
                        f"{r['resident_bytes'] / 1e6:.1f}" if "resident_bytes" in r else "all",
                        _spread(r.get("prefetch_hit_rate"), "{:.0%}"), r["tokens_identical"]] for r in sw["rows"]]))
    out += ["", "engine options (greedy tokens, streaming vs all-resident, and after remove())"]
    out.append(_table(["option", "ok", "hit rate", "seconds", "error"],
                      [[o["option"], o["ok"], _pct(o.get("prefetch_hit_rate")), f"{o['seconds']:.1f}",
                        o.get("error") or ""] for o in res["engine_options"]]))
    out += ["", "verdict"]
    for k, v in res["verdict"].items():
        if isinstance(v, dict):
            m = v.get("measured") or v.get("measured_best")
            shown = _spread(m, "{:.0%}") if isinstance(m, dict) else _pct(m)
            extra = (f" (sync {_spread(v['measured_sync'], '{:.0%}')}; at most {_pct(v.get('bound'))} with this "
                     "copy / compute: bytes / ceiling / t_lane)" if "measured_sync" in v else "")
            out.append(f"  {v['claim']}: {v['verdict']} - measured {shown}{extra}")
        else:
            out.append(f"  {k}: {v}")
    return "\n".join(out)


def _rows_table(rows: list[dict]) -> str:
    return _table(["config", "tokens/s", "wall ms", "hit rate", "stall ms", "efficiency", "GB/s", "link use",
                   "link busy", "resident MB", "same tokens"],
                  [[r["config"], _spread(r["tokens_per_s"], "{:.0f}"), _spread(r["wall_s"], "{:.1f}", 1e3),
                    _spread(r.get("prefetch_hit_rate"), "{:.0%}"), _spread(r.get("stall_s"), "{:.1f}", 1e3),
                    _spread(r.get("prefetch_efficiency"), "{:.0%}"),
                    "-" if r.get("achieved_gbps") is None else f"{r['achieved_gbps']:.2f}",
                    _spread(r.get("link_use"), "{:.0%}"), _spread(r.get("link_busy"), "{:.0%}"),
                    f"{r['resident_bytes'] / 1e6:.1f}" if "resident_bytes" in r else "all", r["tokens_identical"]]
                   for r in rows])


def _size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift} {unit}" if n % (1 << shift) == 0 else f"{n / (1 << shift):.2f} {unit}"
    return f"{n} B"


def cmd_prefetch_bench(args) -> int:
    from workbench.bench.prefetch import prefetch_bench

    progress = None if args.json or args.quiet else (lambda msg: print(f"... {msg}", file=sys.stderr))
    options = tuple(o for o in args.options.split(",") if o)
    res = prefetch_bench(smoke=not args.full, device=args.device, threads=args.threads, transport=args.transport,
                         options=options, progress=progress)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2, default=str)
    print(json.dumps(res, indent=2, default=str) if args.json else format_prefetch_bench(res))
    return 0


def add_prefetch_bench_parser(sub) -> None:
    p = sub.add_parser("prefetch-bench", help="weight streaming: layers fetched from disk d layers ahead vs "
                                              "all-resident and synchronous; link ceilings per block size")
    p.add_argument("--full", action="store_true", help="all block sizes, more repeats, larger candidates (< 10 min; "
                                                       "default: the smoke run, < 60 s)")
    p.add_argument("--device", default=None, help="cpu (default without CUDA) or cuda: the streaming transport "
                                                  "follows (disk on a CPU, pinned host -> HBM on CUDA)")
    p.add_argument("--transport", default="auto", choices=["auto", "disk", "host", "cuda"],
                   help="the slow tier (auto: cuda on a CUDA device, else disk)")
    p.add_argument("--threads", default="1",
                   help="torch intra-op threads: N or auto (default 1: on 2 cores the copy lane needs the other)")
    p.add_argument("--options", default="eager,fused,compile",
                   help="engine options checked with streaming (comma-separated: eager, fused, compile; empty: none)")
    p.add_argument("--out", default=None, help="also write the JSON document to this file")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_prefetch_bench)
