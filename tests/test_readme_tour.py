"""The README's tour runs as written and shows the cache working: its YAML and its Python, copied
out of README.md, run in a fresh process and folder."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def tour_snippets() -> tuple[str, str]:
    """(the tour's cache.yaml, the tour's Python), as README.md shows them."""
    readme = (ROOT / "README.md").read_text()
    tour = readme.split("\n## A five-minute tour\n", 1)[1].split("\n## ", 1)[0]
    yaml_text = re.search(r"```yaml\n# cache\.yaml\n(.*?)```", tour, re.S)
    code = re.search(r"```python\n(.*?)```", tour, re.S)
    assert yaml_text and code, "README.md's tour lost its cache.yaml or its Python snippet"
    return yaml_text[1], code[1]


def test_the_tour_pins_a_system_prompt_of_at_least_one_block():
    """A pinned prompt shorter than one block keeps nothing, and the tour would show no hit."""
    import yaml

    from corekv.config import load_config

    yaml_text, _ = tour_snippets()
    cfg = load_config(yaml.safe_load(yaml_text))
    assert cfg.cache.pinned and len(cfg.cache.pinned[0].text.split()) > cfg.engine.block_size


@pytest.mark.slow
def test_the_tour_runs_as_written_and_both_questions_find_the_pinned_system_prompt(tmp_path):
    yaml_text, code = tour_snippets()
    (tmp_path / "cache.yaml").write_text(yaml_text)
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    answers = re.findall(r"^(\d+) of (\d+) prompt tokens cached \{(.*?)\}, first token after [\d.]+ s: ",
                         run.stdout, re.M)
    assert len(answers) == 2, run.stdout
    for cached, prompt, by_tier in answers:
        assert 0 < int(cached) < int(prompt), run.stdout
        assert "'device': " in by_tier
    pinned = re.search(r"^(\d+) tokens of a shared document pinned$", run.stdout, re.M)
    assert pinned and int(pinned[1]) > 0, run.stdout
    assert re.search(r"^hit rate \d+%: \d+ prompt tokens reused, \d+ computed$", run.stdout, re.M), run.stdout
    assert (tmp_path / "kvstore").is_dir()  # the tour's LMDB tier, where it said
