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
    """Lay out each CPU ``nn.Linear`` weight for the GEMM that reads it; results are unchanged.

    * float32: the weight ``[out, in]`` becomes the transposed view of a contiguous ``[in, out]``
      tensor (same values and shape, so every code path reads the same tensor). Weights shared
      with an embedding (tied ``lm_head``) keep the row-major layout the embedding lookup needs.
    * bfloat16: the module also gets a copy packed in oneDNN's blocked layout, and its ``forward``
      runs oneDNN's matmul on it (``torch.ops.mkldnn._linear_pointwise``, what inductor uses for
      frozen CPU linears) for fewer than :data:`BF16_UPCAST_MIN_ROWS` rows; more rows (a prefill)
      are multiplied in float32 and rounded back to bfloat16; a native runner's decode steps take
      the native kernel (:func:`use_native_linears`). ``weight`` stays as loaded (state dict,
      fingerprint, tied embedding) and must not be changed afterwards: the packed copies would
      not follow. Where oneDNN has no bfloat16 kernels (CPUs without AVX-512) nothing changes,
      and the native kernel is not used for bfloat16 either.

    Idempotent: a module prepared before keeps its copies.

    NOTE: the choices follow ``benchmarks/cpu_kernels.py`` at SmolLM2's shapes, all layers' weights
    so they stream from memory (BENCHMARKS.md, "Linears of 30 layers, float32" and "..., bfloat16").
    The transposed float32 layout is about as fast as the loaded one (a wash end to end; oneDNN
    packing is no better). bfloat16 ``F.linear`` reorders the weight into oneDNN's layout on every
    call, so packing it once is faster at every row count. Without AMX a CPU's bfloat16 dot products
    are no faster than float32 FMAs, so a large bfloat16 GEMM is slower than the float32 one, and
    from :data:`BF16_UPCAST_MIN_ROWS` rows upcasting input and weight per call beats the packed
    bfloat16 GEMM. Each product of two bfloat16 values is exact in float32 and oneDNN's bfloat16
    GEMM accumulates in float32 too, so the two paths differ only in summation order and the final
    rounding. CUDA has its own kernels.
    """
    embedding = hf_model.get_input_embeddings()
    shared = {id(embedding.weight)} if embedding is not None else set()
    pack_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    for module in hf_model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, torch.nn.Linear) or weight.device.type != "cpu":
            continue
        if weight.dtype == torch.float32 and id(weight) not in shared and weight.is_contiguous():
            weight.data = weight.data.t().contiguous().t()
        elif weight.dtype == torch.bfloat16 and pack_bf16 and not hasattr(module, "_corekv_packed"):
            module._corekv_packed = _Packed(onednn=torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32))
            module.forward = _bfloat16_linear(weight.detach(), module.bias, module._corekv_packed)


#: a bfloat16 CPU Linear called with at least this many rows multiplies in float32: from here on
#: the upcast beats oneDNN's packed bfloat16 GEMM on CPUs without AMX (see prepare_linear_weights)
BF16_UPCAST_MIN_ROWS = 128

#: the rows (least, most) a Linear inside a native runner's step sends to the native kernel, by
#: weight dtype: a decode step's (a prefill's thousand rows stay with MKL or float32, at the FMA
#: peak there; one float32 row is a GEMV MKL streams as fast).
#: NOTE: the bounds are the rows where the native kernel is faster than what it replaces, MKL for
#: float32 and oneDNN's packed GEMM for bfloat16 (benchmarks/cpu_kernels.py's linears tables;
#: BENCHMARKS.md, "Native float32 linear for 2-32 rows" and "Native linear for bfloat16 decode steps").
NATIVE_LINEAR_ROWS = {torch.float32: (2, 32), torch.bfloat16: (1, 16)}


class _Packed:
    """Copies of one Linear's weight in the layouts its kernels read: oneDNN's blocked layout
    (bfloat16) and column panels for the native kernel, with the kernel of the instruction set
    that packed them (the panels' width is that set's; both set by :func:`use_native_linears`)."""

    def __init__(self, onednn: torch.Tensor | None = None):
        self.onednn = onednn
        self.panels: torch.Tensor | None = None
        self.small_linear = None


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


