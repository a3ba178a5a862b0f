"""corekv.load_config: the messages users see, sizes, env overrides, plugin option schemas, dumping.

Most tests register a small test plugin (``ToyPlugin``: backends ``toy_radix``/``toy_blocks``,
tiers ``toy_host``/``toy_disk``) so they do not depend on how the builtin plugins evolve; the
``*_builtin_*`` tests at the end use the real names.
"""
from __future__ import annotations

import dataclasses

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

import corekv
from corekv.config import (
    CacheConfig, Config, EngineConfig, IntegrityConfig, PinnedPrefix, SpeculativeConfig, TierConfig, config_reference,
    dump_config, load_config,
)
from corekv.config.values import format_size, parse_size
from corekv.plugin import BackendSpec, Option, TierSpec, hookimpl, make_plugin_manager


class ToyPlugin:
    @hookimpl
    def corekv_register_backends(self):
        return [
            BackendSpec("toy_radix", factory=dict, description="toy radix", options={
                "page_size": Option("int", default=1, minimum=1, help="tokens per page"),
                "policy": Option("str", default="lru", choices=("lru", "fifo")),
            }),
            BackendSpec("toy_blocks", factory=dict),
        ]

    @hookimpl
    def corekv_register_tiers(self):
        return [
            TierSpec("toy_host", factory=dict, options={
                "size": Option("size", default="1GiB", minimum=1, help="bytes of host memory")}),
            TierSpec("toy_disk", factory=dict, description="toy disk", options={
                "path": Option("str", help="directory of the store"),
                "size": Option("size", default=20 * 1024**3, minimum=1),
                "sync": Option("bool", default=True),
                "fill": Option("float", default=0.9, minimum=0),
                "url": Option("str", default=None),
            }),
        ]


@pytest.fixture(scope="module")
def pm():
    return make_plugin_manager(plugins=[ToyPlugin()])


TOY = {"backend": "toy_radix"}


def load(data, pm, **env):
    return load_config(data, env=env, plugin_manager=pm)


def error_of(data, pm, **env) -> corekv.ConfigError:
    with pytest.raises(corekv.ConfigError) as info:
        load(data, pm, **env)
    return info.value


