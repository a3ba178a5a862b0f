"""Benchmark plots: `corekv bench hit-rate --out` and `corekv.plots.plot_reload` write real PNGs."""
from __future__ import annotations

import json

import pytest

from corekv import bench, plots
from corekv.cli import main

pytest.importorskip("matplotlib")  # the `plots` extra (also in `test`)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Two rows shaped like benchmarks/reload_vs_recompute.py's --json output (seconds are made up:
# the test checks that a plot is drawn, never timings).
RELOAD_ROWS = [
    {"prefix_tokens": 512, "recompute_s": 2.0, "device_s": 0.5, "host_s": 0.6, "lmdb_s": 0.7,
     "lmdb_cold_s": 0.9, "redis_s": 0.8},
    {"prefix_tokens": 1024, "recompute_s": 4.0, "device_s": 0.6, "host_s": 0.7, "lmdb_s": 0.8,
     "lmdb_cold_s": 1.1, "redis_s": 1.0},
]


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5000  # axes, bars and text: not an empty canvas


def test_hit_rate_out_writes_json_markdown_and_png(tmp_path, capsys):
    out = tmp_path / "results"
    assert main(["bench", "hit-rate", "--workloads", "multi_turn,parallel", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["hit_rate.json", "hit_rate.md", "hit_rate.png"]
    rows = json.loads((out / "hit_rate.json").read_text())
    workloads = bench.seed_workloads()
    expected = bench.hit_rate_table({k: workloads[k] for k in ("multi_turn", "parallel")})
    assert rows == expected
    assert bench.format_table(expected) in (out / "hit_rate.md").read_text()
    assert_png(out / "hit_rate.png")
    assert "hit_rate.png" in capsys.readouterr().err


def test_without_matplotlib_json_and_markdown_are_still_written(tmp_path, capsys, monkeypatch):
    """matplotlib is installed here, so its absence is simulated through have_matplotlib()."""
    monkeypatch.setattr(plots, "have_matplotlib", lambda: False)
    assert main(["bench", "hit-rate", "--workloads", "few_shot", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hit_rate.json", "hit_rate.md"]
    assert "pip install 'corekv[plots]'" in capsys.readouterr().err


def test_plot_reload_from_rows_and_from_a_file(tmp_path):
    assert_png(plots.plot_reload(RELOAD_ROWS, tmp_path / "a.png"))
    results = tmp_path / "rvr.json"
    results.write_text(json.dumps(RELOAD_ROWS))
    assert_png(plots.plot_reload(str(results), tmp_path / "b.png"))


def test_plot_reload_cli_merges_files(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(RELOAD_ROWS[:1]))
    second.write_text(json.dumps(RELOAD_ROWS[1:]))
    assert plots.merge_reload_rows(first, second) == RELOAD_ROWS
    assert main(["bench", "plot-reload", "--json", str(first), "--json", str(second),
                 "--out", str(tmp_path / "img")]) == 0
    assert_png(tmp_path / "img" / "reload_ttft.png")


def test_bad_inputs_name_the_argument(tmp_path, capsys):
    with pytest.raises(ValueError, match="prefix_tokens"):
        plots.plot_reload([{"recompute_s": 1.0}], tmp_path / "x.png")
    with pytest.raises(ValueError, match="out_png"):
        plots.plot_reload(RELOAD_ROWS, tmp_path / "x.jpg")
    with pytest.raises(ValueError, match="no '<path>_s' timings"):
        plots.plot_reload([{"prefix_tokens": 8}], tmp_path / "x.png")
    with pytest.raises(ValueError, match="rows"):
        plots.plot_hit_rate([], tmp_path / "x.png")
    code = main(["bench", "plot-reload", "--json", str(tmp_path / "missing.json"), "--out", str(tmp_path)])
    assert code == 2 and "--json" in capsys.readouterr().err
