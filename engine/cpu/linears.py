"""How a loaded model's CPU ``nn.Linear`` layers meet their GEMM kernels (called by ``prepare_model``).

Layouts and kernels only: every Linear computes what ``F.linear`` would, up to summation order
and the final bfloat16 rounding.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F

from corekv.engine.attention import in_native_step


def prepare_linear_weights(hf_model: Any) -> None:
    """Lay out each float32 or bfloat16 CPU ``nn.Linear`` weight for the GEMMs that read it, chosen
    per shape on this machine; results are unchanged up to summation order (and bfloat16's rounding).

    * float32: the weight ``[out, in]`` becomes the transposed view of a contiguous ``[in, out]``
      tensor (same values and shape, so every code path reads the same tensor), MKL's best layout.
      Weights shared with an embedding (tied ``lm_head``) keep the row-major layout the embedding
      lookup needs.
    * Each module's ``forward`` then runs, for a step's few rows and for :data:`MANY_ROWS_FROM`
      rows or more, the GEMM :func:`~corekv.engine.cpu.gemm_plan.gemm_plan` chose for its shape
      and dtype (timed once per machine, then cached): float32 ``mkl`` (``F.linear``) or ``onednn``
      (oneDNN's matmul on a copy packed in its blocked layout, ``torch.ops.mkldnn._linear_pointwise``,
      what inductor uses for frozen CPU linears); bfloat16 ``onednn`` or ``upcast`` (input and weight
      multiplied in float32, rounded back once), or ``F.linear`` and ``upcast`` where oneDNN has no
      bfloat16 kernels (CPUs without AVX-512). A native runner's decode steps take the native kernel
      instead (:func:`use_native_linears`). ``weight`` stays as loaded (state dict, fingerprint, tied
      embedding) and must not be changed afterwards: the packed copies would not follow.

    Idempotent: a module prepared before keeps its copies and its plan.

    NOTE: why a timing and not a rule: MKL's float32 GEMM takes its AVX2 path on AMD CPUs with
    AVX-512, where oneDNN's runs at twice its speed, while on Intel's the two are level; a bfloat16
    GEMM beats upcasting to float32 where oneDNN uses AVX-512 BF16 or AMX, but not everywhere
    (``benchmarks/cpu_kernels.py``'s shapes table; BENCHMARKS.md, "Linears by shape"). bfloat16
    ``F.linear`` reorders the weight into oneDNN's layout on every call, so packing it once is
    faster. Each product of two bfloat16 values is exact in float32 and oneDNN's bfloat16 GEMM
    accumulates in float32 too, so the bfloat16 paths differ only in summation order and the final
    rounding. Under torch.compile float32 prefills stay inductor's GEMMs. CUDA has its own kernels.
    """
    from corekv.engine.cpu.gemm_plan import gemm_plan

    embedding = hf_model.get_input_embeddings()
    shared = {id(embedding.weight)} if embedding is not None else set()
    onednn = torch.backends.mkldnn.is_available()
    onednn_bf16 = onednn and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    plans: dict[tuple, dict[str, str]] = {}  # (dtype, shape, bias?, layout) -> plan: one timing per shape
    for module in hf_model.modules():
        weight = getattr(module, "weight", None)
        if (not isinstance(module, torch.nn.Linear) or weight.device.type != "cpu"
                or weight.dtype not in (torch.float32, torch.bfloat16) or hasattr(module, "_corekv_packed")):
            continue
        if weight.dtype == torch.float32 and id(weight) not in shared and weight.is_contiguous():
            weight.data = weight.data.t().contiguous().t()
        w, bias = weight.detach(), module.bias
        key = (w.dtype, tuple(w.shape), bias is not None, w.is_contiguous())
        onednn_copy = None  # this weight in oneDNN's layout, made once
        if key not in plans:
            names = (("mkl", "onednn") if onednn else ("mkl",)) if w.dtype == torch.float32 else \
                ("onednn", "upcast") if onednn_bf16 else ("F.linear", "upcast")
            onednn_copy = torch.ops.mkldnn._reorder_linear_weight(w, 32) if "onednn" in names else None
            trial = _Packed(None, onednn_copy)
            plans[key] = gemm_plan(w.dtype, tuple(w.shape),
                                   {name: _bound(_GEMMS[name], w, bias, trial) for name in names})
        plan = plans[key]
        if "onednn" in plan.values() and onednn_copy is None:
            onednn_copy = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        packed = _Packed(plan, onednn_copy if "onednn" in plan.values() else None)
        module._corekv_packed = packed
        module.forward = (_float32_linear if w.dtype == torch.float32 else _bfloat16_linear)(w, bias, packed)


#: from this many rows a CPU Linear runs its plan's GEMM for many rows (a prefill's), below it the
#: one for few rows (see prepare_linear_weights)
MANY_ROWS_FROM = 128

#: the row counts at which a Linear's native kernel is timed against its planned GEMM for few rows
#: (see use_native_linears): a decode step's, up to gemm_plan's FEW_ROWS
NATIVE_ROWS_TIMED = (1, 2, 4, 8, 16, 32)


class _Packed:
    """One Linear's GEMM plan (``{"few": name, "many": name}`` of :data:`_GEMMS`) and the copies of
    its weight the plan's kernels read: oneDNN's blocked layout where the plan uses it, and column
    panels for the native kernel with the kernel of the instruction set that packed them (the
    panels' width is that set's) and the most rows it takes (``native_rows``; all three set by
    :func:`use_native_linears`)."""

    def __init__(self, plan: dict[str, str] | None, onednn: torch.Tensor | None = None):
        self.plan = plan
        self.onednn = onednn
        self.panels: torch.Tensor | None = None
        self.small_linear = None
        self.native_rows = 0


def _upcast(x, weight, bias, packed):
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


#: the GEMMs a plan names: ``(x, weight, bias, packed) -> F.linear(x, weight, bias)``
_GEMMS = {
    "mkl": lambda x, weight, bias, packed: F.linear(x, weight, bias),
    "F.linear": lambda x, weight, bias, packed: F.linear(x, weight, bias),
    "onednn": lambda x, weight, bias, packed: torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], ""),
    "upcast": _upcast,
}


def _bound(gemm, weight, bias, packed):
    return lambda x: gemm(x, weight, bias, packed)


def _planned(x, weight, bias, packed: _Packed):
    """``F.linear(x, weight, bias)`` by the GEMM the plan names for ``x``'s rows."""
    many = x.numel() >= MANY_ROWS_FROM * weight.shape[1]
    return _GEMMS[packed.plan["many" if many else "few"]](x, weight, bias, packed)


#: each Linear's :class:`_Packed`, by the handle its forward passes to its opaque op under
#: torch.compile (weak references: the copies live as long as their module's forward)
_PACKED: list[weakref.ref] = []


def _register(packed: _Packed) -> int:
    _PACKED.append(weakref.ref(packed))
    return len(_PACKED) - 1


def _packed(handle: int) -> _Packed:
    packed = _PACKED[handle]()
    if packed is None:
        raise RuntimeError(f"corekv: the packed weights of Linear handle {handle} are gone (its module was "
                           "freed or re-prepared); a compiled graph built for that model cannot run any more")
    return packed


def _native_rows(x: torch.Tensor, weight: torch.Tensor, packed: _Packed) -> bool:
    """Whether ``x``'s rows are as many as the native kernel takes (for float32 read at trace
    time too, see :func:`_float32_linear`)."""
    return 1 <= x.numel() // weight.shape[1] <= packed.native_rows


def _native_matmul(x, weight, bias, packed: _Packed):
    """``F.linear(x, weight, bias)`` by the native kernel on ``weight``'s panels."""
    out = packed.small_linear(x.reshape(-1, weight.shape[1]), packed.panels, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def use_native_linears(hf_model: Any, kernels) -> None:
    """Give each prepared CPU ``nn.Linear`` (:func:`prepare_linear_weights`) whose output size is a
    multiple of 64 a copy of its weight packed into panels, multiplied by ``kernels.small_linear``
    for up to ``native_rows`` rows during a step of a native runner; anything else (more rows, a
    torch-path runner's steps, ``model.generate`` and other plain Hugging Face use) runs as before.
    Idempotent. The packed copies double the weights' memory (SmolLM2-135M, tied ``lm_head``
    included: +540 MB in float32, +270 MB in bfloat16).

    ``native_rows`` is the most of :data:`NATIVE_ROWS_TIMED` up to which the native kernel beat the
    plan's GEMM for few rows at every count timed, per shape (:func:`gemm_plan`, so timed once per
    machine, then cached); 0 where it never did (the panels are then dropped). Each candidate is
    timed on every weight of that shape in turn, as a forward pass runs them: from memory, not from
    the cache one weight alone would stay in.

    NOTE: why a timing: the native kernel streams the weight once for all rows, so it wins where
    the GEMM it replaces pays for the few rows' shape: from 1 row on AMD CPUs (MKL's float32 GEMV
    and oneDNN's take 2-3x its time), from 2 rows on an Intel AVX-512 one (level at 1); its bfloat16
    panels lose to oneDNN's AVX-512 BF16 GEMM from about 8 rows on an AMD Zen 4 but win to 16 on an
    Intel CPU without it. Timed on one weight alone, which stays in cache, the GEMM looks faster
    against it than it is in a model (BENCHMARKS.md, "Native linears: rows timed per machine").
    """
    from corekv.engine.cpu.gemm_plan import gemm_plan

    by_shape: dict[tuple, list] = {}  # (dtype, shape, bias?, layout) -> its modules
    for module in hf_model.modules():
        weight = getattr(module, "weight", None)
        packed = getattr(module, "_corekv_packed", None)
        if not isinstance(module, torch.nn.Linear) or packed is None or packed.small_linear is not None \
                or weight.shape[0] % 64:
            continue
        w = weight.detach()
        packed.panels, packed.small_linear = kernels.pack_linear_weight(w), kernels.small_linear
        by_shape.setdefault((w.dtype, tuple(w.shape), module.bias is not None, w.is_contiguous()), []).append(module)
    for (dtype, shape, *_), modules in by_shape.items():
        few = modules[0]._corekv_packed.plan["few"]
        calls = [(m.weight.detach(), m.bias, m._corekv_packed) for m in modules]
        candidates = {few: lambda x: [_GEMMS[few](x, w, bias, packed) for w, bias, packed in calls],
                      "native": lambda x: [packed.small_linear(x, packed.panels, bias) for _, bias, packed in calls]}
        plan = gemm_plan(dtype, shape, candidates, {str(rows): rows for rows in NATIVE_ROWS_TIMED}, len(calls),
                         kernels.revision)
        native_rows = _native_bound(plan)
        for _, _, packed in calls:
            packed.native_rows = native_rows
            if not native_rows:
                packed.panels = None  # never used: give the memory back


def _native_bound(plan: dict[str, str]) -> int:
    """The most rows of a native-vs-GEMM plan (``{str(rows): winner}``) up to which native won at
    every count timed."""
    most = 0
    for rows in NATIVE_ROWS_TIMED:
        if plan[str(rows)] != "native":
            break
        most = rows
    return most


def _bfloat16_linear(weight: torch.Tensor, bias: torch.Tensor | None, packed: _Packed):
    """``forward`` of a bfloat16 CPU Linear: its plan's GEMM, or the native kernel for a native
    runner's few rows.

    NOTE: under torch.compile (engine.compile) the call is one opaque op that finds the packed
    copies by handle (inductor cannot lower oneDNN's op on a packed constant itself) and chooses
    the kernel when it runs, so steps of every size share a graph.
    """
    handle = _register(packed)

    def forward(x):
        if torch.compiler.is_compiling():
            return torch.ops.corekv.bfloat16_linear(x, weight, bias, handle)
        return _bfloat16_matmul(x, weight, bias, packed)
    return forward


def _bfloat16_matmul(x, weight, bias, packed: _Packed):
    if packed.panels is not None and _native_rows(x, weight, packed) and in_native_step():
        return _native_matmul(x, weight, bias, packed)
    return _planned(x, weight, bias, packed)


@torch.library.custom_op("corekv::bfloat16_linear", mutates_args=())
def _bfloat16_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        handle: int) -> torch.Tensor:
    return _bfloat16_matmul(x, weight, bias, _packed(handle))


def _linear_output(x, weight, bias, handle):
    """Both ops' output for tracing: ``x``'s rows by ``weight``'s outputs."""
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_bfloat16_linear_op.register_fake(_linear_output)


def _float32_linear(weight: torch.Tensor, bias: torch.Tensor | None, packed: _Packed):
    """``forward`` of a float32 CPU Linear: its plan's GEMM, or with panels (see
    :func:`use_native_linears`) the native kernel for a native runner's few rows.

    NOTE: under torch.compile ``F.linear`` (inductor's GEMM), and with panels an opaque op for
    decode-sized steps only (a guard on the step's size):
    decode-sized steps get a graph of their own, so a prefill's linears stay inductor's GEMMs on its
    planned buffers (behind an opaque op they would write fresh outputs, which costs a prefill more
    than the decode steps gain). The price is one more graph, compiled when the engine starts
    (BENCHMARKS.md, "Native float32 linear for 2-32 rows").
    """
    handle = _register(packed)

    def forward(x):
        if packed.panels is not None and _native_rows(x, weight, packed):
            if torch.compiler.is_compiling():
                return torch.ops.corekv.float32_linear(x, weight, bias, handle)
            return _float32_matmul(x, weight, bias, packed)
        if torch.compiler.is_compiling():
            return F.linear(x, weight, bias)
        return _planned(x, weight, bias, packed)
    return forward


def _float32_matmul(x, weight, bias, packed: _Packed):
    if in_native_step():
        return _native_matmul(x, weight, bias, packed)
    return _planned(x, weight, bias, packed)


@torch.library.custom_op("corekv::float32_linear", mutates_args=())
def _float32_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       handle: int) -> torch.Tensor:
    """A compiled graph's decode-sized Linear; the plan's GEMM when its graph runs outside a native
    runner's step (dynamo's guards do not see which runner calls it)."""
    return _float32_matmul(x, weight, bias, _packed(handle))


_float32_linear_op.register_fake(_linear_output)