# -- messages --------------------------------------------------------------------------------------
MESSAGES = [
    ({"engine": {"block_size": 24}},
     "engine.block_size: got 24; expected a power of two (1, 2, 4, 8, 16, ...)"),
    ({"engine": {"block_size": True}},
     "engine.block_size: got True; expected a power of two (1, 2, 4, 8, 16, ...)"),
    ({"engine": {"blok_size": 16}},
     "engine.blok_size: unknown key (value 16); did you mean 'block_size'? Valid keys: block_size, "
     "kv_cache_memory, num_blocks, max_num_seqs, max_num_batched_tokens, scheduling, preemption, "
     "prefill_first, enable_prefix_caching, enable_chunked_prefill, compile, cpu_kernels, threads, "
     "tune_cpu_malloc, speculative"),
    ({"modle": "x"},
     "modle: unknown key (value 'x'); did you mean 'model'? Valid keys: model, dtype, device, "
     "engine, cache, kv_events, plugins"),
    ({"engine": {"max_num_seqs": 0}}, "engine.max_num_seqs: got 0; expected an integer >= 1"),
    ({"engine": {"scheduling": "LPM"}},
     "engine.scheduling: got 'LPM'; expected one of lpm, fcfs, dfs-weight, lof; did you mean 'lpm'?"),
    ({"engine": {"scheduling": "dfs_weight"}},
     "engine.scheduling: got 'dfs_weight'; expected one of lpm, fcfs, dfs-weight, lof; did you mean 'dfs-weight'?"),
    ({"engine": {"preemption": "swapp"}},
     "engine.preemption: got 'swapp'; expected one of recompute, swap; did you mean 'swap'?"),
    ({"engine": {"kv_cache_memory": None}},
     "engine.kv_cache_memory: got None and num_blocks is not set; expected a pool size such as "
     "256MiB, or num_blocks: N"),
    ({"engine": {"kv_cache_memory": "lots"}},
     "engine.kv_cache_memory: got 'lots'; expected a non-zero size such as 512MiB, 20GiB, 1.5GB or "
     "a whole number of bytes"),
    ({"dtype": "fp16"}, "dtype: got 'fp16'; expected one of float32, bfloat16, float16"),
    ({"device": "cuda:x"},
     "device: got 'cuda:x'; expected auto, cpu, cuda or cuda:N (e.g. cuda:0); did you mean 'cuda'?"),
    ({"model": 123}, "model: got 123; expected a non-empty string; quote it in YAML to make it a string"),
    ({"cache": {**TOY, "hash": "sha-256"}},
     "cache.hash: got 'sha-256'; expected one of xxh3_128, sha256; did you mean 'sha256'?"),
    ({"cache": {**TOY, "write_policy": "write-back"}},
     "cache.write_policy: got 'write-back'; expected one of write_back, write_through; "
     "did you mean 'write_back'?"),
    ({"cache": {**TOY, "max_pinned_fraction": 1.5}},
     "cache.max_pinned_fraction: got 1.5; expected a number between 0 and 1"),
    ({"cache": {**TOY, "backend_options": {"page_sise": 4}}},
     "cache.backend_options.page_sise: unknown key for backend 'toy_radix' (value 4); did you mean "
     "'page_size'? Valid keys: page_size, policy"),
    ({"cache": {**TOY, "backend_options": {"policy": "lfu"}}},
     "cache.backend_options.policy: got 'lfu'; expected one of lru, fifo; did you mean 'lru'?"),
    ({"cache": {**TOY, "backend_options": {"page_size": 0}}},
     "cache.backend_options.page_size: got 0; expected an integer >= 1"),
    ({"cache": {**TOY, "tiers": [{"type": "toy_host", "sise": "2GiB"}]}},
     "cache.tiers[0].sise: unknown key for tier 'toy_host' (value '2GiB'); did you mean 'size'? "
     "Valid keys: type, name, required, size"),
    ({"cache": {**TOY, "tiers": [{"type": "toy_host"}, {"type": "toy_disk", "path": "kv", "size": "20 gigs"}]}},
     "cache.tiers[1].size: got '20 gigs'; expected a non-zero size such as 512MiB, 20GiB, 1.5GB or "
     "a whole number of bytes"),
    ({"cache": {**TOY, "tiers": [{"type": "toy_disk"}]}},
     "cache.tiers[0].path: missing; expected a non-empty string (directory of the store), required "
     "for tier 'toy_disk'"),
    ({"cache": {**TOY, "tiers": [{"type": "toy_disk", "path": "kv", "sync": "yes please"}]}},
     "cache.tiers[0].sync: got 'yes please'; expected true or false"),
    ({"cache": {**TOY, "tiers": [{"type": "toy_host"}, {"type": "toy_host"}]}},
     "cache.tiers[1].name: got 'toy_host', the name of cache.tiers[0] too; expected a unique name: "
     "set name: on one of them"),
    ({"cache": {**TOY, "tiers": ["toy_host"]}},
     "cache.tiers[0]: got 'toy_host'; expected a mapping such as {type: host, size: 2GiB}"),
    ({"cache": {**TOY, "tiers": {"type": "toy_host"}}},
     "cache.tiers: got {'type': 'toy_host'}; expected a list"),
    ({"cache": {**TOY, "pinned": [{"text": "hi", "token_ids": [1, 2]}]}},
     "cache.pinned[0]: got both text and token_ids; expected exactly one of them, e.g. "
     "{text: 'You are a helpful assistant.'}"),
    ({"cache": {**TOY, "pinned": [{"salt": "a"}]}},
     "cache.pinned[0]: got neither text nor token_ids; expected exactly one of them, e.g. "
     "{text: 'You are a helpful assistant.'}"),
    ({"cache": {**TOY, "pinned": [{"token_ids": [3, -5]}]}},
     "cache.pinned[0].token_ids[1]: got -5; expected an integer >= 0"),
    ({"cache": {**TOY, "pinned": [{"token_ids": [3], "chat": True}]}},
     "cache.pinned[0].chat: got true with token_ids; expected chat: true only with text (token ids "
     "are used as given)"),
    ({"engine": []}, "engine: got []; expected a mapping with keys block_size, kv_cache_memory, "
     "num_blocks, max_num_seqs, max_num_batched_tokens, scheduling, preemption, prefill_first, "
     "enable_prefix_caching, enable_chunked_prefill, compile, cpu_kernels, threads, tune_cpu_malloc, speculative"),
]


@pytest.mark.parametrize("data, message", MESSAGES, ids=[m.split(":")[0] for _, m in MESSAGES])
def test_error_messages_are_exact(pm, data, message):
    error = error_of(data, pm)
    assert str(error) == message
    assert error.path == message.split(":")[0]