def _native_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x``'s rows are as many as the native kernel takes (for float32 read at trace
    time too, see :func:`_float32_linear`)."""
    least, most = NATIVE_LINEAR_ROWS[weight.dtype]
    return least <= x.numel() // weight.shape[1] <= most


def _native_matmul(x, weight, bias, packed: _Packed):
    """``F.linear(x, weight, bias)`` by the native kernel on ``weight``'s panels."""
    out = packed.small_linear(x.reshape(-1, weight.shape[1]), packed.panels, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def use_native_linears(hf_model: Any, kernels) -> None:
    """Give each float32 CPU ``nn.Linear``, and each bfloat16 one with a oneDNN copy, whose output
    size is a multiple of 64 a copy of its weight packed into panels, multiplied by
    ``kernels.small_linear`` for the rows of :data:`NATIVE_LINEAR_ROWS` during a step of a native
    runner (``engine.compile``); anything else (other rows, a torch-path runner's steps,
    ``model.generate`` and other plain Hugging Face use) runs as before. Idempotent. The packed
    copies double the weights' memory (SmolLM2-135M, tied ``lm_head`` included: +540 MB in
    float32, +270 MB in bfloat16).
    """
    for module in hf_model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, torch.nn.Linear) or weight.device.type != "cpu" or weight.shape[0] % 64:
            continue
        packed = getattr(module, "_corekv_packed", None)
        if weight.dtype == torch.float32 and packed is None:
            module._corekv_packed = packed = _Packed()
            module.forward = _float32_linear(weight.detach(), module.bias, packed)
        if packed is not None and packed.panels is None:
            packed.panels = kernels.pack_linear_weight(weight.detach())
            packed.small_linear = kernels.small_linear


def _bfloat16_linear(weight: torch.Tensor, bias: torch.Tensor | None, packed: _Packed):
    """``forward`` of a bfloat16 CPU Linear: oneDNN on a packed copy, float32 for many rows, or
    the native kernel for a native runner's few rows.

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
    if packed.panels is not None and _native_rows(x, weight) and in_native_step():
        return _native_matmul(x, weight, bias, packed)
    if x.numel() >= BF16_UPCAST_MIN_ROWS * weight.shape[1]:
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")


@torch.library.custom_op("corekv::bfloat16_linear", mutates_args=())
def _bfloat16_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        handle: int) -> torch.Tensor:
    return _bfloat16_matmul(x, weight, bias, _packed(handle))


def _linear_output(x, weight, bias, handle):
    """Both ops' output for tracing: ``x``'s rows by ``weight``'s outputs."""
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_bfloat16_linear_op.register_fake(_linear_output)


def _float32_linear(weight: torch.Tensor, bias: torch.Tensor | None, packed: _Packed):
    """``forward`` of a float32 CPU Linear with panels (see :func:`use_native_linears`).

    NOTE: under torch.compile an opaque op for decode-sized steps only (a guard on the step's size):
    decode-sized steps get a graph of their own, so a prefill's linears stay inductor's GEMMs on its
    planned buffers (behind an opaque op they would write fresh outputs, which costs a prefill more
    than the decode steps gain). The price is one more graph, compiled when the engine starts
    (BENCHMARKS.md, "Native float32 linear for 2-32 rows").
    """
    handle = _register(packed)

    def forward(x):
        if not _native_rows(x, weight):
            return F.linear(x, weight, bias)
        if torch.compiler.is_compiling():
            return torch.ops.corekv.float32_linear(x, weight, bias, handle)
        return _float32_matmul(x, weight, bias, packed)
    return forward


def _float32_matmul(x, weight, bias, packed: _Packed):
    if in_native_step():
        return _native_matmul(x, weight, bias, packed)
    return F.linear(x, weight, bias)


@torch.library.custom_op("corekv::float32_linear", mutates_args=())
def _float32_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       handle: int) -> torch.Tensor:
    """A compiled graph's decode-sized Linear; ``F.linear`` when its graph runs outside a native
    runner's step (dynamo's guards do not see which runner calls it)."""
    return _float32_matmul(x, weight, bias, _packed(handle))


_float32_linear_op.register_fake(_linear_output)
