"""The workbench's Triton kernel library, imported as ``workbench_kernels``.

It lives in ``kernels/workbench_kernels/``, and ``kernels/`` has no ``__init__.py``: the import
name is never ``kernels``, which is the Hugging Face kernel-hub package's. transformers (>= 5.25
requires that package) imports ``kernels``; from the repository root a regular package of that
name would shadow the hub's and break transformers, while a folder without ``__init__.py`` is at
most a namespace portion, which any installed package of the name takes precedence over.
Installed, setuptools maps this folder to ``workbench_kernels``; in a plain checkout
(``PYTHONPATH=.``) ``import workbench`` registers the same name.

Each op lives in one file with fixed names (the Liger / Triton-tutorial shape)::

    _<op>_fwd_kernel   the Triton kernel (every pointer argument commented; math + reference in
                       its docstring)
    <op>(...)          host wrapper: checks shapes / strides / dtypes (ValueError / TypeError
                       naming the argument), allocates, launches
    <op>_ref(...)      plain-torch reference: tests, benchmarks and the ``eager`` backend of
                       :mod:`workbench.transforms.backends` all import this one

=====================  ======================================================================
file                   ops
=====================  ======================================================================
``rmsnorm.py``         ``rmsnorm``, ``add_rmsnorm`` (residual add fused with the norm)
``rope.py``            ``rope`` (q and k), ``rope_kv_write`` (+ k/v written to a paged KV cache)
``swiglu.py``          ``swiglu`` (silu(gate) * up; two tensors or one ``[.., 2I]`` tensor)
``flash_prefill.py``   ``flash_prefill`` (ragged causal prefill, GQA), ``flash_prefill_paged``
                       (keys read in place from the paged cache), ``attention_prefill``
``paged_decode.py``    ``paged_decode`` (split-K decode over the paged cache, GQA),
                       ``attention_decode`` (no host sync: the CUDA-graph-safe entry point)
``sampling.py``        ``greedy_tokens`` (argmax), ``sample_tokens`` (temperature, top-k, top-p
                       by Gumbel-max; per-row parameters; thresholds from torch on the host)
``quant_matmul.py``    ``w4a16_matmul`` / ``w8a16_matmul`` (int4 / int8 weights dequantized in the
                       kernel: split-K GEMV for a few rows, tiled GEMM otherwise), ``w4a8_matmul``
                       / ``w8a8_matmul`` (int8 x int8 -> int32 per group), ``quantize_per_token_int8``;
                       re-exported from ``quant_wxa16.py``, ``quant_wxa8.py``, ``quant_plan.py``
                       and ``quant_shared.py``
``_testing.py``        ``assert_close`` (reports how many elements mismatch and where), error
                       helpers shared by the tests, the benchmark and the notebook
=====================  ======================================================================

The ``attention_*`` wrappers are what :mod:`workbench.transforms.backends` calls for its ops of the same
name; the attention files name their kernels ``_flash_prefill_kernel`` / ``_paged_decode_*``.

Kernels run on a CPU under the Triton interpreter (``TRITON_INTERPRET=1``) at small sizes.
``@triton.jit`` decides between the compiler and the interpreter when a kernel module is
*imported*, so the variable must be set before the first ``import workbench_kernels.<op>``.
Importing this package itself does not import triton.
"""

from __future__ import annotations

import importlib.util
import os

# kernel file -> (host wrappers, their references).  The one list of what this library holds;
# the benchmark and the notebook read it (workbench.transforms.backends names its entry points itself).
KERNELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "rmsnorm": (("rmsnorm", "add_rmsnorm"), ("rmsnorm_ref", "add_rmsnorm_ref")),
    "rope": (("rope", "rope_kv_write"), ("rope_ref", "rope_kv_write_ref")),
    "swiglu": (("swiglu",), ("swiglu_ref",)),
    "flash_prefill": (("flash_prefill", "flash_prefill_paged", "attention_prefill", "attention_prefill_paged"),
                      ("flash_prefill_ref", "flash_prefill_paged_ref")),
    "paged_decode": (("paged_decode", "attention_decode"), ("paged_decode_ref",)),
    "sampling": (("greedy_tokens", "sample_tokens"), ("greedy_tokens_ref", "sample_tokens_ref")),
    "quant_matmul": (("w4a16_matmul", "w8a16_matmul", "w4a8_matmul", "w8a8_matmul", "quantize_per_token_int8"),
                     ("w4a16_matmul_ref", "w8a16_matmul_ref", "w4a8_matmul_ref", "w8a8_matmul_ref",
                      "quantize_per_token_int8_ref")),
}

