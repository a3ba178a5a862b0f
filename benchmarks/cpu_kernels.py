"""The CPU kernel choices behind corekv's engine, measured at SmolLM2-135M's shapes (BENCHMARKS.md, Engine).

    python benchmarks/cpu_kernels.py [--threads 2] [--repeats 5] [--isa avx2] [--tables shapes,linears,...]

The header names the CPU (vendor, model, torch's capability, the flags the kernels' choices read)
and the instruction set of corekv's native kernels. ``--isa avx2`` runs the whole benchmark as on
an AVX2 machine: it restarts itself with torch, MKL, oneDNN and the native kernels restricted to
AVX2 (``corekv.engine.cpu.isa.RESTRICT_ENV``: ``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``,
``ONEDNN_MAX_CPU_ISA``).

* ``shapes``: each distinct Linear shape of SmolLM2 (all 30 layers' weights of it, so they stream
  from memory as in the engine; the tied ``lm_head`` once) at decode (1, 5, 32) and prefill (128,
  1,024) row counts, by every GEMM corekv can choose: MKL (``F.linear``; float32 on the transposed
  layout corekv stores), MKL's packed GEMM (float32), oneDNN on a packed copy, the native panel
  kernel, and (bfloat16) float32 after upcasting input and weight. What
  ``corekv.engine.cpu.linears`` chooses per shape and row count is measured here.
* ``linears``: one decoder step's seven Linear weights of all 30 layers (so they stream from memory
  as in the engine) at 1 to 1,024 rows: ``F.linear`` on the row-major weight, on the transposed
  layout corekv stores for float32, the native kernel on a copy packed into 64-column panels
  (engine/cpu/small_linear.cpp, what ``engine.compile`` runs for a decode step's rows, float32 and
  bfloat16), on a oneDNN-packed copy, and (bfloat16) multiplied in
  float32 after upcasting input and weight (what corekv does from 128 rows).
* ``prefill attention``: W2's step shape (8 chunks of 128 tokens after a shared 384-token cached
  prefix, 9 query and 3 KV heads of 64, one layer): eight masked SDPA calls over gathered contexts
  (corekv's path for single chunks) against a :class:`PrefillGroup`-style shared call plus one
  batched causal call merged through log-sum-exps, and the native prefill kernel that
  ``engine.compile`` builds, reading a real KVPool's layer views (engine/cpu/paged_attention.cpp).
* ``decode attention``: W1's and W2's decode shapes over a real KVPool's layer views, one layer
  repeated (cache-hot) and the 30 layers in turn (cache-cold, as in a decode step): the torch path
  (gather the blocks, SDPA with a padding mask) against the native kernel
  (engine/cpu/paged_attention.cpp).

Medians of ``--repeats`` runs, milliseconds; each table's ratios are against its first column.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def median_ms(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def linears(dtype, repeats):
    layers = [[torch.randn(n, k).to(dtype) for n, k in SHAPES] for _ in range(30)]
    variants = {"F.linear": (layers, lambda x, w: F.linear(x, w))}
    if dtype == torch.float32:
        variants["transposed layout"] = ([[w.t().contiguous().t() for w in layer] for layer in layers],
                                         lambda x, w: F.linear(x, w))
    from corekv.engine.cpu.native import load_native_attention

    kernels = load_native_attention()
    variants["native panels"] = ([[kernels.pack_linear_weight(w) for w in layer] for layer in layers],
                                 lambda x, p: kernels.small_linear(x, p, None))
    if dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in layer] for layer in layers]
        variants["oneDNN packed"] = (packed, lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
    if dtype == torch.bfloat16:
        variants["float32 upcast"] = (layers, lambda x, w: F.linear(x.float(), w.float()).to(dtype))
    rows = []
    for m in (1, 5, 8, 16, 32, 128, 1024):
        inputs = {k: torch.randn(m, k).to(dtype) for k in (576, 1536)}
        times = {}
        for name, (weights, op) in variants.items():
            times[name] = median_ms(lambda: [op(inputs[k], w) for layer in weights
                                              for w, (_, k) in zip(layer, SHAPES)], repeats)
        rows.append((m, times))
    names = list(variants)
    lines = [f"**Linears of 30 layers, {str(dtype).split('.')[1]}** (ms; ratio to {names[0]})", "",
             "| rows | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for m, times in rows:
        base = times[names[0]]
        lines.append(f"| {m} | " + " | ".join(f"{times[n]:.1f} ({times[n] / base:.2f}x)" for n in names) + " |")
    return "\n".join(lines)


#: SmolLM2-135M's distinct Linear shapes (out, in), the layers holding each, and how many copies
#: a forward reads (``lm_head`` is tied to the embedding: one, and it sees one row per sequence, so
#: decode row counts only)
LAYER_SHAPES = (("q_proj, o_proj", (576, 576), 30), ("k_proj, v_proj", (192, 576), 30),
                ("gate_proj, up_proj", (1536, 576), 30), ("down_proj", (576, 1536), 30), ("lm_head", (49152, 576), 1))
DECODE_ROWS, PREFILL_ROWS = (1, 5, 32), (128, 1024)


def gemm_variants(dtype, weights, rows, kernels):
    """The GEMMs corekv can choose for ``weights`` (one shape's copies) at ``rows`` rows, as
    ``{name: (prepared copies, op(x, copy))}``; those this CPU (or restriction) lacks are left out."""
    variants = {}
    if dtype == torch.float32:
        variants["MKL"] = ([w.t().contiguous().t() for w in weights], lambda x, w: F.linear(x, w))
        # NOTE: packed for this row count, as inductor packs frozen linears for its batch size
        packed = [(torch.ops.mkl._mkl_reorder_linear_weight(w, rows), w) for w in weights]
        variants["MKL packed"] = (packed, lambda x, p: torch.ops.mkl._mkl_linear(x, p[0], p[1], None, rows))
    else:
        variants["F.linear"] = (weights, lambda x, w: F.linear(x, w))
    if dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        variants["oneDNN packed"] = (packed, lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
    if kernels is not None:
        variants["native panels"] = ([kernels.pack_linear_weight(w) for w in weights],
                                     lambda x, p: kernels.small_linear(x, p, None))
    if dtype == torch.bfloat16:
        variants["float32 upcast"] = (weights, lambda x, w: F.linear(x.float(), w.float()).to(dtype))
    return variants


def linears_by_shape(dtype, repeats):
    """Each SmolLM2 Linear shape at decode and prefill rows by every GEMM of :func:`gemm_variants`."""
    from corekv.engine.cpu.native import NativeBuildError, load_native_attention

    try:
        kernels = load_native_attention()
    except NativeBuildError:
        kernels = None
    name = str(dtype).split(".")[1]
    header, lines = None, []
    for label, (n, k), copies in LAYER_SHAPES:
        weights = [torch.randn(n, k).to(dtype) for _ in range(copies)]
        for m in DECODE_ROWS + (PREFILL_ROWS if copies > 1 else ()):
            x = torch.randn(m, k).to(dtype)
            times = {}
            for variant, (prepared, op) in gemm_variants(dtype, weights, m, kernels).items():
                times[variant] = median_ms(lambda: [op(x, w) for w in prepared], repeats)
            if header is None:
                header = list(times)
            best = min(times.values())
            cells = [f"**{times[v]:.2f}**" if times[v] == best else f"{times[v]:.2f} ({times[v] / best:.2f}x)"
                     if v in times else "-" for v in header]
            lines.append(f"| {label} {n}x{k} x{copies} | {m} | " + " | ".join(cells) + f" | {min(times, key=times.get)} |")
        del weights
    return "\n".join([f"**Linears by shape, {name}** (ms for all copies of the shape; ratio to the fastest, in bold)", "",
                      "| shape (out x in, copies) | rows | " + " | ".join(header) + " | fastest |",
                      "|---|---:|" + "---:|" * len(header) + "---|", *lines])


def prefill_attention(repeats):
    from corekv.engine.kv_pool import KVPool
    from corekv.engine.cpu.native import load_native_attention

    heads, kv_heads, dim, n, shared, chunks = 9, 3, 64, 128, 384, 8
    tokens = n * chunks
    query = torch.randn(1, tokens, heads, dim).transpose(1, 2)
    key = torch.randn(1, tokens, kv_heads, dim).transpose(1, 2)
    value = torch.randn(1, tokens, kv_heads, dim).transpose(1, 2)
    k_cached, v_cached = torch.randn(1, kv_heads, shared, dim), torch.randn(1, kv_heads, shared, dim)
    hidden = torch.arange(shared + n)[None] > torch.arange(shared, shared + n)[:, None]
    mask = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))[None, None]
    contexts = [(torch.cat([k_cached, key[:, :, i * n:(i + 1) * n]], 2),
                 torch.cat([v_cached, value[:, :, i * n:(i + 1) * n]], 2)) for i in range(chunks)]

    def masked():
        return [F.scaled_dot_product_attention(query[:, :, i * n:(i + 1) * n], k, v, attn_mask=mask, enable_gqa=True)
                for i, (k, v) in enumerate(contexts)]

    def grouped():
        out_s, lse_s = flash(query[0].reshape(1, kv_heads, -1, dim), k_cached, v_cached)
        out_c, lse_c = flash(query[0].view(heads, chunks, n, dim).transpose(0, 1),
                             key[0].view(kv_heads, chunks, n, dim).transpose(0, 1),
                             value[0].view(kv_heads, chunks, n, dim).transpose(0, 1), is_causal=True)
        weight = torch.sigmoid(lse_s.reshape(heads, tokens) - lse_c.transpose(0, 1).reshape(heads, tokens))
        return torch.lerp(out_c.transpose(0, 1).reshape(heads, tokens, dim), out_s.reshape(heads, tokens, dim),
                          weight[..., None])

    # the same K/V in a real pool's layer view: shared blocks, then each chunk's own 8 blocks
    pool = KVPool(30, 1000, 16, kv_heads, dim, torch.float32, "cpu")
    k_pool, v_pool = pool.layer_kv(5)
    ids = torch.randperm(1000)
    prefix, own = ids[:shared // 16], ids[shared // 16:shared // 16 + tokens // 16].view(chunks, -1)
    k_pool[prefix] = k_cached[0].transpose(0, 1).reshape(-1, 16, kv_heads, dim)
    v_pool[prefix] = v_cached[0].transpose(0, 1).reshape(-1, 16, kv_heads, dim)
    k_pool[own.reshape(-1)] = key[0].transpose(0, 1).reshape(-1, 16, kv_heads, dim)
    v_pool[own.reshape(-1)] = value[0].transpose(0, 1).reshape(-1, 16, kv_heads, dim)
    tables = torch.cat([prefix.expand(chunks, -1), own], 1)
    query_starts, start_pos = torch.arange(0, tokens + 1, n), torch.full((chunks,), shared)
    out = torch.empty(tokens, heads, dim)
    kernel = load_native_attention().prefill
    rows = query[0].transpose(0, 1)

    def native():
        kernel(rows, k_pool, v_pool, tables, query_starts, start_pos, dim ** -0.5, out)
        return out

    expected = torch.cat([o[0] for o in masked()], 1)
    assert torch.allclose(grouped(), expected, atol=1e-5), "the grouped path must compute the same attention"
    assert torch.allclose(native().transpose(0, 1), expected, atol=1e-5), "the native kernel too"
    a, b, c = median_ms(masked, repeats), median_ms(grouped, repeats), median_ms(native, repeats)
    return ("**Prefill attention, W2's step shape, one layer, float32** (ms)\n\n"
            "| 8 masked calls over gathered contexts | shared call + batched causal call + merge | native kernel |\n"
            "|---:|---:|---:|\n"
            f"| {a:.2f} | {b:.2f} ({b / a:.2f}x) | {c:.2f} ({c / a:.2f}x) |")


def decode_attention(repeats):
    """Decode attention over a real KVPool's layer views: the torch path (gather the rows' blocks,
    SDPA with a padding mask) against the native kernel, at W1's and W2's decode shapes, one layer
    again and again (its KV stays in cache) and the 30 layers in turn (each layer's KV cold when its
    turn comes, as in a decode step); microseconds per layer."""
    from corekv.engine.kv_pool import KVPool
    from corekv.engine.cpu.native import load_native_attention

    native = load_native_attention().decode
    lines = [f"**Decode attention, one layer, pool of 1,000 blocks x 30 layers** (us; medians of {repeats})", "",
             "| shape | dtype | gather + SDPA | native kernel |", "|---|---|---:|---:|"]
    for dtype in (torch.float32, torch.bfloat16):
        pool = KVPool(30, 1000, 16, 3, 64, dtype, "cpu")
        pool.storage.normal_()
        for label, rows, blocks, layers in (("W1: 5 rows x 10 blocks", 5, 10, [5]),
                                            ("W2 own blocks: 32 rows x 9 blocks", 32, 9, [5]),
                                            ("W2 own blocks, the 30 layers in turn", 32, 9, range(30))):
            views = [pool.layer_kv(i) for i in layers]
            q = torch.randn(rows, 3, 3, 64).to(dtype)
            tables = torch.randperm(1000)[:rows * blocks].view(rows, blocks)
            lens = torch.full((rows,), blocks * 16 - 3)
            mask = torch.zeros(rows, 1, 1, blocks * 16, dtype=dtype)
            mask[..., -3:] = float("-inf")

            def gathered(k_pool, v_pool):
                k = k_pool.index_select(0, tables.view(-1)).view(rows, -1, 3, 64).transpose(1, 2)
                v = v_pool.index_select(0, tables.view(-1)).view(rows, -1, 3, 64).transpose(1, 2)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)

            out, _ = native(q, *views[0], tables, lens, 0.125)
            assert torch.allclose(out.to(dtype).float(), gathered(*views[0]).float(), atol=1e-2), "the paths must agree"
            a = median_ms(lambda: [gathered(*kv) for kv in views], repeats) * 1e3 / len(views)
            b = median_ms(lambda: [native(q, *kv, tables, lens, 0.125) for kv in views], repeats) * 1e3 / len(views)
            lines.append(f"| {label} | {str(dtype).split('.')[1]} | {a:.0f} | {b:.0f} ({b / a:.2f}x) |")
    return "\n".join(lines)


def cpu_header(threads, repeats) -> str:
    """The CPU, its restrictions and the libraries, for the top of every table set."""
    import os

    from corekv.engine.cpu.isa import RESTRICT_ENV, cpu_info
    from corekv.engine.cpu.native import NativeBuildError, load_native_attention

    try:
        native = load_native_attention().isa
    except NativeBuildError as exc:
        native = f"none ({exc})"
    names = sorted({k for env in RESTRICT_ENV.values() for k in env})
    restricted = " ".join(f"{k}={os.environ[k]}" for k in names if k in os.environ) or "none"
    onednn = torch.backends.mkldnn.version() if hasattr(torch.backends.mkldnn, "version") else "?"
    return (f"CPU: {cpu_info().describe()}; native kernels: {native}; restrictions: {restricted}\n"
            f"torch {torch.__version__} (MKL {torch.backends.mkl.is_available()}, oneDNN {onednn}), "
            f"{threads} threads, medians of {repeats}")


def restart_restricted(isa: str) -> None:
    """Run this script again as on an ``isa`` machine (the libraries read their variables when they
    start, so in a fresh process); returns when the environment already is that."""
    import os
    import sys

    from corekv.engine.cpu.isa import RESTRICT_ENV

    env = RESTRICT_ENV[isa]
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--isa", choices=("avx2",), default=None,
                    help="run as on a CPU of this instruction set (restarts with torch, MKL, oneDNN and the native "
                         "kernels restricted to it)")
    ap.add_argument("--tables", default="shapes,linears,prefill,decode",
                    help="comma-separated tables to run: shapes, linears, prefill, decode (default all)")
    args = ap.parse_args()
    if args.threads < 1 or args.repeats < 1:
        raise SystemExit(f"--threads and --repeats must be >= 1, got {args.threads} and {args.repeats}")
    tables = args.tables.split(",")
    unknown = set(tables) - {"shapes", "linears", "prefill", "decode"}
    if unknown:
        raise SystemExit(f"--tables: unknown {sorted(unknown)}; choose from shapes, linears, prefill, decode")
    if args.isa:
        restart_restricted(args.isa)
    torch.set_num_threads(args.threads)
    print(cpu_header(args.threads, args.repeats), "\n", flush=True)
    for dtype in (torch.float32, torch.bfloat16):
        if "shapes" in tables:
            print(linears_by_shape(dtype, args.repeats), "\n", flush=True)
        if "linears" in tables:
            print(linears(dtype, args.repeats), "\n", flush=True)
    if "prefill" in tables:
        print(prefill_attention(max(args.repeats, 20)), "\n", flush=True)
    if "decode" in tables:
        print(decode_attention(max(args.repeats, 200)))


if __name__ == "__main__":
    main()
