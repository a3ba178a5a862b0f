"""Where the native kernels are built: a folder keyed by what the build depends on, so two
environments (another torch, python, compiler or source revision) never share or fight over one."""
from __future__ import annotations

from corekv.engine.cpu import native


def test_the_build_folder_is_named_by_a_key_of_the_build_inputs(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    folder = native.build_directory()
    assert folder.parent == tmp_path and folder.name == f"corekv_native-{native.build_key()}"
    assert native.build_directory() == folder  # stable within and across processes (no random part)
    monkeypatch.setenv("CXX", "clang++")
    assert native.build_directory() != folder


def test_the_key_changes_with_the_sources(monkeypatch):
    key = native.build_key()
    monkeypatch.setattr(native, "_revision", lambda: "another revision")
    assert native.build_key() != key


def test_the_key_changes_with_where_the_sources_are(monkeypatch, tmp_path):
    """A copy of the checkout (a snapshot, a CI folder) started with the same venv compiles the same
    bytes from other paths: ninja would rebuild a shared folder at every switch."""
    key, revision = native.build_key(), native._revision()
    copies = []
    for path in (*native.SOURCES, *native.HEADERS):
        copy = tmp_path / path.name
        copy.write_bytes(path.read_bytes())
        copies.append(copy)
    monkeypatch.setattr(native, "SOURCES", copies[:len(native.SOURCES)])
    monkeypatch.setattr(native, "HEADERS", copies[len(native.SOURCES):])
    assert native._revision() == revision  # the same bytes
    assert native.build_key() != key
