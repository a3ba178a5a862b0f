"""Where a config comes from: a YAML file (or a mapping), then ``COREKV_*`` environment variables,
read in that order into one plain mapping that :class:`~corekv.config.reader.ConfigReader` checks.

Precedence, lowest first: the defaults, the YAML file (or mapping), then
``COREKV_<SECTION>__<KEY>`` environment variables (``COREKV_ENGINE__BLOCK_SIZE=32``,
``COREKV_MODEL=...``, ``COREKV_KV_EVENTS__ENABLED=true`` for a plugin's section).
"""
from __future__ import annotations

import os
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from corekv.config.reader import ConfigReader
from corekv.config.schema import CORE_KEYS, Config
from corekv.config.values import describe_value, did_you_mean
from corekv.errors import ConfigError

CONFIG_ENV = "COREKV_CONFIG"
_SECTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ENV_PREFIX = "COREKV_"


def load_config(
    source: str | os.PathLike | Mapping | None = None,
    *,
    env: Mapping[str, str] | None = None,
    plugin_manager: Any = None,
) -> Config:
    """Load and validate a configuration (see :func:`read_config` for the arguments)."""
    return read_config(source, env=env, plugin_manager=plugin_manager)[0]


def read_config(
    source: str | os.PathLike | Mapping | None = None,
    *,
    env: Mapping[str, str] | None = None,
    plugin_manager: Any = None,
    extra_plugins: tuple = (),
) -> tuple[Config, Any]:
    """Load and validate a configuration; returns it and the plugin manager it was checked
    against, so an engine built from it uses that one manager.

    :param source: a YAML file path, or the same data as a mapping; ``None`` reads the file named
        by ``COREKV_CONFIG``, or uses the defaults when it is unset.
    :param env: environment for ``COREKV_CONFIG`` and ``COREKV_<SECTION>__<KEY>`` overrides
        (values parsed as YAML scalars); default ``os.environ``. Pass ``{}`` to ignore it.
    :param plugin_manager: checks backend and tier names and options, and the plugins' config
        sections, against its plugins; default: ``make_plugin_manager(config's plugins +
        extra_plugins)``.
    :raises ConfigError: naming the field path, the value received, what was expected.
    """
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
    reader = ConfigReader(plugin_manager, origin=origin, extra_plugins=extra_plugins)
    raw = reader.plain(raw)
    apply_env_overrides(raw, env, reader)
    config = reader.read_config(raw)
    return config, reader.plugin_manager


def apply_env_overrides(raw: Any, env: Mapping[str, str], reader: ConfigReader) -> None:
    """Set ``COREKV_<SECTION>__<KEY>[__<KEY>...]`` variables into ``raw`` (shallowest first).

    A one-part name counts only if it is a top-level key (``COREKV_MODEL``, ``COREKV_KV_EVENTS``),
    so unrelated variables like ``COREKV_CONFIG`` pass through; a name with ``__`` must name a
    real section. corekv's own sections go first: ``COREKV_PLUGINS`` can add the plugins whose
    sections the other variables then name.
    """
    overrides = []
    for var, text in env.items():
        if var.startswith(ENV_PREFIX):
            overrides.append((var, var[len(ENV_PREFIX):].lower().split("__"), text))
    is_own = [o[1][0] in CORE_KEYS and all(o[1]) for o in overrides]
    _apply(raw, [o for o, own in zip(overrides, is_own) if own], list(CORE_KEYS), reader)
    others = [o for o, own in zip(overrides, is_own) if not own]
    if not others:
        return
    top = reader.top_level_keys(raw)  # NOTE: builds the plugin manager, from the final plugins:
    _apply(raw, [o for o in others if len(o[1]) > 1 or o[1][0] in top], top, reader)


