"""What importing corekv costs: reading a config or listing plugins loads no torch, no
transformers and no server stack (each check runs in a fresh interpreter)."""
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "fastapi", "starlette", "httpx", "zmq")


@pytest.mark.parametrize("code", [
    "import corekv; corekv.load_config({})",
    "import corekv; corekv.load_config({'cache': {'tiers': [{'type': 'host', 'size': '1MiB'}, "
    "{'type': 'lmdb', 'path': 'kv', 'size': '1GiB'}]}})",
    "import corekv; corekv.available_plugins()",
    "from corekv.config import config_reference; from corekv.plugin import make_plugin_manager; "
    "config_reference(make_plugin_manager())",
])
def test_reading_a_config_or_listing_plugins_imports_nothing_heavy(code):
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [], f"{code!r} imported {result.stdout.split()}"
