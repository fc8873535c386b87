"""Per-op backends, applied to a plain model as a transformation (``model.py`` is untouched).

::

    apply_backends(model, {"rmsnorm": "triton", "rope": "triton"})   # in place; returns model
    current_backends(model)    # {"rmsnorm": "triton", "rope": "triton", "swiglu": "eager", ...}
    with using_backends(model, swiglu="compile"): ...                 # undone on exit
    remove_backends(model)     # the reference modules again
    apply_backends(model, parse_backend_spec("triton,attention_prefill=eager"))   # the CLI's --backend text
    describe_backends(model)   # {"backend": "mixed", "backends": "rmsnorm=triton ...", ...}: benchmark rows, headers
    replace_entry_points(model, rmsnorm=my_rmsnorm)   # one function in place of an entry point (a learner's kernel)

Backends: ``eager`` (the plain-torch reference, the ``*_ref`` functions of ``workbench_kernels``:
bitwise the reference model), ``triton`` (the fused kernels), ``compile`` (``torch.compile`` of
the eager op).  Ops not named keep their current backend (``eager`` on a fresh model).

What the transformation swaps (module classes only: parameters, names, state dict unchanged;
the classes live in :mod:`workbench.transforms.backend_modules`)::

    RMSNorm       -> BackendRMSNorm        ops.rmsnorm
    DecoderLayer  -> BackendDecoderLayer   post-attention norm fused with the residual add (ops.add_rmsnorm)
    Attention     -> BackendAttention      ops.rope; with rope=triton the KV-cache write is fused in
                                           (ops.rope_kv_write); ops.attention_prefill / attention_decode
    MLP           -> BackendMLP            ops.swiglu

Every swapped module, and the model itself, gets the chosen :class:`~workbench.model.ops.Ops` in
its declared ``ops`` field (None on a plain model: the reference code).  The KV caches read
``attn.ops`` and call ``attention_prefill_paged`` / ``attention_decode`` on the paged pool
themselves (:mod:`workbench.model.kv_cache`, :mod:`workbench.kv.batch`); the engine reads
``model.ops`` for the sampling op (:mod:`workbench.engine.step_sampling`).

Adding a backend is one :func:`register` line naming ``"module:function"`` per entry point; the
module is imported only when the backend is chosen.  Contracts of the attention entry points
(what :class:`BackendAttention` and the batched runner pass; scale 1/sqrt(hd), GQA when
nh > nkv; none of them may copy from the device to the host)::

    attention_prefill(q [B, nh, T, hd], k, v [B, nkv, T, hd], causal: bool) -> [B, nh, T, hd]
        queries = keys, from position 0
    attention_prefill_paged(q [n, nh, hd] (packed sequence after sequence), k_cache, v_cache
                     [num_blocks, block_size, nkv, hd], block_tables [B, max_blocks] int32,
                     cu_seqlens_q [B+1] int32 (sequence b's queries are rows cu[b] .. cu[b+1]-1),
                     seq_lens [B] int32 (keys per sequence, this chunk's K/V already written),
                     max_seqlen_q: int (the longest query run), sliding_window: int | None = None)
                     -> [n, nh, hd]
        causal, aligned bottom-right: sequence b's queries are the last q_len_b of its seq_lens[b]
        positions (a prefill chunk attends to its cached prefix); with a window, query position p
        sees keys j with p - window < j <= p
    attention_decode(q [B, nh, hd], k_cache, v_cache [num_blocks, block_size, nkv, hd] (any strides,
                     last dim contiguous; the contiguous cache arrives as one block of max_len per
                     sequence), block_tables [B, max_blocks] int32, seq_lens [B] int32,
                     sliding_window: int | None = None) -> [B, nh, hd]
        one new token per sequence at position seq_lens[b] - 1; with a window it sees the last
        ``sliding_window`` positions only

``compile`` registers nothing: it is ``torch.compile`` of each ``eager`` entry point, so every
entry point an op's ``eager`` backend has, its ``compile`` backend has too.
"""

from __future__ import annotations

import dataclasses
import importlib
from contextlib import contextmanager
from collections.abc import Callable

import torch
import workbench_kernels

from workbench.errors import ConfigError, WorkbenchError
from workbench.model.decoder import MLP, Attention, CausalLM, DecoderLayer, RMSNorm
from workbench.model.ops import ENTRY_POINTS, Ops
from workbench.transforms.backend_modules import (BackendAttention, BackendDecoderLayer, BackendMLP,  # noqa: F401
                                                  BackendRMSNorm)