def _apply(raw: Any, overrides: list, top: list[str], reader: ConfigReader) -> None:
    for var, parts, text in sorted(overrides, key=lambda o: (len(o[1]), o[0])):
        if parts[0] not in top or not all(parts):
            hint = did_you_mean(parts[0], top)
            raise ConfigError(f"{var}: unknown config section {parts[0]!r}{hint}"
                              f"{' E' if hint else '; e'}xpected COREKV_<SECTION>__<KEY> with a section among "
                              f"{', '.join(top)} (e.g. COREKV_ENGINE__BLOCK_SIZE=32)", path=parts[0])
        node, path = raw, ""
        for i, part in enumerate(parts):
            if isinstance(node, list) and part.isdigit():
                if int(part) >= len(node):
                    raise ConfigError(f"{var}: {path} has {len(node)} entries, so there is no entry "
                                      f"{part}; expected an index below {len(node)}", path=path)
                key, child_path = int(part), f"{path}[{part}]"
            elif isinstance(node, dict):
                key, child_path = part, _join(path, part)
            else:
                raise ConfigError(f"{var}: cannot set {part!r} inside {path}, which holds "
                                  f"{describe_value(node)}; expected a mapping there", path=path)
            if i == len(parts) - 1:
                node[key] = parse_yaml(text, var, is_env=True)
            else:
                if isinstance(node, dict) and node.get(key) is None:
                    if parts[i + 1].isdigit():
                        raise ConfigError(
                            f"{var}: {child_path} is not set, so it has no entry {parts[i + 1]}; "
                            f"expected the whole list instead, e.g. {ENV_PREFIX}"
                            f"{'__'.join(parts[:i + 1]).upper()}='[...]'", path=child_path)
                    node[key] = {}
                node = node[key]
            path = child_path
        reader.env_sources[path] = var


#: nesting a config may have; the deepest real one (a tier's option lists) needs 5
MAX_YAML_DEPTH = 32
#: nodes a document may hold once its aliases are expanded (every config in examples/ has < 200)
MAX_YAML_NODES = 10_000


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects a key given twice in one mapping (YAML would keep the
    last silently, which hides typos such as two ``tiers:`` sections), nesting deeper than
    :data:`MAX_YAML_DEPTH`, and documents whose aliases expand past :data:`MAX_YAML_NODES` nodes.

    NOTE: both limits are checked on the composed node graph, before anything is constructed or
    walked: an alias bomb (9 levels of 10 aliases each is 10**9 nodes in 200 bytes) is shared
    nodes until something expands it, and the composer recurses once per level (1,000 levels
    exhaust Python's stack with a 3,000-line traceback).
    """

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested more than {MAX_YAML_DEPTH} levels deep; no corekv setting "
                    "needs that, write a flatter file", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self):
        node = super().compose_document()
        if _expanded_size(node) > MAX_YAML_NODES:
            raise yaml.composer.ComposerError(
                None, None, f"its aliases (*name) expand to more than {MAX_YAML_NODES} values; "
                "no corekv config is that large, write the values out or use fewer aliases",
                node.start_mark)
        return node

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {seen[key] + 1})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _expanded_size(root: yaml.Node) -> int:
    """How many nodes ``root`` holds with every alias expanded (counted once per node: an alias
    shares its anchor's node), stopping early past :data:`MAX_YAML_NODES`."""
    sizes: dict[int, int] = {}
    open_ids: set[int] = set()  # nodes whose children are still being sized
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = (node.value if isinstance(node, yaml.SequenceNode)
                    else [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                    else [])
        if not children_done:
            if id(node) in open_ids:
                return MAX_YAML_NODES + 1  # NOTE: an anchor inside its own value: unbounded
            open_ids.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)
            continue
        open_ids.discard(id(node))
        sizes[id(node)] = min(1 + sum(sizes[id(child)] for child in children), MAX_YAML_NODES + 1)
    return sizes[id(root)]


def parse_yaml(text: str, where: str, *, is_env: bool = False) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        if is_env:
            raise ConfigError(f"{where}: got {text!r}, which is not valid YAML ({problem}); expected "
                              "a YAML value such as 32, radix, 2GiB or [a, b]") from e
        raise ConfigError(f"{where}: invalid YAML{at}: {problem}") from e


def read_yaml_file(path: Path, via: str = "") -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r}{via} not found; expected a YAML file: check "
                          "the path (relative paths start at the current directory)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r}{via} cannot be read ({e}); expected a "
                          "readable UTF-8 YAML file") from e
    data = parse_yaml(text, str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        # NOTE: the type only, never the value: a path from COREKV_CONFIG may name any file this
        # process can read (/etc/shadow parses as one string), and errors reach logs and terminals
        raise ConfigError(f"config file {str(path)!r}{via} does not hold a YAML mapping (it parses as "
                          f"a {type(data).__name__}); expected a corekv config such as "
                          "'engine: {block_size: 16}' (see `corekv config --reference`)")
    if not all(isinstance(key, str) and _SECTION_NAME.fullmatch(key) for key in data):
        # NOTE: not quoted, for the same reason: "root:$6$...:::" lines parse as mapping keys
        raise ConfigError(f"config file {str(path)!r}{via} is not a corekv config: a top-level key "
                          "is not a section name (letters, digits and _, e.g. engine, cache); "
                          "check that the path names your config")
    return data


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