def test_unknown_plugin_names_list_the_registered_ones_and_suggest(pm):
    backends = ", ".join(sorted(pm.backends()))
    assert str(error_of({"cache": {"backend": "toy_radx"}}, pm)) == (
        f"cache.backend: got 'toy_radx'; expected a registered backend ({backends}); "
        "did you mean 'toy_radix'?")
    tiers = ", ".join(sorted(pm.tiers()))
    assert str(error_of({"cache": {**TOY, "tiers": [{"type": "toy_hots"}]}}, pm)) == (
        f"cache.tiers[0].type: got 'toy_hots'; expected a registered tier type ({tiers}); "
        "did you mean 'toy_host'?")
    # nothing close: say how to get it
    assert str(error_of({"cache": {"backend": "zzzzzz"}}, pm)).endswith(
        "; install the plugin that provides it or list its module under plugins:")
    assert str(error_of({"cache": {**TOY, "tiers": [{"size": 1}]}}, pm)) == (
        f"cache.tiers[0].type: missing; expected a tier type: one of {tiers}")


def test_config_errors_are_value_errors_and_corekv_errors(pm):
    error = error_of({"dtype": "fp8"}, pm)
    assert isinstance(error, ValueError) and isinstance(error, corekv.CoreKVError)


def test_plugins_listed_in_the_config_must_be_importable():
    with pytest.raises(corekv.ConfigError) as info:
        load_config({"plugins": ["no_such_corekv_plugin_module"]}, env={})
    assert str(info.value) == (
        "plugins[0]: got 'no_such_corekv_plugin_module'; expected an importable module name; "
        "install the package that provides it or fix the name")


def test_wrong_argument_types_are_type_errors(pm):
    with pytest.raises(TypeError, match=r"load_config\(source=...\) got 42"):
        load_config(42, env={}, plugin_manager=pm)
    with pytest.raises(TypeError, match=r"load_config\(env=...\) got 'x'"):
        load_config({}, env="x", plugin_manager=pm)
    with pytest.raises(TypeError, match=r"dump_config\(cfg=...\) got \{\}"):
        dump_config({})


# -- values --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, num_bytes", [
    ("512MiB", 512 * 2**20), ("20GiB", 20 * 2**30), ("1.5GB", 1_500_000_000), ("1.5KiB", 1536),
    ("1kB", 1000), ("1kb", 1000), ("2 TiB", 2 * 2**40), ("4096", 4096), ("7B", 7), (4096, 4096),
    (2.0, 2), ("0.5MB", 500_000), (".5KiB", 512),
])
def test_sizes_accept_units(text, num_bytes):
    assert parse_size(text) == num_bytes


@pytest.mark.parametrize("text", ["-1", -1, "GB", "1.5.2GB", "10XB", "1e9", True, 1.5, float("inf"), None, [1]])
def test_sizes_reject_everything_else(text):
    assert parse_size(text) is None


@given(st.integers(min_value=0, max_value=2**60))
def test_formatted_sizes_parse_back_to_the_same_bytes(num_bytes):
    assert parse_size(format_size(num_bytes)) == num_bytes


def test_sizes_in_config_fields_and_tier_options_become_bytes(pm):
    cfg = load({"engine": {"kv_cache_memory": "1.5GB"},
                "cache": {**TOY, "tiers": [{"type": "toy_host", "size": "512MiB"}]}}, pm)
    assert cfg.engine.kv_cache_memory == 1_500_000_000
    assert cfg.cache.tiers[0].options == {"size": 512 * 2**20}


def test_num_blocks_wins_over_kv_cache_memory(pm):
    cfg = load({"engine": {"num_blocks": 100, "kv_cache_memory": "1GiB"}, "cache": TOY}, pm)
    assert (cfg.engine.num_blocks, cfg.engine.kv_cache_memory) == (100, None)
    cfg = load({"engine": {"kv_cache_memory": "1GiB"}, "cache": TOY}, pm)
    assert (cfg.engine.num_blocks, cfg.engine.kv_cache_memory) == (None, 2**30)


def test_defaults_fill_every_field_and_the_result_is_frozen(pm):
    cfg = load({"cache": TOY}, pm)
    assert dataclasses.replace(cfg, sections={}) == Config(
        cache=CacheConfig(backend="toy_radix", backend_options={"page_size": 1, "policy": "lru"}))
    # every plugin's section is there too (the builtin kv_events here), with its declared defaults
    assert cfg.sections == {name: {key: option.default for key, option in spec.options.items()}
                            for name, spec in pm.config_sections().items()}
    assert set(cfg.sections) == {"kv_events"}
    assert cfg.engine == EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kv_events.enabled = True


def test_an_absent_cache_section_is_read_like_an_empty_one(pm):
    """So the default backend is checked and its declared defaults filled in."""
    cfg = load({}, pm)
    assert cfg == load({"cache": {}}, pm)
    declared = pm.backends()["radix"].options
    assert declared and cfg.cache.backend_options == {name: o.default for name, o in declared.items()}


