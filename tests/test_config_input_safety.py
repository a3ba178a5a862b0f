"""Config input an attacker or an unlucky operator can write (issue 37): YAML alias bombs and
deep nesting are refused before anything expands them, a file that is not a config is never
quoted back, and values the reader cannot judge alone (a pool larger than memory) fail at engine
start with one line naming the field, before anything is allocated."""
from __future__ import annotations


import pytest

from corekv.cli import main
from corekv.config import load_config
from corekv.engine.llm_engine import Engine
from corekv.engine.tiny_model import make_tiny_llama
from corekv.errors import ConfigError


def alias_bomb(levels: int = 9, width: int = 10) -> str:
    """``levels`` anchors, each a list of ``width`` aliases of the one before: width**levels
    values once expanded, in a few hundred bytes."""
    lines = ["l0: &l0 [" + ", ".join(["x"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


BAD_YAML = {
    "alias bomb": (alias_bomb(), "aliases (*name) expand to more than 10000 values"),
    "recursive alias": ("engine: &e {x: *e}\n", "aliases (*name) expand to more than"),
    "1000-deep nesting": ("engine: " + "[" * 1000 + "]" * 1000 + "\n", "nested more than 32 levels"),
    "1000-deep mappings": ("engine: " + "{a: " * 1000 + "1" + "}" * 1000 + "\n",
                           "nested more than 32 levels"),
}


# NOTE: the refusal's message shows the limit caught it before expansion; the timeout only keeps
# a regression (the old loader expanded the bomb for minutes) from hanging the suite.
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(BAD_YAML))
def test_hostile_yaml_is_refused_at_once_in_one_line(tmp_path, capsys, name):
    text, says = BAD_YAML[name]
    path = tmp_path / "cache.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    assert says in str(caught.value)
    assert main(["config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "Traceback" not in err


def test_a_hostile_environment_override_is_refused_too():
    with pytest.raises(ConfigError, match="nested more than 32 levels"):
        load_config({}, env={"COREKV_ENGINE__BLOCK_SIZE": "[" * 100 + "]" * 100})


def test_aliases_within_the_limit_still_work():
    text = "cache: &c {backend: radix}\n"
    path_free = load_config({"cache": {"backend": "radix"}}, env={})
    from corekv.config.sources import parse_yaml

    assert parse_yaml(text + "x: [*c, *c]\n", "t")["x"] == [{"backend": "radix"}] * 2
    assert path_free.cache.backend == "radix"


@pytest.mark.parametrize("content", [
    "root:$6$s3cretSalt$hashhashhash:19000:0:99999:7:::\n",  # /etc/shadow's shape: one string
    "- s3cretSalt\n- another\n",  # a list
    "12345678s3cretSalt\n",
])
def test_a_file_that_is_not_a_config_is_never_quoted(tmp_path, capsys, content):
    secret = tmp_path / "shadow"
    secret.write_text(content)
    with pytest.raises(ConfigError) as caught:
        load_config(None, env={"COREKV_CONFIG": str(secret)})
    assert "s3cretSalt" not in str(caught.value)
    assert "COREKV_CONFIG" in str(caught.value)
    assert "is not a corekv config" in str(caught.value) or "does not hold a YAML mapping" in str(caught.value)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama()


@pytest.mark.parametrize("engine, field", [
    ({"num_blocks": 10**12}, "engine.num_blocks"),
    ({"kv_cache_memory": "1000TiB"}, "engine.kv_cache_memory"),
    ({"num_blocks": 2**40, "block_size": 2**10}, "engine.num_blocks"),
])
def test_a_pool_larger_than_memory_fails_at_start_naming_the_field(tiny, engine, field):
    cfg = load_config({"model": "tiny", "engine": engine}, env={})
    with pytest.raises(ConfigError) as caught:
        Engine(cfg, model=tiny)
    message = str(caught.value)
    assert message.startswith(f"{field}: a KV pool of ") and f"lower {field}" in message
    assert "\n" not in message
