"""corekv's CPU kernels (installed as ``corekv.engine.cpu``): what a CPU step runs besides torch's.

* :mod:`~corekv.engine.cpu.linears`: the layouts and kernels a loaded model's CPU ``nn.Linear``
  layers run (``prepare_model`` prepares them; a native runner adds the panel kernel);
* :mod:`~corekv.engine.cpu.native`: builds the C++ kernels (``paged_attention.cpp``,
  ``small_linear.cpp`` and their code per instruction set, ``kernels_isa.h``, shipped beside it)
  that a CPU engine runs (``engine.cpu_kernels``), choosing the instruction set at run time;
* :mod:`~corekv.engine.cpu.gemm_plan`: which GEMM (MKL, oneDNN, ...) each Linear shape runs,
  timed once per machine and cached on disk;
* :mod:`~corekv.engine.cpu.isa`: what this CPU offers (vendor, model, torch's capability, flags),
  and the environment that makes an AVX-512 machine act as an AVX2 one;
* :mod:`~corekv.engine.cpu.malloc`: glibc malloc thresholds for the engine's process
  (``engine.tune_cpu_malloc``).

Nothing is imported here, so importing one module does not import or build the others.
"""