# op -> its entry points (what the modules call)
OPS: dict[str, tuple[str, ...]] = {
    "rmsnorm": ("rmsnorm", "add_rmsnorm"),
    "rope": ("rope", "rope_kv_write"),
    "swiglu": ("swiglu",),
    "attention_prefill": ("attention_prefill", "attention_prefill_paged"),
    "attention_decode": ("attention_decode",),
    "sampling": ("greedy_tokens", "sample_tokens"),
}
BACKENDS = ("eager", "triton", "compile")
_IMPLS: dict[tuple[str, str], dict[str, str | Callable]] = {}


def register(op: str, backend: str, **entry_points: str | Callable) -> None:
    """Register ``backend`` for ``op``: each entry point a callable or ``"module:function"``."""
    if op not in OPS:
        raise ConfigError(f"register: unknown op {op!r}; ops: {', '.join(OPS)}")
    if set(entry_points) != set(OPS[op]):
        raise ConfigError(f"register {op}={backend}: give exactly the entry points {', '.join(OPS[op])}")
    if backend not in BACKENDS:
        raise ConfigError(f"register: unknown backend {backend!r}; backends: {', '.join(BACKENDS)}")
    _IMPLS[(op, backend)] = dict(entry_points)


_K = "workbench_kernels."
register("rmsnorm", "eager", rmsnorm=_K + "rmsnorm:rmsnorm_ref", add_rmsnorm=_K + "rmsnorm:add_rmsnorm_ref")
register("rmsnorm", "triton", rmsnorm=_K + "rmsnorm:rmsnorm", add_rmsnorm=_K + "rmsnorm:add_rmsnorm")
register("rope", "eager", rope=_K + "rope:rope_ref", rope_kv_write=_K + "rope:rope_kv_write_ref")
register("rope", "triton", rope=_K + "rope:rope", rope_kv_write=_K + "rope:rope_kv_write")
register("swiglu", "eager", swiglu=_K + "swiglu:swiglu_ref")
register("swiglu", "triton", swiglu=_K + "swiglu:swiglu")
# the eager attention entry points: the torch references next to the kernels they stand for
register("attention_prefill", "eager", attention_prefill=_K + "flash_prefill:attention_prefill_ref",
         attention_prefill_paged=_K + "flash_prefill:attention_prefill_paged_ref")
register("attention_decode", "eager", attention_decode=_K + "paged_decode:attention_decode_ref")
# Sampling is read by the engine (workbench.engine.step_sampling), not by a module: "eager" there is the
# reference sampler of workbench.engine.sampling; these entry points serve the other backends.
register("sampling", "eager", greedy_tokens=_K + "sampling:greedy_tokens_ref",
         sample_tokens=_K + "sampling:sample_tokens_ref")
register("sampling", "triton", greedy_tokens=_K + "sampling:greedy_tokens", sample_tokens=_K + "sampling:sample_tokens")
# The attention kernels' model-shaped wrappers (packing to the varlen layout; no host sync in decode).
register("attention_prefill", "triton", attention_prefill=_K + "flash_prefill:attention_prefill",
         attention_prefill_paged=_K + "flash_prefill:attention_prefill_paged")
register("attention_decode", "triton", attention_decode=_K + "paged_decode:attention_decode")
# "compile" needs no registration: torch.compile of each eager entry point, made on first use.
_COMPILED: dict[tuple[str, str], Callable] = {}
if sorted(e for names in OPS.values() for e in names) != sorted(ENTRY_POINTS):
    raise RuntimeError("OPS names other entry points than workbench.model.ops.Ops has fields for")


def _kernel_file(target: str) -> str | None:
    mod = target.split(":")[0]
    return mod[len(_K):] if mod.startswith(_K) else None


def _load(op: str, backend: str, target: str | Callable, device: torch.device | None) -> Callable:
    if callable(target):
        return target
    mod_name, fn_name = target.split(":")
    kfile = _kernel_file(target)
    if kfile is not None:
        if not workbench_kernels.has_kernel_file(kfile):
            raise WorkbenchError(f"{op}={backend} needs workbench_kernels.{kfile} (kernels/{kfile}.py), which this "
                                 f"checkout does not have yet; choose one of: {', '.join(available_backends(op))}")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise WorkbenchError(f"{op}={backend}: cannot import {mod_name} ({e})") from None
    if backend == "triton" and device is not None and device.type == "cpu":
        jitted = [n for n, v in vars(module).items() if type(v).__name__ == "JITFunction"]
        if jitted:
            raise WorkbenchError(f"{op}=triton on a CPU: {mod_name} was imported before TRITON_INTERPRET=1 was set, "
                                 "so its kernels are compiled, not interpreted; set the variable before the first "
                                 "import (restart the Python process / notebook kernel)")
    try:
        return getattr(module, fn_name)
    except AttributeError:
        raise WorkbenchError(f"{op}={backend}: {mod_name} has no function {fn_name!r}") from None


