"""Run examples/warm_and_pin.py and examples/multi_tenant.py as a user would, and check what they print.

Each runs in a subprocess (``sys.executable``) at small settings: a tiny random Llama saved as a
Hugging Face folder stands in for SmolLM2 (``--model``), and the LMDB store of the example config is
redirected into ``tmp_path``. The tiny model's answers are noise; what is checked is where the
prompts' KV came from.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ROW = re.compile(r"^(cold|warmed|restart)\s+(\d+)\s+(\d+)\s+(\d+)\s+(.+?)\s+([\d.]+)$")
TENANT_ROW = re.compile(r"^(A|B|no salt)\s+(\S+)\s+(\d)\s+(\d+)\s+(\d+)\s+(.+)$")


def run_example(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    # NOTE: COREKV_* variables of the calling shell would override the example config's fields
    env = {k: v for k, v in os.environ.items() if not k.startswith("COREKV_")}
    env["PYTHONIOENCODING"] = "utf-8"  # the tiny model's answers are arbitrary bytes
    env.setdefault("OMP_NUM_THREADS", "1")  # NOTE: a tiny model gains nothing from more threads
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, encoding="utf-8", errors="replace",
                          timeout=300)


def config_with_store(tmp_path: Path, name: str) -> Path:
    """``examples/configs/<name>.yaml`` with its lmdb tier's path moved into ``tmp_path``."""
    data = yaml.safe_load((EXAMPLES / "configs" / f"{name}.yaml").read_text())
    stores = [t for t in data["cache"]["tiers"] if t["type"] == "lmdb"]
    assert stores, f"{name}.yaml has no lmdb tier"
    for tier in stores:
        tier["path"] = str(tmp_path / "kvstore")
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_warm_and_pin_reloads_the_pinned_prompts_from_lmdb_after_a_restart(tiny_model_folder, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = run_example("warm_and_pin.py", "--config", str(config_with_store(tmp_path, "tiered")),
                         "--prompts-file", str(EXAMPLES / "system_prompts.txt"), "--max-tokens", "2",
                         "--model", str(tiny_model_folder), cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    rows = [m.groups() for line in out.splitlines() if (m := ROW.match(line))]
    table = {(phase, int(i)): (int(tokens), int(cached), where)
             for phase, i, tokens, cached, where, _ in rows}
    # system_prompts.txt holds two blank-line separated prompts: three phases each
    assert sorted(table) == sorted((p, i) for p in ("cold", "warmed", "restart") for i in (1, 2)), out
    pinned = [int(n) for n in re.search(r"pinned tokens per prompt: \[(\d+), (\d+)\]", out).groups()]
    assert all(n > 0 for n in pinned), out
    for i in (1, 2):
        cold, warmed, restart = (table[p, i] for p in ("cold", "warmed", "restart"))
        assert "lmdb" not in cold[2], f"a fresh store cannot serve the cold request:\n{out}"
        assert warmed[1] >= pinned[i - 1] and warmed[2].startswith("device="), out
        by_tier = dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", restart[2]))
        # NOTE: after the restart only the tokens the new engine itself computed (a block shared
        # with an earlier prompt) may come from the device; the system prompt comes from disk.
        assert by_tier.get("lmdb", 0) > 0 and restart[1] >= pinned[i - 1], out
    reloaded = int(re.search(r"^restart: (\d+) prompt tokens reloaded from lmdb", out, re.M).group(1))
    lmdb_rows = sum(int(n) for phase, _, _, _, where, _ in rows if phase == "restart"
                    for n in re.findall(r"lmdb=(\d+)", where))
    assert reloaded == lmdb_rows > 0, out
    assert (tmp_path / "kvstore" / "data.mdb").exists() and not (cwd / "kvstore").exists()


def test_multi_tenant_salts_isolate_tenants_and_share_within_one(tiny_model_folder, tmp_path):
    result = run_example("multi_tenant.py", "--max-tokens", "2", "--model", str(tiny_model_folder),
                         cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    rows = {(m[1], int(m[3])): int(m[5]) for line in out.splitlines() if (m := TENANT_ROW.match(line))}
    assert len(rows) == 5, out
    system_blocks = int(re.search(r"\((\d+) in full blocks\)", out).group(1))
    assert system_blocks > 0
    assert rows["B", 1] == 0 and rows["no salt", 1] == 0, out  # no cross-salt hits
    assert rows["A", 2] >= system_blocks and rows["B", 2] >= system_blocks, out  # same-tenant hits
    assert "FAIL" not in out and "6 of 6 checks passed" in out, out


def test_examples_reject_bad_arguments_naming_them(tmp_path):
    result = run_example("warm_and_pin.py", "--max-tokens", "0", cwd=tmp_path)
    assert result.returncode == 2 and "--max-tokens must be at least 1, got 0" in result.stderr
    missing = tmp_path / "nope.txt"
    result = run_example("warm_and_pin.py", "--prompts-file", str(missing), cwd=tmp_path)
    assert result.returncode != 0 and f"--prompts-file {str(missing)!r} is not a file" in result.stderr


def test_prompts_file_holds_one_prompt_per_line_or_per_paragraph(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("warm_and_pin", EXAMPLES / "warm_and_pin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    per_line = tmp_path / "lines.txt"
    per_line.write_text("# two prompts\nYou are terse.\nYou are verbose.\n")
    assert module.read_system_prompts(per_line) == ["You are terse.", "You are verbose."]
    per_paragraph = tmp_path / "paragraphs.txt"
    per_paragraph.write_text("You are terse.\nAnswer in one line.\n\n\nYou are verbose.\n")
    assert module.read_system_prompts(per_paragraph) == ["You are terse. Answer in one line.",
                                                          "You are verbose."]
    assert len(module.read_system_prompts(EXAMPLES / "system_prompts.txt")) == 2
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing here\n\n")
    with pytest.raises(SystemExit, match="holds no system prompt"):
        module.read_system_prompts(empty)
