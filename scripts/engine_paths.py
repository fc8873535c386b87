"""Greedy tokens of every engine path on one model, against the reference configuration.

    TRITON_INTERPRET=1 .venv/bin/python scripts/engine_paths.py [--prompts 4] [--max-tokens 16] [--json]

Exact paths (identical tokens expected): the batched engine with 1 and with 8 streams,
chunked prefill, the paged pool with the prefix cache, host offload restores, the static
decode step.  Non-exact paths (another reduction order: token agreement, and at the first
divergence the reference's logit margin between its token and the other path's): each Triton
backend alone, all of them, torch.compile of the static step.  On a CPU the Triton kernels run
under the interpreter (set TRITON_INTERPRET=1 before Python starts); on a GPU, compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import workbench  # noqa: E402
from workbench import LLMEngine, SamplingParams, SchedulerConfig  # noqa: E402
from workbench.transforms.backends import OPS, available_backends, using_backends  # noqa: E402
from workbench.data import heldout_prompts  # noqa: E402
from workbench.kv.paged import PagedKVConfig  # noqa: E402
from workbench.measure.agreement import agreement, divergence_margin  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--skip-triton", action="store_true",
                    help="leave out the Triton backends (slow under the interpreter)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    llm = workbench.LLM(args.model, device=args.device)
    system = "You are a helpful assistant for the Python documentation. "
    prompts = [llm.encode(system + p)[1] for p in heldout_prompts(args.prompts, chars=120)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompts, params)]
    ctx = max(map(len, prompts)) + args.max_tokens + 1

    def front(**kw):
        return workbench.LLM(llm.model, tokenizer=llm.tokenizer, **kw)

    def batched(**kw):
        return LLMEngine(llm, **kw)

    exact = {
        "batched, 1 stream": lambda: batched(scheduler=SchedulerConfig(max_num_seqs=1)),
        "batched, 8 streams": lambda: batched(scheduler=SchedulerConfig(max_num_seqs=8)),
        "chunked prefill (16-token budget)": lambda: batched(scheduler=SchedulerConfig(max_num_seqs=8,
                                                                                        max_num_batched_tokens=16)),
        "paged + prefix cache (LLM front)": lambda: front(kv=PagedKVConfig(block_size=8)),
        "host offload restores (batched)": lambda: batched(scheduler=SchedulerConfig(max_num_seqs=4),
                                                           kv=PagedKVConfig(block_size=4, num_blocks=48,
                                                                            offload="host")),
        "static decode (eager)": lambda: front(max_model_len=ctx, static_decode=True),
    }
    nonexact = {"compile (static decode)": lambda: front(max_model_len=ctx, compile=True),
                "static decode over the paged pool (eager)": lambda: front(max_model_len=ctx, kv=PagedKVConfig(),
                                                                           static_decode=True),
                "compile over the paged pool, 8 streams": lambda: front(max_model_len=ctx, kv=PagedKVConfig(),
                                                                        compile=True,
                                                                        scheduler=SchedulerConfig(max_num_seqs=8))}
    triton_ok = "triton" in available_backends("rmsnorm") and (llm.device.type == "cuda"
                                                                 or os.environ.get("TRITON_INTERPRET") == "1")
    rows = []

    def measure(name: str, make, kind: str, backends: dict | None = None) -> None:
        t0 = time.perf_counter()
        with using_backends(llm.model, backends or {}):
            eng = make()
            if isinstance(eng, LLMEngine) and "offload" in name:
                eng.generate(prompts[:1], params)          # fill the pool, spill, come back
                filler = [[int(t) for t in torch.randint(5, 900, (60,), generator=torch.Generator().manual_seed(s))]
                          for s in range(3)]
                eng.generate(filler, SamplingParams(temperature=0, max_tokens=2))
            got = [o.token_ids for o in eng.generate(prompts, params)]
        a = agreement(ref, got)
        margins = [divergence_margin(llm.model, p, r, g) for p, r, g in zip(prompts, ref, got)]
        extra = {}
        if "offload" in name:
            extra["restored_blocks"] = eng.pool.manager.stats.restored_blocks
        rows.append({"path": name, "kind": kind, "agreement": a["rate"],
                     "identical_sequences": a["identical_sequences"], "sequences": a["sequences"],
                     "first_divergence": [m for m in margins if m],
                     "seconds": time.perf_counter() - t0, **extra})

    for name, make in exact.items():
        measure(name, make, "exact")
    for name, make in nonexact.items():
        measure(name, make, "non-exact")
    if triton_ok and not args.skip_triton:
        for op in OPS:
            if "triton" in available_backends(op):
                measure(f"{op}=triton", lambda: front(), "non-exact", {op: "triton"})
        measure("all Triton backends", lambda: front(), "non-exact",
                {op: "triton" for op in OPS if "triton" in available_backends(op)})
    if args.json:
        print(json.dumps({"device": str(llm.device), "prompts": len(prompts), "max_tokens": args.max_tokens,
                          "rows": rows}, indent=1))
        return 0
    print(f"{len(prompts)} prompts x {args.max_tokens} greedy tokens on {llm.device}, against the reference "
          "configuration")
    for r in rows:
        div = "; ".join(f"token {d['position']}: margin {d['margin']:.2e} (top-2 gap {d['top2_gap']:.2e})"
                        for d in r["first_divergence"]) or "-"
        extra = f", {r['restored_blocks']} blocks restored" if "restored_blocks" in r else ""
        print(f"{r['path']:<36} {r['kind']:<10} agreement {r['agreement']:7.1%}  identical "
              f"{r['identical_sequences']}/{r['sequences']}{extra}  first divergence: {div}  ({r['seconds']:.0f} s)")
    bad = [r["path"] for r in rows if r["kind"] == "exact" and r["agreement"] != 1.0]
    if bad:
        print("NOT IDENTICAL on an exact path: " + ", ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