def available_backends(op: str) -> list[str]:
    """Backends of ``op`` that can be chosen in this checkout (a kernel file that has not landed
    yet does not count)."""
    out = []
    for b in BACKENDS:
        impl = _IMPLS.get((op, "eager" if b == "compile" else b))
        if impl is None:
            continue
        files = {_kernel_file(t) for t in impl.values() if isinstance(t, str)} - {None}
        if all(workbench_kernels.has_kernel_file(f) for f in files):
            out.append(b)
    return out


def _check_names(spec: dict) -> None:
    for op, b in spec.items():
        if op not in OPS:
            raise ConfigError(f"unknown op {op!r}; ops: {', '.join(OPS)}")
        if b not in BACKENDS:
            raise ConfigError(f"unknown backend {b!r} for op {op!r}; backends: {', '.join(BACKENDS)}")
        if b != "compile" and (op, b) not in _IMPLS:
            raise ConfigError(f"op {op!r} has no {b!r} backend; registered: "
                              f"{', '.join(sorted({k[1] for k in _IMPLS if k[0] == op} | {'compile'}))}")


def resolve_ops(backends: dict[str, str] | None = None, device: torch.device | str | None = None) -> Ops:
    """Entry points for a backend choice (ops not named: eager).  ``device``: where they will run
    (``triton`` on a CPU needs ``TRITON_INTERPRET=1``)."""
    chosen = {op: "eager" for op in OPS}
    chosen.update(backends or {})
    _check_names(chosen)
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cpu" and "triton" in chosen.values():
        if not workbench_kernels.interpreter_active():
            ops = ", ".join(f"{o}=triton" for o, b in chosen.items() if b == "triton")
            raise WorkbenchError(f"backend 'triton' on a CPU needs the Triton interpreter ({ops}): set "
                                 "TRITON_INTERPRET=1 before starting Python, e.g. "
                                 "`TRITON_INTERPRET=1 workbench generate --backend rmsnorm=triton`")
    fns: dict[str, Callable] = {}
    for op, backend in chosen.items():
        for entry in OPS[op]:
            if backend == "compile":
                key = (op, entry)
                if key not in _COMPILED:
                    _COMPILED[key] = torch.compile(_load(op, "eager", _IMPLS[(op, "eager")][entry], device))
                fns[entry] = _COMPILED[key]
            else:
                fns[entry] = _load(op, backend, _IMPLS[(op, backend)][entry], device)
    return Ops(backends=chosen, **fns)


def parse_backends(items: list[str] | None) -> dict[str, str]:
    """``["rmsnorm=triton", "all=compile"]`` -> a backend dict (CLI ``--backend OP=BACKEND``).
    ``all=B`` sets every op that has backend B in this checkout; later items override."""
    out: dict[str, str] = {}
    for item in items or []:
        op, sep, b = item.partition("=")
        op, b = op.strip(), b.strip()
        if not sep or not op or not b:
            raise ConfigError(f"--backend {item!r}: expected OP=BACKEND, e.g. rmsnorm=triton (ops: "
                              f"{', '.join(OPS)}, all; backends: {', '.join(BACKENDS)})")
        if op == "all":
            _check_names({"rmsnorm": b})
            out.update({o: b for o in OPS if b in available_backends(o)})
        else:
            _check_names({op: b})
            out[op] = b
    return out


def parse_backend_spec(text: str | None) -> dict[str, str]:
    """The CLI's ``--backend`` value -> a backend dict for :func:`apply_backends`.

    ``"triton"`` / ``"eager"`` / ``"compile"``: every op (``triton``: every op that has a Triton
    kernel in this checkout); ``"rmsnorm=triton,swiglu=compile"``: the named ops, the others
    unchanged; both mixed, later parts win: ``"triton,attention_prefill=eager"``.  Empty or None:
    ``{}`` (nothing changes).  A bad part raises :class:`ConfigError` quoting it and the choices.
    """
    out: dict[str, str] = {}
    for raw in (text or "").split(","):
        part = raw.strip()
        if not part:
            continue
        op, sep, b = (x.strip() for x in part.partition("="))
        if not sep:
            op, b = "all", op
        where = f"backend spec {text!r}: part {part!r}"
        if not op or not b:
            raise ConfigError(f"{where}: expected BACKEND or OP=BACKEND (ops: {', '.join(OPS)}; "
                              f"backends: {', '.join(BACKENDS)})")
        if op != "all" and op not in OPS:
            raise ConfigError(f"{where}: unknown op {op!r}; ops: {', '.join(OPS)}")
        if b not in BACKENDS:
            raise ConfigError(f"{where}: unknown backend {b!r}; backends: {', '.join(BACKENDS)}")
        if op == "all":
            out.update({o: b for o in OPS if b in available_backends(o)})
        else:
            if b not in available_backends(op):
                raise ConfigError(f"{where}: op {op!r} has no {b!r} backend here; "
                                  f"available: {', '.join(available_backends(op))}")
            out[op] = b
    return out