def test_empty_lists_may_be_left_blank(pm):
    cfg = load({"cache": {**TOY, "tiers": None, "pinned": None}, "plugins": None}, pm)
    assert (cfg.cache.tiers, cfg.cache.pinned, cfg.plugins) == ((), (), ())


def test_pinned_entries_and_their_defaults(pm):
    cfg = load({"cache": {**TOY, "pinned": [{"text": "You are helpful.", "salt": "tenant-a", "chat": True},
                                            {"token_ids": [1, 2, 3]}]}}, pm)
    assert cfg.cache.pinned == (
        PinnedPrefix(text="You are helpful.", salt="tenant-a", chat=True),
        PinnedPrefix(token_ids=(1, 2, 3)),
    )


# -- plugin option schemas -------------------------------------------------------------------------
def test_tier_options_are_validated_filled_and_named(pm):
    cfg = load({"cache": {**TOY, "tiers": [
        {"type": "toy_host"},
        {"type": "toy_disk", "name": "ssd", "path": "./kv", "fill": 1, "sync": False},
    ]}}, pm)
    host, disk = cfg.cache.tiers
    assert host == TierConfig(type="toy_host", name="toy_host", options={"size": 2**30})
    assert disk == TierConfig(type="toy_disk", name="ssd", options={
        "path": "./kv", "size": 20 * 2**30, "sync": False, "fill": 1.0, "url": None})
    assert isinstance(disk.options["fill"], float)


def test_an_option_whose_default_is_none_accepts_null(pm):
    cfg = load({"cache": {**TOY, "tiers": [{"type": "toy_disk", "path": "kv", "url": None}]}}, pm)
    assert cfg.cache.tiers[0].options["url"] is None
    error = error_of({"cache": {**TOY, "tiers": [{"type": "toy_disk", "path": None}]}}, pm)
    assert str(error).startswith("cache.tiers[0].path: got None; expected a non-empty string")


def test_backend_options_default_to_the_declared_defaults(pm):
    assert load({"cache": {"backend": "toy_blocks"}}, pm).cache.backend_options == {}
    cfg = load({"cache": {**TOY, "backend_options": {"policy": "fifo"}}}, pm)
    assert cfg.cache.backend_options == {"page_size": 1, "policy": "fifo"}


