"""Options and preparation shared by several ``workbench`` subcommands: the model and backend
options, ``--threads`` and Triton's interpreter on a CPU, the fast paths and the tiered cache."""

from __future__ import annotations

import argparse
import sys


def count(text: str) -> int:
    """argparse type of a count flag (blocks, sequences, tokens): a whole number, also written
    ``1e9`` or ``2_000_000``.  Its range is checked where the number is used, against the model
    and the machine (:mod:`workbench.engine.sizing`), in one line that says what it would cost."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if value != value or value in (float("inf"), float("-inf")) or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole number (such as 4096 or 1e6), got {text!r}")
    return int(value)


def add_memory_budget_arg(p) -> None:
    p.add_argument("--memory-budget", default=None, metavar="BYTES",
                   help="most memory the KV pool, its offload tier, the per-sequence caches and the static decode "
                        "buffers may take together, e.g. 8G or 512M (K, M, G = powers of 1024; default: what the "
                        "machine has available: MemAvailable, or the GPU's free memory). Sizes are computed from "
                        "the model's config before anything loads; what does not fit is refused naming its flag")


def check_sizes(args, **plan) -> None:
    """The engine a command is about to build, sized from the model's config before a weight
    is read (:func:`workbench.engine.sizing.check_before_loading`): a pool, cache or buffer that
    does not fit the machine or ``--memory-budget``, or a ``--max-model-len`` above the model's
    context, is refused in one line, without the load's time or memory.  ``plan``: the engine's
    ``kv``, ``scheduler``, ``tiers``, ``tier_store`` and ``static_decode``."""
    from workbench.engine.sizing import check_before_loading

    check_before_loading(getattr(args, "model", None), getattr(args, "device", None), getattr(args, "dtype", None),
                         max_model_len=getattr(args, "max_model_len", None),
                         memory_budget=getattr(args, "memory_budget", None), **plan)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face–format folder, preset:<name> (random weights), or omit for the bundled model")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: float32 on CPU, "
                                                 "the checkpoint's dtype on GPU)")
    p.add_argument("--no-check-finite", dest="check_finite", action="store_false",
                   help="load weights that hold NaN / Inf (refused by default: one pass over the tensors)")
    p.add_argument("--threads", default=None,
                   help="torch intra-op threads on a CPU: N (1 to the cores this process may use; more is refused), "
                        "or auto (default: measured on the loaded model, the fewest threads within 15%% of the "
                        "fastest decode step; env WORKBENCH_THREADS)")


def add_quant_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quant", default=None,
                   help="quantize the linear layers: w8a16 | w4a16 | w4a8 | w8a8, options joined by ':' - gN "
                        "(group), pc (per channel), pt (per tensor), asym, fallback=pow2|per-channel, awq | gptq "
                        "(calibrated on the bundled held-out calibration documents), smooth[=ALPHA] (SmoothQuant) - "
                        "e.g. w4a16:g128:awq; A16 = the model's activation dtype (fp32 on a CPU), A8 = int8 per token")
    p.add_argument("--quant-backend", default="auto", choices=("auto", "reference", "cpu", "triton"),
                   help="how quantized layers compute: auto (torch's packed CPU ops on a CPU, Triton kernels on a "
                        "GPU), reference (dequantize, then matmul), cpu, triton; layers a backend cannot run keep the "
                        "reference")


def add_backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default=None,
                   help="per-op backends: eager | triton | compile (every op), or OP=BACKEND,... with OP in rmsnorm, "
                        "rope, swiglu, attention_prefill, attention_decode, sampling (default: eager)")


def prepare_triton(args) -> None:
    """``--backend`` with Triton on a CPU: run the kernels under the Triton interpreter.

    ``TRITON_INTERPRET`` is read when triton itself is first imported (its standard library is
    decorated then), so it is set here, before any command loads a model."""
    import os

    spec = getattr(args, "backend", None)
    if not spec or "triton" not in spec or os.environ.get("TRITON_INTERPRET") == "1":
        return
    device = getattr(args, "device", None)
    if device is None:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cpu"):
        os.environ["TRITON_INTERPRET"] = "1"
        print("note: Triton kernels on a CPU run under the Triton interpreter (correct, slow: not speed figures)",
              file=sys.stderr)


def prepare_threads(args) -> None:
    """``--threads``: checked now (a clear error before any model loads), then handed to every
    engine this command builds through ``WORKBENCH_THREADS`` (see workbench.measure.threads);
    ``bench`` also passes it to its engine directly, so its JSON records the argument."""
    import os

    value = getattr(args, "threads", None)
    if value is None:
        return
    from workbench.measure.threads import ENV, usable_threads

    n = usable_threads(value, where="--threads")     # at most the cores this process may use
    os.environ[ENV] = "auto" if n is None else str(n)


def apply_backend(llm, spec: str | None, device_type: str) -> None:
    """Apply ``--backend`` (already checked by :func:`prepare_triton`) to a loaded LLM."""
    if not spec:
        return
    from workbench.transforms.backends import apply_backends, parse_backend_spec

    apply_backends(llm.model, parse_backend_spec(spec))


def add_fast_path_args(g) -> None:
    g.add_argument("--compile", action="store_true",
                   help="decode steps on static buffers through torch.compile (on a CPU inductor builds C++, ~30 s)")
    g.add_argument("--cuda-graphs", action="store_true", help="decode steps captured as CUDA graphs per batch bucket")
    g.add_argument("--max-model-len", type=count, default=None,
                   help="context per request (default: the model's; more than the model's context is refused); the "
                        "static buffers of --compile / --cuda-graphs hold this many tokens per sequence and every "
                        "decode step attends over them")


def add_tier_args(t) -> None:
    """The hot / warm / cold cache's settings (kv-inspect --tiers, serve --tiers)."""
    t.add_argument("--window", type=int, default=128, help="recent tokens kept hot")
    t.add_argument("--sink", type=int, default=4, help="first tokens kept hot")
    t.add_argument("--rank", type=int, default=8, help="PCA rank of warm keys")
    t.add_argument("--warm-tokens", type=int, default=None,
                   help="warm tokens before chunks turn cold (default: no cold zone)")
    t.add_argument("--chunk", type=int, default=16, help="tokens per cold chunk")
    t.add_argument("--block", type=int, default=None,
                   help="routing block, a multiple of --chunk (default 16 rounded up)")
    t.add_argument("--budget", type=int, default=None, help="tokens fetched exactly per step, layer and KV head")
    t.add_argument("--value-format", choices=["full", "int8"], default="full")
    t.add_argument("--key-space", choices=["post_rope", "pre_rope"], default="post_rope")
    t.add_argument("--cold-mode", choices=["mean", "drop"], default="mean", help="drop: the sliding-window control")
    t.add_argument("--calibration-docs", type=int, default=2, help="held-out calibration documents for the PCA basis")
    t.add_argument("--tier-store", choices=["accounted", "host", "disk"], default="accounted",
                   help="accounted: a full copy kept, bytes counted by formula; host / disk: the physical cache, "
                        "warm and cold tokens' full K/V in that offload tier, routed blocks fetched back")
    t.add_argument("--tier-predict", choices=["none", "step", "layer", "both"], default="step",
                   help="what the physical cache stages ahead of routing (see workbench.kv.tiers_physical)")


