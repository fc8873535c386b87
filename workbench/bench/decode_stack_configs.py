"""``decode-stack``'s configurations and per-device defaults, without torch: the CLI builds its
parser from them (see :mod:`workbench.bench.decode_stack`)."""

CONFIGS = {
    "paged+graphs": {"kv": "paged", "cuda_graphs": True},
    "contiguous+graphs": {"kv": "contiguous", "cuda_graphs": True},
    "paged+static": {"kv": "paged", "static_decode": True},
    "contiguous+static": {"kv": "contiguous", "static_decode": True},
    "paged+compile": {"kv": "paged", "compile": True},
    "contiguous+compile": {"kv": "contiguous", "compile": True},
}
# what each device runs when a field is left None
DEFAULTS = {
    "cuda": dict(model="preset:llama-3.2-1b", configs=("paged+graphs", "contiguous+graphs"), batches=(1, 8, 32),
                 prompt_tokens=128, max_tokens=64, repeats=5, backend="fused", copy_mib=1024),
    "cpu": dict(model="preset:tiny", configs=("paged+static", "contiguous+static"), batches=(1, 4),
                prompt_tokens=32, max_tokens=16, repeats=3, backend="eager", copy_mib=32),
}
