"""Configuration: frozen dataclasses, one per area, loaded from YAML or a mapping.

The dataclass shapes are the contract the engine, backends and tiers read. Every field carries its
help text and constraints in its metadata; :func:`load_config` validates against them (and against
the option schemas that backend and tier plugins declare), :func:`dump_config` writes a config back
as plain data, and :func:`config_reference` renders them as the documentation table.

Precedence, lowest first: the defaults below, the YAML file (or mapping), then
``COREKV_<SECTION>__<KEY>`` environment variables (``COREKV_ENGINE__BLOCK_SIZE=32``,
``COREKV_MODEL=...``).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from corekv.config_values import Check, format_size

CONFIG_ENV = "COREKV_CONFIG"
ENV_PREFIX = "COREKV_"


def _field(default: Any = MISSING, help: str = "", *, factory: Any = MISSING, **check: Any) -> Any:
    """A dataclass field whose metadata holds its help text and its :class:`Check` arguments."""
    return field(default=default, default_factory=factory, metadata={"help": help, "check": check})


@dataclass(frozen=True)
class EngineConfig:
    """The engine's pool and scheduler. Exactly one of ``kv_cache_memory`` / ``num_blocks`` is
    set after loading: ``num_blocks`` wins when given (and ``kv_cache_memory`` becomes ``None``)."""

    block_size: int = _field(16, "tokens per KV block, the unit of caching and offload",
                             power_of_two=True, minimum=1)
    kv_cache_memory: int | None = _field(256 * 1024**2, "device memory for the KV pool; ignored "
                                         "when num_blocks is set", kind="size", minimum=1)
    num_blocks: int | None = _field(None, "size of the KV pool in blocks; wins over "
                                    "kv_cache_memory when both are given", minimum=1)
    max_num_seqs: int = _field(32, "most sequences in one batch", minimum=1)
    max_num_batched_tokens: int = _field(1024, "most tokens computed in one step", minimum=1)
    scheduling: str = _field("lpm", "waiting-queue order: longest prefix match first, or "
                             "first come first served", choices=("lpm", "fcfs"))
    preemption: str = _field("recompute", "what happens to a preempted sequence's KV",
                             choices=("recompute", "swap"))
    enable_prefix_caching: bool = _field(True, "reuse cached prefixes across requests")
    enable_chunked_prefill: bool = _field(True, "split long prompts across steps so decodes keep "
                                          "running; off: a prompt is prefilled in one step")
    compile: bool = _field(False, "compile the model's forward with torch.compile (inductor; "
                           "corekv's paged attention stays one opaque op) when the engine starts, and on "
                           "CPU build corekv's native kernels (paged decode and prefill attention, the "
                           "linears of decode-sized steps; g++ and ninja, once per machine): faster steps "
                           "for a start-up cost of a minute or two; bfloat16's greedy tokens are not "
                           "bit-identical to eager bfloat16's")
    tune_cpu_malloc: bool = _field(True, "on a CPU device with glibc: keep freed activation "
                                   "buffers in the heap (mallopt) instead of page-faulting them in "
                                   "again every layer; off: leave the process's malloc as it is")


@dataclass(frozen=True)
class PinnedPrefix:
    """One ``cache.pinned`` entry: exactly one of ``text`` / ``token_ids``; optional salt."""

    text: str | None = _field(None, "the prefix as text (tokenized by the model's tokenizer)")
    token_ids: tuple[int, ...] | None = _field(None, "the prefix as token ids", minimum=0)
    salt: str | None = _field(None, "the cache_salt (tenant) the prefix is pinned for")
    chat: bool = _field(False, "apply the model's chat template (as a system message) to text")


@dataclass(frozen=True)
class TierConfig:
    """One ``cache.tiers`` entry. ``options`` holds the tier's own fields, validated against the
    options schema its plugin declares (sizes already converted to bytes, defaults filled in)."""

    type: str = _field(help="the tier plugin's name (see `corekv plugins`)")
    name: str = _field(help="a unique name for this tier in stats and events; defaults to type")
    options: Mapping[str, Any] = _field(help="every other key: the options the tier type declares",
                                        factory=dict)
    required: bool = _field(False, "an engine refuses to start when this tier cannot (false: it "
                            "starts without the tier, logs why once and counts it in stats)")


@dataclass(frozen=True)
class IntegrityConfig:
    """``cache.integrity``: a secret that turns every tier entry's checksum into a keyed MAC."""

    key_env: str | None = _field(None, "the environment variable that holds the secret (16-64 "
                                 "bytes; an even number of hex digits is decoded); set, every "
                                 "entry carries a keyed BLAKE2b MAC over its key, header and KV, "
                                 "and an entry without a valid one is a miss: turn it on for "
                                 "tiers others can write to (redis, fsspec, shared disks)",
                                 pattern=r"[A-Za-z_][A-Za-z0-9_]*",
                                 pattern_text="an environment variable name such as COREKV_TIER_KEY")

    def secret(self, env: Mapping[str, str] | None = None) -> bytes | None:
        """The secret named by ``key_env`` (``None`` when unset); raises :class:`ConfigError`
        when the variable is missing or the secret is too short or too long."""
        from corekv.block_format import check_secret
        from corekv.errors import ConfigError

        if self.key_env is None:
            return None
        value = (os.environ if env is None else env).get(self.key_env, "")
        if not value:
            raise ConfigError(f"cache.integrity.key_env: the environment variable {self.key_env} "
                              "is not set or empty; export it with the tier secret (e.g. "
                              f"`export {self.key_env}=$(openssl rand -hex 32)`) in every process "
                              "that shares the tiers", path="cache.integrity.key_env")
        try:
            secret = bytes.fromhex(value) if len(value) % 2 == 0 else value.encode()
        except ValueError:
            secret = value.encode()
        try:
            return check_secret(secret)
        except ValueError as e:
            raise ConfigError(f"cache.integrity.key_env: ${self.key_env}: {e}",
                              path="cache.integrity.key_env") from e


