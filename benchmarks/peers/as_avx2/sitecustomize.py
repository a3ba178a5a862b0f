"""On ``PYTHONPATH`` (``vllm_w1_w2.py --isa avx2``): torch's CPU feature probes answer as on a CPU
without AVX-512 or AMX, in this process and every Python process it starts.

vLLM-CPU picks its kernels from these probes (``vllm/platforms/cpu.py`` loads ``vllm._C_AVX2``
where ``torch.cpu._is_avx512_supported()`` is False; its attention and linear layers check the
others), not from ``ATEN_CPU_CAPABILITY``, so without this an AVX-512 machine restricted by
environment would still run vLLM's AVX-512 kernels.
"""
import torch.cpu

for _name in ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
              "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)