# -- files, COREKV_CONFIG, environment ----------------------------------------------------------
def write(tmp_path, text: str, name: str = "cache.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_file_loads_and_errors_name_the_file(tmp_path, pm):
    path = write(tmp_path, "cache:\n  backend: toy_radix\n  tiers:\n    - {type: toy_host, size: 2GiB}\n")
    assert load(path, pm).cache.tiers[0].options == {"size": 2 * 2**30}
    assert load(str(path), pm) == load(path, pm)
    bad = write(tmp_path, "engine:\n  block_size: 24\ncache: {backend: toy_radix}\n", "bad.yaml")
    assert str(error_of(bad, pm)) == (
        f"engine.block_size: got 24; expected a power of two (1, 2, 4, 8, 16, ...) (in {bad})")


def test_yaml_problems_are_config_errors(tmp_path, pm):
    dup = write(tmp_path, "cache:\n  backend: toy_radix\ncache:\n  backend: toy_blocks\n")
    assert str(error_of(dup, pm)) == (
        f"{dup}: invalid YAML at line 3, column 1: duplicate key 'cache' (first given on line 1)")
    broken = write(tmp_path, "engine: {block_size: 16\n", "broken.yaml")
    assert str(error_of(broken, pm)).startswith(f"{broken}: invalid YAML at line 2, column 1: ")
    top_list = write(tmp_path, "- 1\n- 2\n", "list.yaml")
    assert str(error_of(top_list, pm)) == (  # NOTE: the type only: a file's content is never quoted
        f"config file '{top_list}' does not hold a YAML mapping (it parses as a list); expected a "
        "corekv config such as 'engine: {block_size: 16}' (see `corekv config --reference`)")
    missing = tmp_path / "missing.yaml"
    assert str(error_of(missing, pm)) == (
        f"config file '{missing}' not found; expected a YAML file: check the path (relative paths "
        "start at the current directory)")


def test_an_empty_file_means_the_defaults(tmp_path, pm):
    assert load(write(tmp_path, "# nothing\n"), pm, COREKV_CACHE__BACKEND="toy_radix") == \
        load({"cache": TOY}, pm)


def test_corekv_config_names_the_file(tmp_path, pm, monkeypatch):
    path = write(tmp_path, "model: from-file\ncache: {backend: toy_blocks}\n")
    assert load(None, pm, COREKV_CONFIG=str(path)).model == "from-file"
    monkeypatch.setenv("COREKV_CONFIG", str(path))
    assert load_config(plugin_manager=pm).cache.backend == "toy_blocks"
    missing = str(tmp_path / "nope.yaml")
    assert str(error_of(None, pm, COREKV_CONFIG=missing)) == (
        f"config file '{missing}' (named by COREKV_CONFIG) not found; expected a YAML file: check "
        "the path (relative paths start at the current directory)")


def test_env_overrides_fields_with_yaml_scalar_rules(tmp_path, pm):
    path = write(tmp_path, "engine: {block_size: 16}\ncache: {backend: toy_radix}\n")
    cfg = load(path, pm, COREKV_ENGINE__BLOCK_SIZE="32", COREKV_CACHE__BACKEND="toy_blocks",
               COREKV_MODEL="my-model", COREKV_ENGINE__ENABLE_PREFIX_CACHING="false",
               COREKV_ENGINE__KV_CACHE_MEMORY="64MiB")
    assert cfg.engine.block_size == 32
    assert cfg.cache.backend == "toy_blocks"
    assert cfg.model == "my-model"
    assert cfg.engine.enable_prefix_caching is False
    assert cfg.engine.kv_cache_memory == 64 * 2**20
    # a quoted scalar stays a string; an unquoted number is a number
    assert load({"cache": TOY}, pm, COREKV_MODEL="'123'").model == "123"
    assert str(error_of({"cache": TOY}, pm, COREKV_MODEL="123")).endswith("(set by COREKV_MODEL)")


def test_env_overrides_read_os_environ_by_default(pm, monkeypatch):
    monkeypatch.setenv("COREKV_ENGINE__MAX_NUM_SEQS", "7")
    assert load_config({"cache": TOY}, plugin_manager=pm).engine.max_num_seqs == 7
    assert load_config({"cache": TOY}, env={}, plugin_manager=pm).engine.max_num_seqs == 32


def test_env_override_errors_name_the_variable(pm):
    assert str(error_of({"cache": TOY}, pm, COREKV_ENGINE__BLOCK_SIZE="33")) == (
        "engine.block_size: got 33; expected a power of two (1, 2, 4, 8, 16, ...) "
        "(set by COREKV_ENGINE__BLOCK_SIZE)")
    assert str(error_of({"cache": TOY}, pm, COREKV_ENGNE__BLOCK_SIZE="32")) == (
        "COREKV_ENGNE__BLOCK_SIZE: unknown config section 'engne'; did you mean 'engine'? Expected "
        "COREKV_<SECTION>__<KEY> with a section among model, dtype, device, engine, cache, kv_events, "
        "plugins "
        "(e.g. COREKV_ENGINE__BLOCK_SIZE=32)")
    assert str(error_of({"cache": TOY}, pm, COREKV_ENGINE__BLOK_SIZE="32")).startswith(
        "engine.blok_size: unknown key (value 32); did you mean 'block_size'?")
    assert str(error_of({"cache": TOY}, pm, COREKV_CACHE__BACKEND="[oops")) == (
        "COREKV_CACHE__BACKEND: got '[oops', which is not valid YAML (expected ',' or ']', but got "
        "'<stream end>'); expected a YAML value such as 32, radix, 2GiB or [a, b]")


def test_unrelated_corekv_variables_are_not_overrides(pm):
    cfg = load({"cache": TOY}, pm, COREKV_LOG_LEVEL="debug", COREKV_DISABLE_PLUGIN_AUTOLOAD="1",
               COREKV_REDIS_URL="redis://x")
    assert cfg == load({"cache": TOY}, pm)


def test_env_can_set_a_whole_list_or_a_field_of_one_entry(pm):
    cfg = load({"cache": TOY}, pm, COREKV_CACHE__TIERS="[{type: toy_host, size: 1GiB}]",
               COREKV_CACHE__TIERS__0__SIZE="3GiB")
    assert cfg.cache.tiers[0].options == {"size": 3 * 2**30}
    assert str(error_of({"cache": TOY}, pm, COREKV_CACHE__TIERS__1__SIZE="1GiB")) == (
        "COREKV_CACHE__TIERS__1__SIZE: cache.tiers is not set, so it has no entry 1; expected the "
        "whole list instead, e.g. COREKV_CACHE__TIERS='[...]'")
    data = {"cache": {**TOY, "tiers": [{"type": "toy_host"}]}}
    assert str(error_of(data, pm, COREKV_CACHE__TIERS__1__SIZE="1GiB")) == (
        "COREKV_CACHE__TIERS__1__SIZE: cache.tiers has 1 entries, so there is no entry 1; expected "
        "an index below 1")


def test_env_overrides_do_not_modify_the_callers_mapping(pm):
    data = {"engine": {"block_size": 16}, "cache": dict(TOY)}
    load(data, pm, COREKV_ENGINE__BLOCK_SIZE="64")
    assert data == {"engine": {"block_size": 16}, "cache": TOY}


# -- dump, reference -------------------------------------------------------------------------------
FULL = {
    "model": "some/model", "dtype": "bfloat16", "device": "cuda:1",
    "engine": {"block_size": 32, "num_blocks": 512, "scheduling": "fcfs"},
    "cache": {"backend": "toy_radix", "backend_options": {"page_size": 4}, "hash": "sha256",
              "write_policy": "write_through", "max_pinned_fraction": 0.5,
              "pinned": [{"text": "You are helpful.", "salt": "a"}, {"token_ids": [1, 2]}],
              "tiers": [{"type": "toy_host", "size": "2GiB"},
                        {"type": "toy_disk", "name": "ssd", "path": "/kv", "size": 1_500_000_000}]},
    "plugins": [],
}


@pytest.mark.parametrize("with_manager", [False, True])
def test_dump_round_trips_through_yaml_and_load(pm, with_manager):
    cfg = load(FULL, pm)
    data = dump_config(cfg, plugin_manager=pm if with_manager else None)
    assert load(yaml.safe_load(yaml.safe_dump(data)), pm) == cfg
    assert load(dump_config(load({"cache": TOY}, pm)), pm) == load({"cache": TOY}, pm)


def test_dump_writes_sizes_with_units_and_omits_redundant_names(pm):
    data = dump_config(load(FULL, pm), plugin_manager=pm)
    assert data["engine"]["kv_cache_memory"] is None and data["engine"]["num_blocks"] == 512
    assert data["cache"]["tiers"] == [
        {"type": "toy_host", "size": "2GiB"},
        {"type": "toy_disk", "name": "ssd", "path": "/kv", "size": "1500MB", "sync": True,
         "fill": 0.9, "url": None},
    ]
    assert data["cache"]["pinned"] == [{"text": "You are helpful.", "salt": "a", "chat": False, "priority": 0},
                                       {"token_ids": [1, 2], "chat": False, "priority": 0}]


def test_reference_has_a_row_per_field_with_help_and_defaults(pm):
    text = config_reference()
    assert text.startswith("| Field | Accepts | Default | Description |\n|---|---|---|---|\n")

    def paths(cls, prefix=""):
        sections = ("engine", "cache", "integrity", "speculative")
        nested = {"engine": EngineConfig, "cache": CacheConfig, "pinned": PinnedPrefix, "tiers": TierConfig,
                  "integrity": IntegrityConfig, "speculative": SpeculativeConfig}
        for f in dataclasses.fields(cls):
            if f.name == "sections":
                continue  # the plugins' sections: test_reference_has_a_row_per_option_of_every_plugin_section
            sub = nested.get(f.name)
            if f.name not in sections:
                yield prefix + f.name, f
            if sub is not None:
                yield from paths(sub, prefix + f.name + ("." if f.name in sections else "[]."))

    for path, f in paths(Config):
        if f.name == "options":
            path = path.replace("options", "<option>")
        elif f.name == "backend_options":
            path += ".<option>"
        row = next((line for line in text.splitlines() if line.startswith(f"| `{path}` |")), None)
        assert row is not None, f"no reference row for {path}"
        assert f.metadata["help"].replace("|", "\\|") in row
    assert "| `engine.kv_cache_memory` | a non-zero size such as 512MiB, 20GiB, 1.5GB or a whole " \
           "number of bytes | 256MiB |" in text
    assert "| `engine.scheduling` | one of lpm, fcfs, dfs-weight, lof | lpm |" in text


def test_reference_has_a_row_per_option_of_every_plugin_section(pm):
    text = config_reference(pm)
    lines = text.splitlines()
    for name, spec in pm.config_sections().items():
        for key, option in spec.options.items():
            row = next((line for line in lines if line.startswith(f"| `{name}.{key}` |")), None)
            assert row is not None, f"no reference row for {name}.{key}"
            assert option.help.replace("|", "\\|") in row

    def index(path):
        return next(i for i, line in enumerate(lines) if line.startswith(f"| `{path}"))

    # where the section sits in the file: after corekv's cache fields, before plugins
    assert index("cache.integrity.key_env") < index("kv_events.enabled") < index("plugins")
    assert "| `kv_events.enabled` | true or false | false |" in text
    assert "`kv_events." not in config_reference()  # without a manager, no plugin is known


def test_reference_lists_plugin_options_when_given_a_manager(pm):
    text = config_reference(pm)
    assert "### Tier `toy_disk`\n\ntoy disk\n\n| Option | Accepts | Default | Description |" in text
    assert "| `path` | a non-empty string | required | directory of the store |" in text
    assert "| `size` | a non-zero size such as 512MiB, 20GiB, 1.5GB or a whole number of bytes " \
           "| 1GiB | bytes of host memory |" in text
    assert "### Backend `toy_blocks`\n\nNo options.\n" in text


# -- the builtin plugins ---------------------------------------------------------------------------
def test_builtin_defaults_load_without_a_file():
    """``load_config()`` with nothing set gives the defaults, checked against corekv's own plugins
    (radix is the default backend)."""
    cfg = load_config(None, env={})
    assert cfg.cache.backend == "radix" and cfg.model == "smollm2-135m-instruct"
    assert cfg.engine == EngineConfig()


DESIGN_EXAMPLE = """
model: smollm2-135m-instruct
dtype: float32
device: auto
engine:
  block_size: 16
  kv_cache_memory: 256MiB
  max_num_seqs: 32
  max_num_batched_tokens: 1024
  scheduling: lpm
  preemption: recompute
cache:
  backend: radix
  hash: xxh3_128
  write_policy: write_back
  pinned:
    - {text: "You are a helpful assistant.", salt: tenant-a}
  tiers:
    - {type: host, size: 2GiB}
    - {type: lmdb, path: ./kvstore, size: 20GiB}
    - {type: redis, url: "redis://127.0.0.1:6379/0"}
    - {type: fsspec, url: "s3://bucket/prefix"}
"""


def test_the_design_example_config_loads_with_the_builtin_plugins(tmp_path):
    path = write(tmp_path, DESIGN_EXAMPLE)
    cfg = load_config(path, env={})
    assert [t.type for t in cfg.cache.tiers] == ["host", "lmdb", "redis", "fsspec"]
    assert cfg.cache.tiers[0].options["size"] == 2 * 2**30
    assert cfg.cache.tiers[1].options["size"] == 20 * 2**30
    assert cfg.cache.tiers[2].options["url"] == "redis://127.0.0.1:6379/0"
    assert cfg.cache.pinned == (PinnedPrefix(text="You are a helpful assistant.", salt="tenant-a"),)
    assert load_config(dump_config(cfg), env={}) == cfg


@pytest.mark.parametrize("backend", ["hash_blocks", "radix"])
def test_builtin_backends_are_accepted_with_their_options(backend):
    specs = make_plugin_manager().backends()
    cfg = load_config({"cache": {"backend": backend}}, env={})
    assert set(cfg.cache.backend_options) == set(specs[backend].options)


def test_builtin_tier_typo_suggests_the_real_name():
    with pytest.raises(corekv.ConfigError, match=r"^cache.tiers\[0\].type: got 'lmbd'; .*did you mean 'lmdb'\?$"):
        load_config({"cache": {"tiers": [{"type": "lmbd", "path": "kv"}]}}, env={})


# -- properties ------------------------------------------------------------------------------------
engine_fields = st.fixed_dictionaries({}, optional={
    "block_size": st.sampled_from([2**k for k in range(11)]),
    "kv_cache_memory": st.integers(1, 2**42).map(lambda n: format_size(n)),
    "num_blocks": st.none() | st.integers(1, 10**7),
    "max_num_seqs": st.integers(1, 4096),
    "scheduling": st.sampled_from(["lpm", "fcfs", "dfs-weight", "lof"]),
    "preemption": st.sampled_from(["recompute", "swap"]),
    "prefill_first": st.booleans(),
    "enable_prefix_caching": st.booleans(),
    "enable_chunked_prefill": st.booleans(),
    "compile": st.booleans(),
    "cpu_kernels": st.sampled_from(["auto", "native", "torch"]),
    "tune_cpu_malloc": st.booleans(),
})


@given(engine=engine_fields, fraction=st.floats(0, 1), device=st.sampled_from(["auto", "cpu", "cuda", "cuda:3"]))
def test_valid_configs_round_trip_through_dump(pm, engine, fraction, device):
    # NOTE: preemption: swap is valid only with a host tier (test_swap_preemption_needs_a_tier_that_supports_swap),
    # prefill_first only with swap (test_prefill_first_needs_swap_preemption)
    if engine.get("prefill_first"):
        engine["preemption"] = "swap"
    tiers = [{"type": "host", "size": "1MiB"}] if engine.get("preemption") == "swap" else []
    cfg = load({"engine": engine, "device": device,
                "cache": {**TOY, "max_pinned_fraction": fraction, "tiers": tiers}}, pm)
    assert (cfg.engine.num_blocks is None) != (cfg.engine.kv_cache_memory is None)
    assert load(yaml.safe_load(yaml.safe_dump(dump_config(cfg))), pm) == cfg


@given(st.integers().filter(lambda n: n < 1 or n & (n - 1)))
def test_every_block_size_that_is_not_a_power_of_two_is_rejected(pm, block_size):
    error = error_of({"engine": {"block_size": block_size}, "cache": TOY}, pm)
    assert error.path == "engine.block_size"
    assert str(error) == f"engine.block_size: got {block_size}; expected a power of two (1, 2, 4, 8, 16, ...)"


def test_reference_names_the_registered_backends_and_tier_types(pm):
    text = config_reference(pm)
    assert f"| `cache.backend` | a registered name: {', '.join(sorted(pm.backends()))} | radix |" in text
    assert f"| `cache.tiers[].type` | a registered name: {', '.join(sorted(pm.tiers()))} | required |" in text
    assert "| `cache.backend` | a non-empty string | radix |" in config_reference()


def test_swap_preemption_needs_a_tier_that_supports_swap(pm):
    """Checked here, once, so an engine never starts to find it out; the tier's class says
    whether it can hold swapped blocks (``supports_swap``), not its type's name."""
    without = {"engine": {"preemption": "swap"}, "cache": {**TOY, "tiers": [{"type": "toy_disk", "path": "kv"}]}}
    message = ("engine.preemption: 'swap' parks preempted sequences' KV in a tier that can hold swapped "
               "blocks (types: host, shm), but cache.tiers has none (types: ['toy_disk']); add "
               "`- {type: host, size: 1GiB}` to cache.tiers or use preemption: recompute")
    error = error_of(without, pm)
    assert (str(error), error.path) == (message, "engine.preemption")
    assert str(error_of({"cache": TOY}, pm, COREKV_ENGINE__PREEMPTION="swap")).endswith(
        "or use preemption: recompute (set by COREKV_ENGINE__PREEMPTION)")
    assert "cache.tiers has none (types: ['lmdb'])" in str(error_of(
        {"engine": {"preemption": "swap"}, "cache": {**TOY, "tiers": [{"type": "lmdb", "path": "kv"}]}}, pm))
    for tier in ({"type": "host", "size": "1MiB"}, {"type": "shm", "size": "1MiB"}):
        assert load({"engine": {"preemption": "swap"}, "cache": {**TOY, "tiers": [tier]}}, pm).engine.preemption == "swap"


class SwapTierPlugin:
    """A third-party memory tier that declares the capability on its class."""

    class ToySwapTier:
        supports_swap = True

    @hookimpl
    def corekv_register_tiers(self):
        return [TierSpec("toy_swap", factory=self.ToySwapTier)]


def test_a_third_party_tier_that_supports_swap_may_hold_swapped_blocks():
    pm = make_plugin_manager(plugins=[ToyPlugin(), SwapTierPlugin()])
    cfg = load({"engine": {"preemption": "swap"}, "cache": {**TOY, "tiers": [{"type": "toy_swap"}]}}, pm)
    assert cfg.engine.preemption == "swap"
    assert "(types: host, shm, toy_swap)" in str(error_of({"engine": {"preemption": "swap"}, "cache": TOY}, pm))


def test_prefill_first_needs_swap_preemption(pm):
    host = {**TOY, "tiers": [{"type": "host", "size": "1MiB"}]}
    error = error_of({"engine": {"prefill_first": True}, "cache": host}, pm)
    assert error.path == "engine.prefill_first"
    assert str(error) == ("engine.prefill_first: true preempts decodes for waiting prompts, which with "
                          "preemption: recompute computes their KV again; set engine.preemption: swap "
                          "(with a host tier in cache.tiers) or prefill_first: false")
    assert load({"engine": {"prefill_first": True, "preemption": "swap"}, "cache": host}, pm).engine.prefill_first


def test_offload_settings(pm):
    cfg = load({"cache": {**TOY, "offload_min_hits": 2, "offload_queue_blocks": 64}}, pm)
    assert (cfg.cache.offload_min_hits, cfg.cache.offload_queue_blocks) == (2, 64)
    assert str(error_of({"cache": {**TOY, "offload_queue_blocks": 0}}, pm)) == (
        "cache.offload_queue_blocks: got 0; expected an integer >= 1")
