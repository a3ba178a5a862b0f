"""PNG plots of the benchmark results (needs the optional extra: ``pip install 'corekv[plots]'``).

``plot_hit_rate`` draws the index-only hit-rate table (``corekv.bench.hit_rate_table`` rows) as
grouped bars, one group per workload, with the seed chapter's published values marked.
``plot_reload`` draws the time to first token of every path (recompute, device, host, lmdb warm and
cold, redis) against the prefix length, from the JSON rows ``benchmarks/reload_vs_recompute.py``
writes. matplotlib is imported lazily with the Agg backend, so importing this module (and the CLI)
works without it; ``have_matplotlib()`` tells callers whether the plots can be drawn.
"""
from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PLOTS_HINT = "pip install 'corekv[plots]'"
HIT_RATE_COLUMNS = ("radix", "blocks 16", "blocks 64")
#: The seed chapter's published hit rates (percent): plotted as markers next to our own bars.
PUBLISHED_HIT_RATES = {
    "shared_system": (89.5, 88.8, 86.0),
    "multi_turn": (79.2, 78.6, 76.8),
    "few_shot": (89.6, 87.8, 81.1),
    "parallel": (87.1, 84.2, 73.3),
}
#: (JSON key prefix, legend label) of each reload path, in drawing order
RELOAD_PATHS = (("recompute", "recompute"), ("device", "device hit"), ("host", "host tier"),
                ("lmdb", "lmdb (warm)"), ("lmdb_cold", "lmdb (cold)"), ("redis", "redis"))


def have_matplotlib() -> bool:
    """True when matplotlib can be imported (the ``plots`` extra is installed)."""
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    if not have_matplotlib():
        raise ImportError(f"plots need matplotlib: {PLOTS_HINT}")
    import matplotlib
    # NOTE: Agg renders to files only; the CLI may run on a machine without a display.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _check_out(out_png: str | os.PathLike) -> Path:
    if not isinstance(out_png, (str, os.PathLike)) or not str(out_png).endswith(".png"):
        raise ValueError(f"out_png must be a path ending in .png, got {out_png!r}; "
                         "pass e.g. 'results/plot.png'")
    path = Path(out_png)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def plot_hit_rate(rows: Sequence[Mapping[str, Any]], out_png: str | os.PathLike) -> Path:
    """Grouped bars of hit rate per workload for radix, blocks 16 and blocks 64; black ticks mark
    the seed chapter's published values where the workload has them. Returns the PNG path.

    :param rows: ``corekv.bench.hit_rate_table()`` rows (fractions in [0, 1]).
    """
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence) or not rows:
        raise ValueError(f"rows must be a non-empty list of hit_rate_table() rows, got {rows!r:.60}")
    for i, row in enumerate(rows):
        missing = [k for k in ("workload", *HIT_RATE_COLUMNS) if not isinstance(row, Mapping) or k not in row]
        if missing:
            raise ValueError(f"rows[{i}] lacks {missing}; expected the keys of a hit_rate_table() row")
    path = _check_out(out_png)
    plt = _pyplot()
    width = 0.8 / len(HIT_RATE_COLUMNS)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for j, column in enumerate(HIT_RATE_COLUMNS):
        xs = [i + (j - 1) * width for i in range(len(rows))]
        ax.bar(xs, [100 * float(r[column]) for r in rows], width, label=column)
        published = [(x, PUBLISHED_HIT_RATES[r["workload"]][j]) for x, r in zip(xs, rows)
                     if r["workload"] in PUBLISHED_HIT_RATES]
        if published:
            ax.scatter([x for x, _ in published], [v for _, v in published], marker="_", s=300,
                       color="black", zorder=3, label="seed (published)" if j == 0 else None)
    ax.set_xticks(range(len(rows)), [f"{r['workload']}\n{r['eviction']}" if "eviction" in r
                                     else str(r["workload"]) for r in rows])
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Prefix hit rate per workload (index-only simulation)")
    ax.legend(loc="lower left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_reload_rows(source: str | os.PathLike | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rows of one reload_vs_recompute JSON file (a path) or an already loaded list, sorted by
    ``prefix_tokens``; use ``merge_reload_rows`` to combine several files."""
    if isinstance(source, (str, os.PathLike)):
        try:
            source = json.loads(Path(source).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"results_json {str(source)!r} is not a readable JSON file ({exc}); "
                             "pass the --json output of benchmarks/reload_vs_recompute.py") from exc
    if isinstance(source, Mapping):
        source = [source]
    if not isinstance(source, Sequence) or isinstance(source, (str, bytes)) or not all(
            isinstance(r, Mapping) and isinstance(r.get("prefix_tokens"), int) for r in source):
        raise ValueError(f"results must be a list of rows with an int 'prefix_tokens', got {source!r:.80}; "
                         "pass the --json output of benchmarks/reload_vs_recompute.py")
    return sorted((dict(r) for r in source), key=lambda r: r["prefix_tokens"])


def merge_reload_rows(*sources) -> list[dict[str, Any]]:
    """Rows of several result files, one per prefix length (a later source wins on a tie)."""
    merged: dict[int, dict[str, Any]] = {}
    for source in sources:
        for row in load_reload_rows(source):
            merged[row["prefix_tokens"]] = row
    return [merged[k] for k in sorted(merged)]


def plot_reload(results_json_path_or_dict, out_png: str | os.PathLike) -> Path:
    """TTFT (seconds, log scale) against prefix length, one line per path present in the rows
    (``<path>_s`` keys, e.g. ``recompute_s``, ``lmdb_cold_s``). Returns the PNG path.

    :param results_json_path_or_dict: a JSON file path, a list of rows, or one row (dict).
    """
    rows = load_reload_rows(results_json_path_or_dict)
    path = _check_out(out_png)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    drawn = 0
    for key, label in RELOAD_PATHS:
        points = [(r["prefix_tokens"], float(r[f"{key}_s"])) for r in rows
                  if isinstance(r.get(f"{key}_s"), (int, float)) and r[f"{key}_s"] > 0]
        if points:
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label,
                    linestyle="--" if key == "recompute" else "-")
            drawn += 1
    if not drawn:
        plt.close(fig)
        raise ValueError("results hold no '<path>_s' timings (expected e.g. 'recompute_s'); pass the "
                         "--json output of benchmarks/reload_vs_recompute.py")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("Reload a cached prefix vs recompute it")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
