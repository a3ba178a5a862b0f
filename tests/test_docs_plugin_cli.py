"""docs/plugins.md's first plugin works from the shell as the guide says: ``kv_memo.py`` in the
current folder, its YAML in ``cache.yaml``, ``PYTHONPATH=.`` in front of the ``corekv`` command."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COREKV = Path(sys.executable).with_name("corekv")


def guide_block(language: str, containing: str) -> str:
    text = (ROOT / "docs" / "plugins.md").read_text()
    blocks = [b for b in re.findall(rf"```{language}\n(.*?)```", text, flags=re.S) if containing in b]
    assert len(blocks) == 1, f"docs/plugins.md has {len(blocks)} {language} blocks with {containing!r}"
    return blocks[0]


def corekv(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COREKV_CONFIG")}
    return subprocess.run([str(COREKV), *args], cwd=cwd, env={**environ, **env}, capture_output=True, text=True,
                          timeout=300)


def test_the_first_plugin_runs_from_the_cli_with_pythonpath_as_the_guide_says(tmp_path):
    (tmp_path / "kv_memo.py").write_text(guide_block("python", "class MemoTier(Tier)"))
    (tmp_path / "cache.yaml").write_text(guide_block("yaml", "plugins: [kv_memo]"))
    shown = corekv(["config", "--config", "cache.yaml"], tmp_path, PYTHONPATH=".")
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"type: memo\b", shown.stdout) and "max_entries: 4096" in shown.stdout
    listed = corekv(["plugins", "--config", "cache.yaml"], tmp_path, PYTHONPATH=".")
    assert listed.returncode == 0 and re.search(r"^\s*memo\b", listed.stdout, re.M), listed.stdout + listed.stderr
    # without PYTHONPATH the guide's warning comes true, in one line that names the fix
    missing = corekv(["config", "--config", "cache.yaml"], tmp_path)
    assert missing.returncode != 0 and "kv_memo" in missing.stderr and "Traceback" not in missing.stderr
