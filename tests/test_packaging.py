"""pyproject.toml installs every package of the source tree: an editable install (what the tests
run on) finds a package the list forgets, a wheel does not, so the list is checked here."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: source folder -> the package it installs as
FOLDERS = {"corekv": "corekv", "plugins": "corekv.plugins", "tiers": "corekv.tiers", "engine": "corekv.engine"}


def test_every_source_package_is_installed_from_its_folder():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {}
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            if folder == "corekv" and parts and parts[0] in FOLDERS:
                continue
            found[".".join([package, *parts])] = init.parent.relative_to(ROOT).as_posix()
    assert sorted(setuptools["packages"]) == sorted(found)
    assert {name: setuptools["package-dir"][name] for name in found} == found
