"""corekv's modules import one way: no cycles anywhere in corekv/, plugins/, tiers/, engine/
(imports inside functions count too: a cycle broken by a late import still means two modules
share one concept). The graph is read from the source, so the check imports nothing."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: source folder -> the package it installs as (pyproject.toml's package-dir)
PACKAGES = {"corekv": "corekv", "plugins": "corekv.plugins", "tiers": "corekv.tiers",
            "engine": "corekv.engine"}


def module_files() -> dict[str, Path]:
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            if name.startswith("corekv.") and folder == "corekv" and parts and parts[0] in ("plugins", "tiers", "engine"):
                continue  # not installed from here
            modules[name] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The corekv modules ``name`` imports (``from a import b`` counts ``a.b`` when it is a module)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles():
    modules = module_files()
    graph = {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


#: the builtin plugin packages: found through the plugin manager like third-party ones, never imported
BUILTIN_PLUGIN_PACKAGES = ("corekv.plugins", "corekv.tiers")


def is_builtin_plugin(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in BUILTIN_PLUGIN_PACKAGES)


def named_in_import_calls(path: Path) -> set[str]:
    """Modules named by literal ``importlib.import_module("...")`` / ``__import__("...")`` calls."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return found


def builtin_plugin_imports(modules: dict[str, Path]) -> dict[str, list[str]]:
    """``{core module: the builtin plugin modules it imports}`` for every module of the core
    (corekv/ and engine/, not the plugin packages themselves)."""
    known = set(modules)
    found = {}
    for name, path in modules.items():
        if is_builtin_plugin(name):
            continue
        imported = imported_modules(name, path, known) | named_in_import_calls(path)
        bad = sorted(m for m in imported if is_builtin_plugin(m))
        if bad:
            found[name] = bad
    return found


def test_the_checker_finds_a_core_module_importing_a_builtin(tmp_path):
    late = tmp_path / "late.py"
    late.write_text("def f():\n    from corekv.plugins import prometheus\n"
                    "    return importlib.import_module('corekv.tiers.host')\n")
    top = tmp_path / "top.py"
    top.write_text("from corekv.plugin import hookimpl\nimport corekv.tiers.lmdb as lmdb\n")
    plain = tmp_path / "plain.py"
    plain.write_text("import pluggy\n")
    modules = {"corekv.late": late, "corekv.top": top, "corekv.plugin": plain,
               "corekv.plugins.prometheus": late, "corekv.tiers.host": late, "corekv.tiers.lmdb": late}
    assert builtin_plugin_imports(modules) == {
        "corekv.late": ["corekv.plugins.prometheus", "corekv.tiers.host"],
        "corekv.top": ["corekv.tiers.lmdb"]}


def test_the_core_imports_no_builtin_plugin():
    """Builtin backends, tiers, metrics and KV events reach the core through hooks (the plugin
    manager), exactly as a third-party plugin's would; importing one names it instead."""
    modules = module_files()
    assert any(is_builtin_plugin(m) for m in modules) and "corekv.server.app" in modules
    found = builtin_plugin_imports(modules)
    assert not found, "the core imports builtin plugins (ask a hook instead): " + "; ".join(
        f"{name} imports {', '.join(bad)}" for name, bad in sorted(found.items()))
