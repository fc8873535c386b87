"""``workbench claims``: the claims lab - every testable claim of the source articles, measured on
this machine (or read from the committed GPU results), with a verdict and the reason for it."""

from __future__ import annotations

import sys


def cmd_claims(args) -> int:
    from workbench.bench.claims import (
        ClaimContext,
        all_claims,
        dumps,
        format_claims,
        problems,
        run_claims,
    )

    if args.list:
        for c in all_claims():
            print(f"{c.id:<28} {c.device:<4} {c.source:<16} {c.claim}")
        return 0
    ctx = ClaimContext(mode=args.mode, model=args.model, device=args.device or "cpu", threads=args.threads)
    results = run_claims(args.only, ctx=ctx, progress=args.progress)
    text = dumps(results, ctx) if args.json else format_claims(results)
    if args.out:
        from pathlib import Path

        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(dumps(results, ctx))
    print(text)
    bad = problems(results)
    for p in bad:
        print(f"workbench claims: {p}", file=sys.stderr)
    return 1 if bad else 0


def add_claims_parser(sub) -> None:
    p = sub.add_parser("claims", help="the claims lab: each claim of the source articles measured here, with a verdict")
    p.add_argument("--json", action="store_true",
                   help="print the claims as JSON (meta, one object per claim, problems)")
    p.add_argument("--mode", default="full", choices=("smoke", "full"),
                   help="smoke: the smallest sizes that still give a verdict (about a minute on 2 cores); "
                        "full: the sizes the closing figures use (default)")
    p.add_argument("--only", default=None, help="comma-separated claim ids (see --list)")
    p.add_argument("--list", action="store_true", help="list the claims and exit")
    p.add_argument("--out", default=None, help="also write the JSON document to this file")
    p.add_argument("--progress", action="store_true", help="print each claim as it is measured (to stdout)")
    p.add_argument("--model", default=None,
                   help="Hugging Face-format folder or preset:<name> (default: the bundled model)")
    p.add_argument("--device", default=None, help="cpu (default) or cuda")
    p.add_argument("--threads", default=None, help="torch threads on a CPU (default: measured at load)")
    p.set_defaults(func=cmd_claims)
