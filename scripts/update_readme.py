"""Regenerate README.md's generated sections (the config reference and the error examples).

    python scripts/update_readme.py          # rewrite README.md in place
tests/test_readme.py fails when README.md differs from what this renders.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import tempfile
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"

#: (what the user wrote in cache.yaml, the command) -> the README shows what the CLI prints
ERROR_EXAMPLES = [
    ("cache: {backend: radx}\n", ["generate", "--prompt", "hi"]),
    ("cache:\n  tiers:\n    - {type: host, sise: 2GiB}\n", ["generate", "--prompt", "hi"]),
    ("cache:\n  tiers:\n    - {type: host, size: 2GiB}\n    - {type: lmdb, path: ./kvstore, size: 20 gigs}\n",
     ["generate", "--prompt", "hi"]),
]


def render_errors() -> str:
    from corekv.cli import main

    parts = []
    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            for text, argv in ERROR_EXAMPLES:
                Path("cache.yaml").write_text(text)
                err = io.StringIO()
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    code = main(["--config", "cache.yaml", *argv])
                parts.append(f"```yaml\n# cache.yaml\n{text}```\n```console\n$ corekv {' '.join(argv)} "
                             f"--config cache.yaml\n{err.getvalue().strip()}\n$ echo $?\n{code}\n```\n")
        finally:
            os.chdir(cwd)
    return "\n".join(parts)


def render_reference() -> str:
    from corekv.config import config_reference
    from corekv.plugin import make_plugin_manager

    return config_reference(make_plugin_manager()).strip() + "\n"


SECTIONS = {"config-errors": render_errors, "config-reference": render_reference}


def render(readme: str) -> str:
    for name, make in SECTIONS.items():
        pattern = re.compile(rf"(<!-- {name}:start -->\n).*?(<!-- {name}:end -->)", re.S)
        if not pattern.search(readme):
            raise SystemExit(f"README.md lacks the markers <!-- {name}:start --> / <!-- {name}:end -->")
        body = make()
        readme = pattern.sub(lambda m: m.group(1) + body + m.group(2), readme)
    return readme


if __name__ == "__main__":
    os.environ.setdefault("COREKV_DISABLE_PLUGIN_AUTOLOAD", "1")
    README.write_text(render(README.read_text()))
    print(f"updated {README}", file=sys.stderr)
