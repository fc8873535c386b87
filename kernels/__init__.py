"""The workbench's Triton kernel library, imported as ``workbench_kernels``.

The folder is ``kernels/`` but the import name is not ``kernels``: transformers treats an
importable top-level ``kernels`` as the Hugging Face kernel-hub package and would import it.
Installed, setuptools maps the folder to ``workbench_kernels``; in a plain checkout
(``PYTHONPATH=.``) ``import workbench`` registers the same name.

Each op lives in one file: the Triton kernel, a host wrapper that checks shapes, strides and
dtypes, and a plain-torch reference that tests and benchmarks compare against.  Kernels run on
a CPU under the Triton interpreter (``TRITON_INTERPRET=1``) at small sizes.
"""

import os


def interpreter_active() -> bool:
    """True when Triton kernels run on the CPU through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