def format_backends(backends: dict[str, str]) -> str:
    """One line, e.g. for a benchmark row or an ``x-model-info`` header."""
    return " ".join(f"{op}={b}" for op, b in backends.items())


def describe_backends(model: CausalLM) -> dict:
    """What a benchmark row / an ``x-model-info`` header records about the backends of ``model``:
    ``{"backend": "triton" | "eager" | "compile" | "mixed", "backends": "rmsnorm=triton ...",
    "ops": {op: backend}, "triton_interpreter": bool}`` (the interpreter flag says a Triton
    timing is of the CPU interpreter, not of compiled kernels).  Plain values only (JSON-ready)."""
    ops = current_backends(model)
    kinds = set(ops.values())
    return {"backend": kinds.pop() if len(kinds) == 1 else "mixed", "backends": format_backends(ops),
            "ops": ops, "triton_interpreter": "triton" in ops.values() and workbench_kernels.interpreter_active()}


_SWAPS = {RMSNorm: BackendRMSNorm, DecoderLayer: BackendDecoderLayer, Attention: BackendAttention, MLP: BackendMLP}
_UNSWAP = {v: k for k, v in _SWAPS.items()}


def _targets(model: CausalLM) -> list[tuple[str, torch.nn.Module]]:
    out = []
    for i, layer in enumerate(model.model.layers):
        out += [(f"model.layers.{i}", layer), (f"model.layers.{i}.self_attn", layer.self_attn),
                (f"model.layers.{i}.mlp", layer.mlp),
                (f"model.layers.{i}.input_layernorm", layer.input_layernorm),
                (f"model.layers.{i}.post_attention_layernorm", layer.post_attention_layernorm)]
    return out + [("model.norm", model.model.norm)]


def current_backends(model: CausalLM) -> dict[str, str]:
    """The backend of every op (``eager`` for a model without backends applied)."""
    ops = getattr(model, "ops", None)
    return dict(ops.backends if ops is not None else {op: "eager" for op in OPS})


def _install(model: CausalLM, ops: Ops | None) -> None:
    """``ops`` into the declared ``ops`` field of every module the transformation swaps, and of the model."""
    for _, m in _targets(model):
        m.ops = ops
    model.ops = ops


def apply_backends(model: CausalLM, backends: dict[str, str] | None = None, **by_op: str) -> CausalLM:
    """Switch the named ops of ``model`` to the named backends, in place; returns the model."""
    if not isinstance(model, CausalLM):
        raise ConfigError(f"apply_backends: expected a workbench CausalLM, got {type(model).__name__}")
    chosen = {**current_backends(model), **(backends or {}), **by_op}
    targets = _targets(model)
    for name, m in targets:           # check everything before changing anything
        if type(m) not in _SWAPS and type(m) not in _UNSWAP:
            raise ConfigError(f"apply_backends: {name} is a {type(m).__name__}, not a reference module; apply "
                              "backends to a plain model (before other transformations such as tiered attention)")
    ops = resolve_ops(chosen, model.device)
    for _, m in targets:
        m.__class__ = _SWAPS.get(type(m), type(m))
    _install(model, ops)
    return model


def remove_backends(model: CausalLM) -> CausalLM:
    """Undo :func:`apply_backends` (the reference modules again)."""
    for _, m in _targets(model):
        if type(m) in _UNSWAP:
            m.__class__ = _UNSWAP[type(m)]
    _install(model, None)
    return model


# ---- one function in place of an entry point ------------------------------------------------------------
#: entry points another function may stand in for (:func:`replace_entry_points`), and what each returns
REPLACEABLE: dict[str, str] = {
    "rmsnorm": "y: x's shape, dtype promote(x, weight), x's device",
    "add_rmsnorm": "(y, h): both x's shape and device; h = residual + x in x's dtype, y in promote(x, weight)",
    "swiglu": "y: gate's shape (half its last dimension when up is None), dtype and device",
}