@dataclass(frozen=True)
class CacheConfig:
    """The prefix cache: which backend indexes the device pool, and the tiers below it."""

    backend: str = _field("radix", "the prefix-cache backend plugin (see `corekv plugins`)")
    backend_options: Mapping[str, Any] = _field(help="the options the backend declares",
                                                factory=dict)
    hash: str = _field("xxh3_128", "block hash function", choices=("xxh3_128", "sha256"))
    write_policy: str = _field("write_back", "offload a block when its device slot is reused "
                               "(write_back) or as soon as it is full (write_through)",
                               choices=("write_back", "write_through"))
    max_pinned_fraction: float = _field(0.2, "most of the pool that pinned prefixes may hold",
                                        minimum=0.0, maximum=1.0)
    offload_min_hits: int = _field(0, "offload only blocks hit at least this often on the device "
                                   "(keeps never-reused blocks off SSDs); 0 offloads every block",
                                   minimum=0)
    offload_queue_blocks: int = _field(256, "most blocks waiting for the background tier writer; "
                                       "past it offloads are skipped and counted", minimum=1)
    prefetch_blocks: int | None = _field(None, "most blocks read ahead from the tiers into host "
                                         "staging when requests arrive (unset: the device pool's "
                                         "size; 0 turns prefetch off)", minimum=0)
    pinned: tuple[PinnedPrefix, ...] = _field((), "prefixes warmed and pinned when an engine starts")
    tiers: tuple[TierConfig, ...] = _field((), "storage tiers below the device pool, searched in order")
    integrity: IntegrityConfig = _field(help="keyed integrity of tier entries",
                                        factory=IntegrityConfig)


_ZMQ_ADDRESS = dict(pattern=r"(tcp|ipc|inproc)://\S+",
                    pattern_text="a ZMQ address such as tcp://*:5557, ipc:///tmp/kv-events or "
                                 "inproc://kv-events")


@dataclass(frozen=True)
class KVEventsConfig:
    """The ``kv_events`` plugin: the device cache's block events published as vLLM-compatible KV
    events (msgpack batches on a ZMQ PUB socket, with an optional replay socket)."""

    enabled: bool = _field(False, "publish KV events (needs pyzmq and msgpack: corekv[events])")
    endpoint: str = _field("tcp://127.0.0.1:5557", "the PUB socket: bound when the host is *, :: "
                           "or a loopback address (or ipc://, inproc://), else connected to; the "
                           "default listens on loopback, for subscribers on this machine only "
                           "(tcp://*:5557 listens on every interface: firewall it)", **_ZMQ_ADDRESS)
    replay_endpoint: str | None = _field(None, "a ROUTER socket (always bound) that resends "
                                         "buffered batches from a sequence number; none: no replay",
                                         **_ZMQ_ADDRESS)
    topic: str = _field("", "the topic frame of every message, which subscribers filter on "
                        "(\"\": the empty topic)", allow_empty=True)
    buffer_steps: int = _field(10000, "batches kept for replay", minimum=1)
    hwm: int = _field(100000, "most batches waiting to be sent (the publisher queue and the PUB "
                      "socket's high-water mark); past it batches are dropped and counted", minimum=1)
    include_token_ids: bool = _field(True, "send each stored block's token ids (false: empty lists, "
                                     "so subscribers cannot read prompts, and a router cannot "
                                     "match prompts to the blocks: corekv route then routes on the "
                                     "prompts it sent)")

    def __post_init__(self) -> None:
        # NOTE: port 0 asks for a free port, so two sockets may both say tcp://127.0.0.1:0.
        if self.replay_endpoint == self.endpoint and not self.endpoint.endswith(":0"):
            from corekv.errors import ConfigError

            raise ConfigError(f"kv_events.replay_endpoint: got {self.replay_endpoint!r}, the same "
                              "address as kv_events.endpoint; expected another port or path, e.g. "
                              "tcp://127.0.0.1:5558", path="kv_events.replay_endpoint")