# Kernel launches made through the host wrappers, by wrapper name (read by
# workbench.transforms.cuda_graphs.count_launches; a dict increment per launch costs nothing measurable).
LAUNCHES: dict[str, int] = {}


def interpreter_active() -> bool:
    """True when Triton kernels run on the CPU through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Triton < 3.7's interpreter turns a loaded scalar into a Python int with ``int(array)`` on a
# one-element array, which numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted"):
# every kernel that reads a loop bound or an index from memory fails (attention, sampling).
# Measured: triton 3.6.0 + numpy 2.3.5 passes the kernel tests, + numpy 2.4.x fails them;
# triton 3.7.1, 3.8.0 and 3.9.0 pass with numpy 2.4.  Compiled kernels (a GPU) are unaffected.
_INTERPRETER_PROBLEM: list = []     # [message or None], computed once


def check_interpreter() -> None:
    """Raise one clear RuntimeError, before a launch under ``TRITON_INTERPRET=1``, when this
    triton's interpreter cannot run the kernels with this numpy (see above)."""
    if not interpreter_active():
        return
    if not _INTERPRETER_PROBLEM:
        import re

        import numpy
        import triton

        def version(v: str) -> tuple[int, ...]:
            return tuple(int(x) for x in re.findall(r"\d+", v)[:2])

        bad = version(triton.__version__) < (3, 7) and version(numpy.__version__) >= (2, 4)
        _INTERPRETER_PROBLEM.append(
            f"the Triton interpreter (TRITON_INTERPRET=1) of triton {triton.__version__} cannot run these kernels "
            f"with numpy {numpy.__version__}: it converts one-element arrays to Python ints, which numpy >= 2.4 "
            "refuses; use triton >= 3.7 or numpy < 2.4 to run the kernels on a CPU (compiled kernels on a GPU "
            "are unaffected)" if bad else None)
    if _INTERPRETER_PROBLEM[0]:
        raise RuntimeError(_INTERPRETER_PROBLEM[0])


def has_kernel_file(name: str) -> bool:
    """Whether ``workbench_kernels.<name>`` exists in this checkout (imports nothing heavy)."""
    return importlib.util.find_spec(f"{__name__}.{name}") is not None


def count_launch(name: str) -> None:
    LAUNCHES[name] = LAUNCHES.get(name, 0) + 1


def check_device(kernel, *tensors, op: str) -> None:
    """One clear error instead of a deep Triton traceback when a CPU tensor meets a compiled
    (not interpreted) kernel, or tensors sit on different devices."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    if next(iter(devices)).type == "cpu" and type(kernel).__name__ != "InterpretedFunction":
        raise RuntimeError(f"{op}: Triton kernels run on a CPU only under the interpreter: set TRITON_INTERPRET=1 "
                           f"before workbench_kernels.{op.split('(')[0]} is first imported")
    check_interpreter()


def rows_per_program(num_rows: int, row_elems: int, interpreted: bool) -> int:
    """How many rows one program handles (a power of two).

    On a GPU a program should hold a few thousand elements: one row of a wide tensor (hidden
    2048+), several rows of a narrow one.  Under the interpreter every program is a Python
    loop iteration costing milliseconds, so pack as many rows as fit a ~64K-element block.
    """
    import triton

    budget = 1 << 16 if interpreted else 4096
    rows = max(1, budget // max(row_elems, 1))
    return min(triton.next_power_of_2(max(num_rows, 1)), 1 << (rows.bit_length() - 1))
