"""Every hook is documented and tested (datasette-style guards), and the hooks the plugin manager
itself drives behave as their specs say. The event hooks are called by the engine; their behaviour
tests live with the engine's tests, and the guard below makes sure they exist."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from corekv import hookspecs
from corekv.plugin import (
    BackendSpec, ConfigSectionSpec, Option, TierSpec, hook_signatures, hookimpl, make_plugin_manager,
)

ROOT = Path(__file__).resolve().parents[1]
HOOKS = hook_signatures()
#: what a registration hook may return a list of
SPEC_TYPES = {"BackendSpec", "TierSpec", "ConfigSectionSpec", "EvictionPolicySpec", "AdmissionPolicySpec"}


def documented_headings() -> list[str]:
    text = (ROOT / "docs" / "plugins.md").read_text()
    return re.findall(r"^### (corekv_\w+\(.*)$", text, flags=re.M)


def test_hookspecs_are_found():
    assert {"corekv_register_backends", "corekv_register_tiers", "corekv_resolve_model",
            "corekv_on_blocks_stored"} <= set(HOOKS)


@pytest.mark.parametrize("name", HOOKS)
def test_every_hook_has_a_heading_with_its_exact_signature(name):
    assert HOOKS[name] in documented_headings(), (
        f"docs/plugins.md needs the heading '### {HOOKS[name]}'")


def test_every_documented_hook_exists_with_that_signature():
    stale = [h for h in documented_headings() if h not in HOOKS.values()]
    assert not stale, f"docs/plugins.md documents hooks that do not exist (or changed): {stale}"


@pytest.mark.parametrize("name", HOOKS)
def test_every_hook_is_tested_outside_this_file(name):
    test_files = [p for p in (ROOT / "tests").rglob("test_*.py") if p.name != "test_hooks.py"]
    users = [p.relative_to(ROOT) for p in test_files if name in p.read_text()]
    assert users, f"no test file other than tests/test_hooks.py mentions {name}; add a test for it"


@pytest.mark.parametrize("name", HOOKS)
def test_every_hook_follows_the_naming_and_documentation_rules(name):
    spec = getattr(hookspecs, name)
    doc = inspect.getdoc(spec) or ""
    assert name.startswith("corekv_")
    assert ".. versionadded::" in doc, f"{name}'s docstring needs '.. versionadded::'"
    firstresult = spec.corekv_spec["firstresult"]
    assert firstresult == ("firstresult" in doc), f"{name}: say in its docstring whether it is firstresult"
    if name.startswith("corekv_register_"):
        returned = re.search(r"-> list\[(\w+)\]$", HOOKS[name])
        assert returned and returned[1] in SPEC_TYPES, (
            f"{name} must return a list of one of corekv.specs' types {sorted(SPEC_TYPES)}")
    if name.startswith("corekv_on_"):
        assert HOOKS[name].endswith("-> None") and not firstresult


# -- the hooks the plugin manager calls ----------------------------------------------------------
class Registrar:
    @hookimpl
    def corekv_register_backends(self):
        return [BackendSpec("hooktest_backend", factory=dict, options={"k": Option("int", default=1)})]

    @hookimpl
    def corekv_register_tiers(self):
        return [TierSpec("hooktest_tier", factory=dict, description="d")]

    @hookimpl
    def corekv_register_config_sections(self):
        return [ConfigSectionSpec("hooktest_section", options={"on": Option("bool", default=False)})]

    @hookimpl
    def corekv_resolve_model(self, name):
        return "/models/hooktest" if name == "hooktest-alias" else None


def test_register_hooks_are_collected_from_every_plugin():
    manager = make_plugin_manager([Registrar()])
    assert manager.backends()["hooktest_backend"].options["k"].default == 1
    assert manager.tiers()["hooktest_tier"].plugin == "Registrar"
    assert manager.config_sections()["hooktest_section"].plugin == "Registrar"
    # the builtin plugins answered the same hooks
    assert {"radix", "hash_blocks"} <= set(manager.backends())
    assert "kv_events" in manager.config_sections()


def test_resolve_model_returns_the_first_answer_or_none():
    manager = make_plugin_manager([Registrar()])
    assert manager.resolve_model("hooktest-alias") == "/models/hooktest"
    assert manager.resolve_model("unknown-alias-for-hooktest") is None