@dataclass(frozen=True)
class Config:
    """The whole configuration (the YAML file's top level)."""

    model: str = _field("smollm2-135m-instruct", "a model alias, a Hugging Face model folder, "
                        "or a .gguf file")
    dtype: str = _field("float32", "weights and KV dtype", choices=("float32", "bfloat16", "float16"))
    device: str = _field("auto", "cuda when available, else cpu", pattern=r"auto|cpu|cuda(:\d+)?",
                         pattern_text="auto, cpu, cuda or cuda:N (e.g. cuda:0)",
                         suggestions=("auto", "cpu", "cuda"))
    engine: EngineConfig = _field(help="the engine", factory=EngineConfig)
    cache: CacheConfig = _field(help="the prefix cache and its tiers", factory=CacheConfig)
    kv_events: KVEventsConfig = _field(help="KV event publishing (the kv_events plugin)",
                                       factory=KVEventsConfig)
    plugins: tuple[str, ...] = _field((), "modules to load as plugins besides the installed "
                                      "entry points (e.g. my_package.my_plugin)")


def load_config(
    source: str | os.PathLike | Mapping | None = None,
    *,
    env: Mapping[str, str] | None = None,
    plugin_manager: Any = None,
) -> Config:
    """Load and validate a configuration.

    :param source: a YAML file path, or the same data as a mapping; ``None`` reads the file named
        by ``COREKV_CONFIG``, or uses the defaults when it is unset.
    :param env: environment for ``COREKV_CONFIG`` and ``COREKV_<SECTION>__<KEY>`` overrides
        (values parsed as YAML scalars); default ``os.environ``. Pass ``{}`` to ignore it.
    :param plugin_manager: checks backend and tier names and options against its plugins;
        default: ``make_plugin_manager(config's plugins)``.
    :raises ConfigError: naming the field path, the value received, what was expected.
    """
    from corekv.config_reader import ConfigReader, apply_env_overrides, read_yaml_file

    if env is None:
        env = os.environ
    elif not isinstance(env, Mapping):
        raise TypeError(f"load_config(env=...) got {env!r}; expected a mapping such as os.environ")
    origin = ""
    if source is None and env.get(CONFIG_ENV):
        source, origin = env[CONFIG_ENV], f" (named by {CONFIG_ENV})"
    if source is None:
        raw: Any = {}
    elif isinstance(source, (str, os.PathLike)):
        raw = read_yaml_file(Path(source), origin)
        origin = f"in {os.fspath(source)}"
    elif isinstance(source, Mapping):
        raw, origin = source, ""
    else:
        raise TypeError(f"load_config(source=...) got {source!r}; expected a YAML file path, a "
                        "mapping, or None (COREKV_CONFIG or the defaults)")
    reader = ConfigReader(plugin_manager, origin=origin)
    raw = reader.plain(raw)
    apply_env_overrides(raw, env, reader)
    return reader.read_config(raw)


