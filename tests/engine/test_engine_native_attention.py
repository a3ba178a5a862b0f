"""corekv's native kernels (engine/cpu/, really built with g++ here) against float64 references, for
every instruction set the build holds and this CPU runs (an AVX-512 machine runs the AVX2 code too,
from the same build); their checks; the build (a failed one: test_engine_compile.py)."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from corekv.engine.kv_pool import KVPool
from corekv.engine.cpu.native import built_isas, load_native_attention

#: the instruction sets the kernel tests run, each where this CPU runs it (x86-64 builds hold the
#: AVX-512 and AVX2 code, other builds one generic set)
ISAS = ["avx512", "avx2"] if platform.machine().lower() in ("x86_64", "amd64") else ["generic"]


def kernels_for(isa):
    """The native kernels of ``isa``; the test is skipped where this build or CPU has none."""
    if isa not in built_isas():
        pytest.skip(f"no {isa} code in this build or on this CPU (it runs {built_isas()})")
    return load_native_attention(isa)


def reference(q, k_pool, v_pool, tables, lens, scale):
    """float64 attention of each row's query over its first ``lens[r]`` positions: (out, lse)."""
    rows, heads, group, dim = q.shape
    bs = k_pool.shape[1]
    outs, lses = [], []
    for r in range(rows):
        positions = torch.arange(int(lens[r]))
        blocks = tables[r][positions // bs]
        k = k_pool[blocks, positions % bs].double()  # [n, H, D]
        v = v_pool[blocks, positions % bs].double()
        scores = torch.einsum("hgd,nhd->hgn", q[r].double(), k) * scale
        lse = torch.logsumexp(scores, -1)
        outs.append(torch.einsum("hgn,nhd->hgd", torch.exp(scores - lse[..., None]), v))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,dim", [(4, 64), (3, 68), (5, 64)])
def test_native_decode_equals_a_float64_softmax_over_the_rows_blocks(dtype, isa, group, dim):
    """Rows of 1 token, part of a block, whole blocks and many blocks (several key tiles), from a
    real KVPool's layer views (blocks strided by the other layers); the tables' padding and every
    unused block hold NaN, so reading past a row's length would show. Query heads per KV head of
    4, 3 and 5 (the kernel takes them up to 4 at a time) and a head size that is not a whole number
    of vectors (68: its last dims take the scalar tail)."""
    torch.manual_seed(0)
    # 2 KV heads of several query heads each: a mix-up of the two counts in the kernel's indexing shows
    pool = KVPool(num_layers=3, num_blocks=40, block_size=16, num_kv_heads=2, head_dim=dim, dtype=dtype, device="cpu")
    pool.storage.fill_(float("nan"))
    k_pool, v_pool = pool.layer_kv(1)
    lens = torch.tensor([1, 7, 16, 32, 100, 129])
    tables = torch.full((len(lens), 9), 39, dtype=torch.long)  # padding: block 39, all NaN
    free = torch.randperm(39).tolist()
    for r, n in enumerate(lens.tolist()):
        for j in range(-(-n // 16)):
            block = free.pop()
            tables[r, j] = block
            k_pool[block] = torch.randn(16, 2, dim).to(dtype)
            v_pool[block] = torch.randn(16, 2, dim).to(dtype)
        tail = n % 16
        if tail:  # positions past the length inside the row's last block: NaN again
            k_pool[tables[r, j], tail:] = float("nan")
            v_pool[tables[r, j], tail:] = float("nan")
    q = torch.randn(len(lens), 2, group, dim).to(dtype)
    out, lse = kernels_for(isa).decode(q, k_pool, v_pool, tables, lens, 0.125)
    expected_out, expected_lse = reference(q, k_pool, v_pool, tables, lens, 0.125)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == q.shape and lse.shape == q.shape[:3]
    torch.testing.assert_close(out.double(), expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-5, atol=1e-5)


def test_native_decode_checks_its_arguments():
    decode = load_native_attention().decode
    pool = KVPool(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                  device="cpu")
    k, v = pool.layer_kv(0)
    q = torch.zeros(1, 2, 1, 8)
    table = torch.tensor([[0, 1]])
    for lens in (torch.tensor([0]), torch.tensor([33])):  # empty, or longer than its two blocks
        with pytest.raises(RuntimeError, match="context length is outside its block table"):
            decode(q, k, v, table, lens, 1.0)
    with pytest.raises(RuntimeError, match="q and pool heads differ"):
        decode(torch.zeros(1, 3, 1, 8), k, v, table, torch.tensor([4]), 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        decode(q, k, v, table.int(), torch.tensor([4]), 1.0)
    with pytest.raises(RuntimeError, match="block id is outside the pool"):
        decode(q, k, v, torch.tensor([[0, 4]]), torch.tensor([20]), 1.0)


def prefill_reference(q, k_pool, v_pool, tables, query_starts, start_pos, scale):
    """float64 causal attention of each chunk's queries over its sequence's first positions."""
    heads, bs = k_pool.shape[2], k_pool.shape[1]
    outs = []
    for c in range(len(start_pos)):
        first, n = int(start_pos[c]), int(query_starts[c + 1] - query_starts[c])
        positions = torch.arange(first + n)
        blocks = tables[c][positions // bs]
        k = k_pool[blocks, positions % bs].double()  # [ctx, H, D]
        v = v_pool[blocks, positions % bs].double()
        queries = q[query_starts[c]:query_starts[c + 1]].double().view(n, heads, -1, q.shape[-1])  # [n, H, G, D]
        scores = torch.einsum("nhgd,thd->nhgt", queries, k) * scale
        hidden = positions[None] > torch.arange(first, first + n)[:, None]  # [n, ctx]
        scores = scores.masked_fill(hidden[:, None, None], float("-inf"))
        outs.append(torch.einsum("nhgt,thd->nhgd", torch.softmax(scores, -1), v).reshape(n, -1, q.shape[-1]))
    return torch.cat(outs)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_prefill_equals_a_float64_causal_softmax_over_each_chunks_blocks(dtype, isa):
    """One call for chunks of 1 token, part of a block, several query tiles (16 queries for AVX-512,
    8 for AVX2; and a ragged last one), from position 0, after cached positions (mid-block too), and two chunks after the same
    shared blocks (W2's shape); NaN in every position no chunk may read, so a read past a query's
    own position, or of another chunk's blocks, would show."""
    torch.manual_seed(0)
    pool = KVPool(num_layers=2, num_blocks=60, block_size=16, num_kv_heads=2, head_dim=64, dtype=dtype, device="cpu")
    pool.storage.fill_(float("nan"))
    k_pool, v_pool = pool.layer_kv(1)
    # (start_pos, queries) per chunk; the last two share their first three blocks
    chunks = [(0, 1), (0, 7), (5, 40), (0, 77), (300, 20), (48, 33), (48, 16)]
    width = max(-(-(s + n) // 16) for s, n in chunks)
    tables = torch.full((len(chunks), width), 59, dtype=torch.long)  # padding: block 59, all NaN
    free = torch.randperm(59).tolist()
    for c, (first, n) in enumerate(chunks):
        for j in range(-(-(first + n) // 16)):
            tables[c, j] = tables[c - 1, j] if c == len(chunks) - 1 and j < 3 else free.pop()
            k_pool[tables[c, j]] = torch.randn(16, 2, 64).to(dtype)
            v_pool[tables[c, j]] = torch.randn(16, 2, 64).to(dtype)
        tail = (first + n) % 16
        if tail:  # past the chunk's last position in its own last block: NaN again
            k_pool[tables[c, (first + n) // 16], tail:] = float("nan")
            v_pool[tables[c, (first + n) // 16], tail:] = float("nan")
    query_starts = torch.cumsum(torch.tensor([0] + [n for _, n in chunks]), 0)
    start_pos = torch.tensor([s for s, _ in chunks])
    q = torch.randn(int(query_starts[-1]), 8, 64).to(dtype)  # 8 query heads over 2 KV heads
    out = torch.full_like(q, float("nan"))
    kernels_for(isa).prefill(q, k_pool, v_pool, tables, query_starts, start_pos, 0.125, out)
    expected = prefill_reference(q, k_pool, v_pool, tables, query_starts, start_pos, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's own rounding
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


def test_native_prefill_reads_strided_queries_and_checks_its_arguments():
    prefill = load_native_attention().prefill
    pool = KVPool(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                  device="cpu")
    pool.storage.normal_()
    k, v = pool.layer_kv(0)
    table, starts, first = torch.tensor([[2, 1]]), torch.tensor([0, 5]), torch.tensor([10])
    q = torch.randn(4, 5, 8).transpose(0, 1)  # [5 tokens, 4 heads, 8], tokens not adjacent in memory
    out = torch.empty(5, 4, 8)
    prefill(q, k, v, table, starts, first, 0.5, out)
    torch.testing.assert_close(out.double(), prefill_reference(q, k, v, table, starts, first, 0.5),
                               rtol=1e-5, atol=1e-5)
    q = q.contiguous()
    with pytest.raises(RuntimeError, match="context length is outside its block table"):
        prefill(q, k, v, table, starts, torch.tensor([28]), 1.0, out)  # positions 28..32 need a third block
    with pytest.raises(RuntimeError, match="block id is outside the pool"):
        prefill(q, k, v, torch.tensor([[4, 1]]), starts, first, 1.0, out)
    with pytest.raises(RuntimeError, match="query_starts must run from 0"):
        prefill(q, k, v, table, torch.tensor([0, 4]), first, 1.0, out)
    with pytest.raises(RuntimeError, match="every chunk needs a query"):
        prefill(q, k, v, torch.tensor([[2, 1], [3, 0]]), torch.tensor([0, 5, 5]), torch.tensor([0, 0]), 1.0, out)
    with pytest.raises(RuntimeError, match="multiple of the pool's KV heads"):
        prefill(torch.zeros(5, 3, 8), k, v, table, starts, first, 1.0, out)
    with pytest.raises(RuntimeError, match="of the pool's dtype"):
        prefill(q.double(), k, v, table, starts, first, 1.0, out)
    with pytest.raises(RuntimeError, match="int64"):
        prefill(q, k, v, table, starts.int(), first, 1.0, out)


def test_runner_takes_the_native_path_only_where_the_kernel_serves(tiny_llama):
    """By default with compile on a float32/bfloat16 CPU pool; asking for it elsewhere is an error
    naming the fix, not a failure at the first decode."""
    from corekv.engine.model_runner import ModelRunner
    from corekv.engine.tiny_model import make_tiny_llama
    from corekv.errors import CoreKVError

    def pool(loaded):
        return KVPool(loaded.num_layers, 8, 16, loaded.num_kv_heads, loaded.head_dim, loaded.dtype, "cpu")

    assert ModelRunner(tiny_llama, pool(tiny_llama))._native is None
    assert ModelRunner(tiny_llama, pool(tiny_llama), native=True)._native is not None
    half = make_tiny_llama(dtype="float16")
    with pytest.raises(CoreKVError, match="native=False"):
        ModelRunner(half, pool(half), native=True)
    with pytest.raises(CoreKVError, match="must be True, False or None"):
        ModelRunner(tiny_llama, pool(tiny_llama), native=1)


def test_loading_the_native_kernel_leaves_subnormal_floats_alone():
    """It is compiled with -ffast-math; linking that flag would turn on flush-to-zero for the whole
    process (and change every model's results), so only the compile step may carry it."""
    load_native_attention()
    tiny = torch.tensor([1e-40, -3e-42])
    assert bool((tiny * 1.0 != 0).all()) and bool((torch.tensor([1e-38]) / 1000 != 0).all())


def test_the_build_finds_the_ninja_wheel_when_no_ninja_is_on_path(tmp_path):
    """As under CI, where the venv's python runs without the venv's bin/ on PATH: a fresh process
    and extension cache, PATH holding only the compiler's tools, so the ninja it builds with can only
    be the `ninja` wheel's."""
    import shutil

    tools = tmp_path / "tools"
    tools.mkdir()
    for name in ("c++", "g++", "gcc", "cc", "as", "ld"):
        if shutil.which(name):
            (tools / name).symlink_to(shutil.which(name))
    env = dict(os.environ, PATH=str(tools), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    code = ("import shutil; assert shutil.which('ninja') is None\n"
            "from corekv.engine.cpu.native import load_native_attention\n"
            "load_native_attention(); print('BUILT', shutil.which('ninja'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert "BUILT " in out.stdout and out.stdout.strip().endswith("ninja"), out.stdout + out.stderr[-2000:]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 32, 37])
@pytest.mark.parametrize("out_features, threads", [(192, 2), (320, 3)])
def test_small_linear_equals_a_float64_product(rows, dtype, isa, out_features, threads):
    """Row counts around the kernel's blocks of 6, an input size that is not a multiple of its
    128-deep slices, with and without bias; the packed copy is taken from a strided weight (the
    transposed layout corekv gives float32 weights). Panels that do not share evenly among the
    threads (3 or 5 of AVX-512's, 20 of AVX2's among 3 threads) split their rows among them from 24
    or 36 rows. bfloat16 sums in float32 and rounds once: within half a bfloat16 step (2^-8
    relative) of the exact product of the bfloat16 values."""
    kernels = kernels_for(isa)
    torch.manual_seed(rows)
    weight = torch.randn(200, out_features).t().to(dtype)  # [out, 200 in], column-major
    bias = torch.randn(out_features).to(dtype)
    x = torch.randn(rows, 200).to(dtype)
    packed = kernels.pack_linear_weight(weight)
    panel = 16 if isa == "avx2" else 64
    assert packed.shape == (out_features // panel, 200, panel) and packed.dtype == dtype
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -8
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b in (None, bias):
            out = kernels.small_linear(x, packed, b)
            assert out.dtype == dtype
            expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
            torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_small_linear_checks_its_arguments():
    kernels = load_native_attention()
    with pytest.raises(RuntimeError, match="out a multiple of 64"):
        kernels.pack_linear_weight(torch.zeros(96, 8))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.pack_linear_weight(torch.zeros(64, 8).double())
    packed = kernels.pack_linear_weight(torch.zeros(64, 8))
    with pytest.raises(RuntimeError, match="x \\[rows, in\\]"):
        kernels.small_linear(torch.zeros(2, 9), packed, None)
    with pytest.raises(RuntimeError, match="of one dtype"):
        kernels.small_linear(torch.zeros(2, 8).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="bias must be \\[out\\] of x's dtype"):
        kernels.small_linear(torch.zeros(2, 8), packed, torch.zeros(63))
    with pytest.raises(RuntimeError, match="bias must be \\[out\\] of x's dtype"):
        kernels.small_linear(torch.zeros(2, 8), packed, torch.zeros(64).bfloat16())


def test_panels_and_instruction_sets_are_checked():
    """Panels are as wide as their instruction set's registers want (pack and multiply with the same
    set); a set this build or CPU lacks is an error naming the ones it has."""
    from corekv.engine.cpu.native import NativeBuildError

    with pytest.raises(NativeBuildError, match="pick one of them"):
        load_native_attention("sse2")
    if not {"avx512", "avx2"} <= set(built_isas()):
        pytest.skip(f"needs the AVX-512 and the AVX2 code (this CPU runs {built_isas()})")
    wide, narrow = load_native_attention("avx512"), load_native_attention("avx2")
    with pytest.raises(RuntimeError, match="of the same instruction set, P = 16"):
        narrow.small_linear(torch.zeros(2, 8), wide.pack_linear_weight(torch.zeros(64, 8)), None)


def test_torchs_cpu_capability_chooses_the_kernels_instruction_set():
    """``ATEN_CPU_CAPABILITY=avx2``, how an AVX2 machine is reproduced on an AVX-512 one (with MKL's
    and oneDNN's own variables), gives corekv's native kernels their AVX2 code and hides the
    AVX-512 flags from the linears' choices; without it, the widest set this CPU runs."""
    if "avx2" not in built_isas():
        pytest.skip(f"no AVX2 code in this build or on this CPU (it runs {built_isas()})")
    code = ("import json, torch\n"
            "from corekv.engine.cpu.isa import cpu_info\n"
            "from corekv.engine.cpu.native import load_native_attention\n"
            "info = cpu_info()\n"
            "print(json.dumps([load_native_attention().isa, info.capability, sorted(f for f in info.flags "
            "if f.startswith('avx512'))]))\n")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == ["avx2", "AVX2", []]
    assert load_native_attention().isa == built_isas()[0]


@pytest.mark.parametrize("dtype", [
    "float32",
    pytest.param("bfloat16", marks=pytest.mark.skipif(
        not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="bfloat16 linears keep F.linear without oneDNN's bfloat16")),
])
def test_native_linears_serve_only_a_native_runners_decode_sized_steps(dtype, monkeypatch):
    """After a native runner wires a model, its Linear layers (outputs a multiple of 64) run the
    kernel for up to their timed ``native_rows`` inside that runner's steps, eagerly and through the
    opaque op a compiled graph calls, and give what they gave before wiring everywhere else: plain
    Hugging Face calls, more rows, a torch-path runner's steps (bfloat16: oneDNN's packed GEMM, or
    float32 from 128 rows). Wiring twice packs nothing again. The kernel's calls are counted (the
    real kernel, wrapped): at this size its bfloat16 results equal oneDNN's bit for bit. The timing
    is replaced by a plan where native wins up to 8 rows (the timing itself: the next test)."""
    from corekv.engine.cpu import gemm_plan, linears
    from corekv.engine.attention import forward_context
    from corekv.engine.model_runner import ModelRunner
    from corekv.engine.step_metadata import AttentionMetadata
    from corekv.engine.tiny_model import make_tiny_llama

    loaded = make_tiny_llama(dtype=dtype)  # its own model: wiring changes the modules' forward
    pool = KVPool(loaded.num_layers, 8, 16, loaded.num_kv_heads, loaded.head_dim, loaded.dtype, "cpu")
    module = next(m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear) and m.weight.shape[0] == 128)
    timed = gemm_plan.gemm_plan
    monkeypatch.setattr(gemm_plan, "gemm_plan", lambda dtype, shape, candidates, rows=None, weights=1, revision="": (
        {label: "native" if count <= 8 else next(iter(candidates)) for label, count in rows.items()}
        if "native" in candidates else timed(dtype, shape, candidates, rows, weights, revision)))
    least, most = 1, 8
    all_rows = [1, 2, 8, 9, 200]
    inputs = {rows: torch.randn(1, rows, module.weight.shape[1]).to(loaded.dtype) for rows in all_rows}
    before = {rows: module(x) for rows, x in inputs.items()}  # the forward before any runner wired it
    runner = ModelRunner(loaded, pool, native=True)
    wired = [m for m in loaded.model.modules() if getattr(getattr(m, "_corekv_packed", None), "panels", None) is not None]
    assert {m.weight.shape[0] for m in wired} == {64, 128, 320}  # k/v projections (32 outputs) are not
    assert module in wired
    panels = module._corekv_packed.panels
    ModelRunner(loaded, pool, native=True)
    assert module._corekv_packed.panels is panels
    handle = next(i for i, ref in enumerate(linears._PACKED) if ref() is module._corekv_packed)
    op = torch.ops.corekv.float32_linear if dtype == "float32" else torch.ops.corekv.bfloat16_linear
    kernel, calls = runner._native.small_linear, []

    def counted(*args):
        calls.append(args[0].shape[0])
        return kernel(*args)
    monkeypatch.setattr(module._corekv_packed, "small_linear", counted)
    native = AttentionMetadata(kv_pool=pool, slot_block_ids=torch.zeros(0), slot_offsets=torch.zeros(0),
                               native=runner._native)
    plain = AttentionMetadata(kv_pool=pool, slot_block_ids=torch.zeros(0), slot_offsets=torch.zeros(0))
    tolerance = 1e-5 if loaded.dtype == torch.float32 else 1e-2
    for rows, x in inputs.items():
        assert torch.equal(module(x), before[rows])
        with forward_context(plain):
            assert torch.equal(module(x), before[rows])
            if least <= rows <= most:  # a compiled graph's op outside a native step: as before
                assert torch.equal(op(x, module.weight, module.bias, handle), before[rows])
        with forward_context(native):
            if least <= rows <= most:
                expected = kernel(x[0], panels, module.bias)[None]
                assert torch.equal(module(x), expected)
                assert torch.equal(op(x, module.weight, module.bias, handle), expected)
                torch.testing.assert_close(expected, before[rows], rtol=tolerance, atol=tolerance)
            else:
                assert torch.equal(module(x), before[rows])
    assert calls == [rows for rows in all_rows if least <= rows <= most for _ in range(2)]


def test_native_rows_are_timed_per_shape_cached_and_bound_at_the_first_loss(tmp_path, monkeypatch):
    """Wiring times each shape's native kernel against its planned GEMM at NATIVE_ROWS_TIMED rows
    (on this machine, into the plan cache), each candidate run on all of the shape's weights in
    turn: ``native_rows`` is the last count of the leading run that native won, the same for every
    Linear of a shape, and a Linear native never beat keeps no panels. A cached choice is honoured against the timing: forced to lose at 2 rows, native takes
    1 row only."""
    import json
    from collections import Counter

    from corekv.engine.cpu import gemm_plan, linears
    from corekv.engine.model_runner import ModelRunner
    from corekv.engine.tiny_model import make_tiny_llama

    assert linears._native_bound({"1": "native", "2": "native", "4": "mkl", "8": "native", "16": "native",
                                  "32": "native"}) == 2
    assert linears._native_bound(dict.fromkeys(map(str, linears.NATIVE_ROWS_TIMED), "onednn")) == 0
    monkeypatch.setenv("COREKV_CACHE_DIR", str(tmp_path))

    def wire():
        loaded = make_tiny_llama()
        ModelRunner(loaded, KVPool(loaded.num_layers, 8, 16, loaded.num_kv_heads, loaded.head_dim,
                                   loaded.dtype, "cpu"), native=True)
        return {m: m._corekv_packed for m in loaded.model.modules()
                if isinstance(m, torch.nn.Linear) and m.weight.shape[0] % 64 == 0}
    wired = wire()
    by_shape = {}
    for module, packed in wired.items():
        assert packed.native_rows in (0, *linears.NATIVE_ROWS_TIMED)
        assert (packed.panels is None) == (packed.native_rows == 0)
        assert by_shape.setdefault(tuple(module.weight.shape), packed.native_rows) == packed.native_rows
    counts = Counter(tuple(module.weight.shape) for module in wired)
    cache = json.loads(gemm_plan.cache_path().read_text())
    timings = {key: plan for key, plan in cache.items() if "/native" in key}
    assert sorted(key.split("|")[8] for key in timings) == sorted(f"{out}x{inp}" for out, inp in counts)
    revision = load_native_attention().revision
    for key in timings:  # timed over every weight of the shape (the tiny model has 2 layers), by these kernels
        out, inp = map(int, key.split("|")[8].split("x"))
        assert key.endswith((f"|{counts[(out, inp)]} weights" if counts[(out, inp)] > 1 else "32")
                            + f"|kernels {revision}")
    assert max(counts.values()) > 1
    assert all(set(plan) == set(map(str, linears.NATIVE_ROWS_TIMED)) for plan in timings.values())
    forced = {key: {label: "native" if label == "1" else next(c for c in key.split("|")[9].split("/") if c != "native")
                    for label in plan} for key, plan in timings.items()}
    gemm_plan.cache_path().write_text(json.dumps({**cache, **forced}))
    assert {packed.native_rows for packed in wire().values()} == {1}



def _close_to_hf(out, expected):
    """Equal up to float32 summation order (and the kernels' exp); bfloat16: a unit in the last
    place at most, in few values (the kernels round where Hugging Face's code rounds)."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -7, atol=1e-6)
        assert (out != expected).float().mean() < 0.02


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_elementwise_kernels_compute_what_the_llama_code_computes(dtype, isa):
    """rms_norm, silu_mul and rotary against the Hugging Face Llama code they stand in for, at
    SmolLM2's sizes (hidden 576, head size 64, 9 query and 3 KV heads): the SiLU over ordinary
    values and both tails (exp(-x) overflows float32 past 88), the rotary embedding on queries and
    keys laid out as the projections write them, at positions far from 0. bfloat16's rotary rounds
    each product as the Hugging Face code does, so it is equal bit for bit."""
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as llama

    kernels = kernels_for(isa)
    torch.manual_seed(0)
    norm = llama.LlamaRMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576) * 2)
    x = (torch.randn(1, 7, 576) * 3).to(dtype)
    _close_to_hf(kernels.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))

    tails = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0, 0.5])
    gate = torch.cat([torch.randn(1008) * 4, tails, -tails]).to(dtype)
    up = torch.randn(len(gate)).to(dtype)
    _close_to_hf(kernels.silu_mul(gate, up), F.silu(gate) * up)

    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rope_theta=100000.0)
    tokens = 21
    q = torch.randn(1, tokens, 9, 64).to(dtype).transpose(1, 2)
    k = torch.randn(1, tokens, 3, 64).to(dtype).transpose(1, 2)
    cos, sin = llama.LlamaRotaryEmbedding(config)(q, torch.arange(1000, 1000 + tokens)[None])
    expected_q, expected_k = llama.apply_rotary_pos_emb(q, k, cos, sin)  # outside a step: the original
    for x, expected in ((q, expected_q), (k, expected_k)):
        out = kernels.rotary(x, cos, sin)
        assert out.transpose(1, 2).is_contiguous()  # [1, tokens, heads, D] in memory, as x
        if dtype == torch.bfloat16:
            assert torch.equal(out, expected)
        else:
            _close_to_hf(out, expected)


def test_native_elementwise_kernels_check_their_arguments():
    kernels = load_native_attention()
    with pytest.raises(RuntimeError, match="rms_norm: x"):
        kernels.rms_norm(torch.zeros(2, 24), torch.ones(24), 1e-6)
    with pytest.raises(RuntimeError, match="all of one dtype"):
        kernels.rms_norm(torch.zeros(2, 32), torch.ones(32, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="silu_mul: gate and up of one shape"):
        kernels.silu_mul(torch.zeros(32), torch.zeros(16))
    with pytest.raises(RuntimeError, match="rotary: x must be"):
        kernels.rotary(torch.zeros(1, 2, 3, 48), torch.zeros(1, 3, 48), torch.zeros(1, 3, 48))
    with pytest.raises(RuntimeError, match="rotary: cos and sin"):
        kernels.rotary(torch.zeros(1, 2, 3, 64), torch.zeros(1, 4, 64), torch.zeros(1, 4, 64))


def test_native_elementwise_serves_only_a_native_runners_steps():
    """A native runner wires a tiny Llama (head size 32, so every kernel takes it): inside its steps
    each RMSNorm, MLP and rotary embedding runs its kernel (calls counted through the real kernels)
    and the logits equal a torch-path runner's; plain Hugging Face calls give what they gave before
    the wiring, bit for bit, and wiring twice wraps nothing twice."""
    from collections import Counter

    from transformers.models.llama import modeling_llama as llama

    from corekv.engine.model_runner import ModelRunner, ScheduledChunk
    from corekv.engine.tiny_model import make_tiny_llama

    loaded = make_tiny_llama(hidden_size=128, num_heads=4)  # its own model: wiring changes the modules' forward
    ids = torch.randint(3, 300, (1, 40))
    before = loaded.model(ids).logits
    torch_runner = ModelRunner(loaded, KVPool(loaded.num_layers, 8, 16, loaded.num_kv_heads, loaded.head_dim,
                                              loaded.dtype, "cpu"), native=False)
    expected = torch_runner.execute([ScheduledChunk(ids[0].tolist(), 0, [0, 1, 2])])
    runner = ModelRunner(loaded, KVPool(loaded.num_layers, 8, 16, loaded.num_kv_heads, loaded.head_dim,
                                        loaded.dtype, "cpu"), native=True)
    rotary = llama.apply_rotary_pos_emb
    ModelRunner(loaded, runner.kv_pool, native=True)
    assert llama.apply_rotary_pos_emb is rotary
    calls = Counter()

    def counted(name):
        kernel = getattr(runner._native, name)

        def call(*args):
            calls[name] += 1
            return kernel(*args)
        return call
    runner._native = runner._native._replace(**{name: counted(name) for name in ("rms_norm", "silu_mul", "rotary")})
    logits = runner.execute([ScheduledChunk(ids[0].tolist(), 0, [0, 1, 2])])
    layers = loaded.num_layers
    assert calls == {"rms_norm": 2 * layers + 1, "silu_mul": layers, "rotary": 2 * layers}
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(loaded.model(ids).logits, before)
