"""A Llama decoder layer's elementwise ops on the native kernels during a native runner's steps
(called by ``ModelRunner`` with ``use_native_linears``).

Hugging Face's Llama code runs RMSNorm as six eager ops, the MLP's ``silu(gate) * up`` as two and
the rotary embedding as ten (slices, a negation, a concatenation, four products, two sums), each
writing a fresh tensor; the native kernels (``elementwise.cpp``) do each in one pass, with the same
math and the same bfloat16 roundings. Only inside a native runner's step (and not while
torch.compile traces): ``model.generate`` and every other plain Hugging Face use run the original
code. Only Llama's own modules (``LlamaRMSNorm``, ``LlamaMLP`` with SiLU, ``apply_rotary_pos_emb``),
whose code the kernels reproduce; shapes the kernels do not take (sizes that are not whole vectors)
keep the original too.
"""
from __future__ import annotations

from typing import Any

import torch

from corekv.engine.attention import native_kernels

#: the dtypes the kernels compute in
_DTYPES = (torch.float32, torch.bfloat16)
#: the kernels work in whole vectors of this many values (elementwise.cpp's LANES); the rotary
#: embedding in two halves of them
_LANES = 16


def use_native_elementwise(hf_model: Any) -> None:
    """Route the Llama RMSNorm, MLP and rotary embedding of ``hf_model`` to the native kernels
    during native steps (see the module's docstring). Idempotent; other architectures unchanged."""
    from transformers import activations
    from transformers.models.llama import modeling_llama as llama

    silu = (torch.nn.SiLU, getattr(activations, "SiLUActivation", torch.nn.SiLU))  # ACT2FN["silu"] is the latter
    for module in hf_model.modules():
        if getattr(module, "_corekv_native_elementwise", False):
            continue
        if type(module) is llama.LlamaRMSNorm:
            module.forward = _rms_norm(module, module.forward)
        elif type(module) is llama.LlamaMLP and isinstance(module.act_fn, silu):
            module.forward = _mlp(module, module.forward)
        else:
            continue
        module._corekv_native_elementwise = True
    if not getattr(llama.apply_rotary_pos_emb, "_corekv_native", False):
        llama.apply_rotary_pos_emb = _rotary(llama.apply_rotary_pos_emb)


def _native_for(*tensors: torch.Tensor):
    """The step's native kernels where they take these tensors (CPU, one dtype of theirs), else None."""
    native = native_kernels()
    if native is None or torch.compiler.is_compiling():
        return None
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in _DTYPES or any(t.dtype != first.dtype for t in tensors):
        return None
    return native


def _rms_norm(module, original):
    weight = module.weight

    def forward(hidden_states):
        native = _native_for(hidden_states, weight)
        if native is None or hidden_states.shape[-1] % _LANES:
            return original(hidden_states)
        return native.rms_norm(hidden_states, weight, module.variance_epsilon)
    return forward


def _mlp(module, original):
    def forward(x):
        native = _native_for(x)
        if native is None:
            return original(x)
        gate, up = module.gate_proj(x), module.up_proj(x)
        if gate.numel() % _LANES or gate.dtype != up.dtype:
            return module.down_proj(module.act_fn(gate) * up)
        return module.down_proj(native.silu_mul(gate, up))
    return forward


def _rotary(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        native = _native_for(q, k, cos, sin)
        if (native is None or unsqueeze_dim != 1 or q.dim() != 4 or q.shape[0] != 1 or q.shape[-1] % (2 * _LANES)
                or cos.shape != (1, q.shape[2], q.shape[3]) or q.stride(-1) != 1 or k.stride(-1) != 1):
            return original(q, k, cos, sin, unsqueeze_dim)
        return native.rotary(q, cos, sin), native.rotary(k, cos, sin)
    apply_rotary_pos_emb._corekv_native = True
    return apply_rotary_pos_emb
