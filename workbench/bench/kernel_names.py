"""``kernels-bench``'s kernels and sections, without torch: the CLI builds its parser from them
(see :mod:`workbench.bench.kernels` and :mod:`workbench.bench.kernel_op_cases`)."""

OPS = ("rmsnorm", "add_rmsnorm", "rope", "swiglu", "flash_prefill", "paged_decode")
SECTIONS = ("ceilings", "kernels", "decode")