def dump_config(cfg: Config, *, plugin_manager: Any = None) -> dict[str, Any]:
    """``cfg`` as plain YAML-ready data that :func:`load_config` turns back into an equal config.

    Sizes are written with units where exact (``256MiB``). Tier and backend options of kind
    ``size`` are too when ``plugin_manager`` is given (they are plain byte counts otherwise).
    """
    if not isinstance(cfg, Config):
        raise TypeError(f"dump_config(cfg=...) got {cfg!r}; expected a corekv.Config from load_config")
    backends = plugin_manager.backends() if plugin_manager is not None else {}
    tiers = plugin_manager.tiers() if plugin_manager is not None else {}

    def options(values: Mapping[str, Any], spec: Any) -> dict[str, Any]:
        kinds = {n: o.kind for n, o in spec.options.items()} if spec is not None else {}
        return {k: format_size(v) if kinds.get(k) == "size" and isinstance(v, int) else _plain(v)
                for k, v in values.items()}

    def dump(obj: Any) -> Any:
        if isinstance(obj, TierConfig):
            entry = {"type": obj.type} | ({} if obj.name == obj.type else {"name": obj.name})
            return entry | ({"required": True} if obj.required else {}) | options(obj.options, tiers.get(obj.type))
        if isinstance(obj, PinnedPrefix):
            return {k: v for k, v in _dump_fields(obj, dump).items() if v is not None}
        if isinstance(obj, CacheConfig):
            data = _dump_fields(obj, dump)
            data["backend_options"] = options(obj.backend_options, backends.get(obj.backend))
            return data
        if is_dataclass(obj):
            return _dump_fields(obj, dump)
        return _plain(obj)

    return dump(cfg)


def _dump_fields(obj: Any, dump: Any) -> dict[str, Any]:
    data = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.metadata["check"].get("kind") == "size" and isinstance(value, int):
            data[f.name] = format_size(value)
        elif isinstance(value, tuple) and f.name != "token_ids":
            data[f.name] = [dump(v) for v in value]
        else:
            data[f.name] = dump(value)
    return data


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def config_reference(plugin_manager: Any = None) -> str:
    """The configuration reference as a markdown table generated from the dataclasses (and, given a
    plugin manager, one table per registered backend and tier with its declared options)."""
    rows = ["| Field | Accepts | Default | Description |", "|---|---|---|---|"]
    names = {}
    if plugin_manager is not None:
        names = {(CacheConfig, "backend"): sorted(plugin_manager.backends()),
                 (TierConfig, "type"): sorted(plugin_manager.tiers())}
    _reference_rows(Config, "", rows, names)
    text = "\n".join(rows) + "\n"
    if plugin_manager is not None:
        for what, specs in (("Backend", plugin_manager.backends()), ("Tier", plugin_manager.tiers())):
            for name, spec in sorted(specs.items()):
                text += f"\n### {what} `{name}`\n\n" + (f"{spec.description}\n\n" if spec.description else "")
                if not spec.options:
                    text += "No options.\n"
                    continue
                text += "| Option | Accepts | Default | Description |\n|---|---|---|---|\n"
                for opt_name, opt in spec.options.items():
                    check = Check(opt.kind, choices=tuple(opt.choices), minimum=opt.minimum)
                    default = "required" if opt.is_required else _default_text(opt.default, opt.kind)
                    text += _row(f"`{opt_name}`", check.expected(), default, opt.help) + "\n"
    return text


def _reference_rows(cls: type, prefix: str, rows: list[str], plugin_names: dict) -> None:
    from corekv.config_reader import field_check, field_types

    for f in fields(cls):
        path, (item_type, is_list, _) = prefix + f.name, field_types(cls)[f.name]
        if is_dataclass(item_type):
            if not is_list:
                _reference_rows(item_type, path + ".", rows, plugin_names)
                continue
            rows.append(_row(f"`{path}`", "a list of mappings", "[]", f.metadata["help"]))
            _reference_rows(item_type, path + "[].", rows, plugin_names)
            continue
        if f.name == "options":
            path, accepts, default = prefix + "<option>", "declared by the tier type", "see below"
        elif f.name == "backend_options":
            path, accepts, default = path + ".<option>", "declared by the backend", "see below"
        else:
            check = field_check(cls, f)
            accepts = ("a list; each item " if is_list else "") + check.expected()
            default = _default_text(f.default, check.kind) if f.default is not MISSING else "required"
        if (cls, f.name) in plugin_names:
            accepts = "a registered name: " + (", ".join(plugin_names[cls, f.name]) or "(none)")
        if f.name == "name" and cls is TierConfig:
            default = "the type"
        rows.append(_row(f"`{path}`", accepts, default, f.metadata["help"]))


def _default_text(value: Any, kind: str) -> str:
    if value is None:
        return "none"
    if kind == "size" and isinstance(value, int):
        return str(format_size(value))
    if isinstance(value, bool):
        return str(value).lower()
    return "[]" if value == () else str(value)


def _row(*cells: str) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