def _tensor_problem(what: str, t, like: torch.Tensor, shape: tuple, dtype: torch.dtype) -> str | None:
    if not isinstance(t, torch.Tensor):
        return f"{what} must be a torch.Tensor, got {type(t).__name__}"
    if tuple(t.shape) != tuple(shape):
        return f"{what} must have shape {tuple(shape)}, got {tuple(t.shape)}"
    if t.dtype != dtype:
        return f"{what} must have dtype {str(dtype).removeprefix('torch.')}, got {str(t.dtype).removeprefix('torch.')}"
    if t.device != like.device:
        return f"{what} must be on {like.device}, got {t.device}"
    return None


_PARAMS = {"rmsnorm": ("x", "weight", "eps"), "add_rmsnorm": ("x", "residual", "weight", "eps"),
           "swiglu": ("gate", "up")}


def _result_problem(entry: str, args: tuple, kwargs: dict, out) -> str | None:
    """None when ``out`` has the form :data:`REPLACEABLE` says ``entry`` returns, else the rule broken."""
    a = {**dict(zip(_PARAMS[entry], args)), **kwargs}
    if entry == "rmsnorm":
        x = a["x"]
        return _tensor_problem("y", out, x, x.shape, torch.promote_types(x.dtype, a["weight"].dtype))
    if entry == "add_rmsnorm":
        x = a["x"]
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            return f"the result must be a pair (y, h), got {type(out).__name__}"
        return (_tensor_problem("y", out[0], x, x.shape, torch.promote_types(x.dtype, a["weight"].dtype))
                or _tensor_problem("h", out[1], x, x.shape, x.dtype))
    gate = a["gate"]
    shape = gate.shape if a.get("up") is not None else (*gate.shape[:-1], gate.shape[-1] // 2)
    return _tensor_problem("y", out, gate, shape, gate.dtype)


def _checked(entry: str, fn: Callable) -> Callable:
    name = getattr(fn, "__name__", type(fn).__name__)

    def run(*args, **kwargs):
        out = fn(*args, **kwargs)
        problem = _result_problem(entry, args, kwargs, out)
        if problem:
            raise WorkbenchError(f"{entry}, replaced by {name}: {problem} (the entry point returns "
                                 f"{REPLACEABLE[entry]})")
        return out
    run.__name__, run.__wrapped__ = name, fn
    return run


def replace_entry_points(model: CausalLM, **fns: Callable) -> CausalLM:
    """Run ``fns`` in place of entry points of the backends ``model`` already has, in place; returns
    the model.  ``replace_entry_points(model, rmsnorm=my_rmsnorm)``: every RMSNorm of the model calls
    ``my_rmsnorm(x, weight, eps)`` (notebook 01 plugs a learner's Triton kernel in this way).

    Only the entry points of :data:`REPLACEABLE` may be replaced, with a function of the same
    parameters; each call's result is checked (type, shape, dtype, device) before the model uses it,
    and a wrong one raises :class:`WorkbenchError` naming the rule.  The next :func:`apply_backends`
    or :func:`remove_backends` undoes it; :func:`current_backends` still names the backends, and
    ``model.ops.replaced`` names the functions standing in."""
    if not isinstance(model, CausalLM):
        raise ConfigError(f"replace_entry_points: expected a workbench CausalLM, got {type(model).__name__}")
    ops = model.ops
    if ops is None:
        raise ConfigError("replace_entry_points: the model has no backends: apply_backends(model, ...) first "
                          "(the entry points replaced are those of a backend choice)")
    for entry, fn in fns.items():
        if entry not in REPLACEABLE:
            raise ConfigError(f"replace_entry_points: {entry!r} cannot be replaced; entry points that can: "
                              f"{', '.join(REPLACEABLE)}")
        if not callable(fn):
            raise ConfigError(f"replace_entry_points: {entry} must be a function, got {type(fn).__name__}")
    new = dataclasses.replace(ops, **{e: _checked(e, fn) for e, fn in fns.items()},
                              replaced={**ops.replaced, **{e: getattr(fn, "__name__", type(fn).__name__)
                                                           for e, fn in fns.items()}})
    _install(model, new)
    return model


@contextmanager
def using_backends(model: CausalLM, backends: dict[str, str] | None = None, **by_op: str):
    """``with using_backends(model, rmsnorm="triton"): ...`` - the previous choice comes back on exit."""
    ops = getattr(model, "ops", None)          # apply_backends refuses anything but a CausalLM
    before = None if ops is None else dict(ops.backends)
    apply_backends(model, backends, **by_op)
    try:
        yield model
    finally:
        if before is None:
            remove_backends(model)
        else:
            apply_backends(model, before)