def tier_store(args):
    """The physical tiered cache's store, or None for the accounted cache."""
    if getattr(args, "tier_store", "accounted") == "accounted":
        return None
    from workbench.kv.tiers_physical import TierStore

    return TierStore(offload=args.tier_store, predict=args.tier_predict)


def tier_config(args):
    from workbench.kv.tier_config import TierConfig

    block = args.block or -(-16 // args.chunk) * args.chunk    # a multiple of chunk, >= 16
    return TierConfig(window=args.window, sink=args.sink, rank=args.rank, warm_tokens=args.warm_tokens,
                      chunk=args.chunk, block=block, budget=args.budget, value_format=args.value_format,
                      key_space=args.key_space, cold_mode=args.cold_mode)



def add_stream_args(p) -> None:
    """Weight streaming (the prefetch layer): some decoder layers resident, the rest fetched ahead."""
    g = p.add_argument_group("weight streaming (prefetch layer)")
    g.add_argument("--resident-layers", type=int, default=None,
                   help="keep the first N decoder layers resident; the others live in the slow tier (disk on a CPU, "
                        "pinned host memory on CUDA) and are fetched layer by layer (embedding, LM head and final "
                        "norm always stay resident)")
    g.add_argument("--resident-bytes", type=int, default=None,
                   help="instead of --resident-layers: a byte budget for everything resident (embedding, head, "
                        "norms, resident layers and the streaming buffers)")
    g.add_argument("--prefetch-distance", type=int, default=1,
                   help="fetch layer i+d while layer i computes (0: synchronous; d+1 layer buffers)")
    g.add_argument("--weights-transport", choices=["auto", "disk", "host", "cuda"], default="auto",
                   help="where streamed layers live (auto: cuda on a GPU, else disk)")


def weight_stream_config(args):
    """The WeightStreamConfig of --resident-layers / --resident-bytes, or None (every layer resident)."""
    layers, nbytes = getattr(args, "resident_layers", None), getattr(args, "resident_bytes", None)
    if layers is None and nbytes is None:
        return None
    from workbench.prefetch.weights import WeightStreamConfig

    return WeightStreamConfig(resident_layers=layers, resident_bytes=nbytes, distance=args.prefetch_distance,
                              transport=args.weights_transport)
