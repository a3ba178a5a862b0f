"""corekv.tier_admin: the admin factory convention (make_store_admin), and how ``corekv store``
opens a config's views through each tier type's ``TierSpec.admin`` (corekv.store.open_views)."""
import pytest

from corekv import store
from corekv.config import load_config
from corekv.errors import ConfigError, CoreKVError, PluginError
from corekv.plugin import Option, TierSpec, hookimpl, make_plugin_manager
from corekv.testing.tier import block_payload, make_keys
from corekv.tier_admin import StoreAdmin, StoredEntry, make_store_admin
from corekv.tiers.fsspec import FsspecTier
from corekv.tiers.lmdb import LMDBTier


class ListAdmin(StoreAdmin):
    """A view over a list of entries, enough for the factory convention's tests."""

    def __init__(self, *, entries=()):
        self.stored = list(entries)

    def entries(self):
        return iter(list(self.stored))

    def delete(self, refs):
        self.stored = [e for e in self.stored if e.ref not in set(refs)]


def spec_with(admin, **fields) -> TierSpec:
    return TierSpec(name="toy", factory=dict, admin=admin, plugin="toy_plugin", **fields)


def test_the_admin_factory_gets_the_tiers_options():
    entry = StoredEntry("ref", b"k" * 16, "0123456789ab", b"data")
    admin = make_store_admin(spec_with(ListAdmin, options={"entries": Option("str")}),
                             {"entries": [entry]}, name="toy")
    assert list(admin.entries()) == [entry]


@pytest.mark.parametrize("raised, expected, message", [
    (ConfigError("url must be an fsspec URL", path="url"), ConfigError,
     r"^cache\.tiers\[2\]\.url: url must be an fsspec URL$"),
    (FileNotFoundError("no store at /data/kv"), FileNotFoundError, r"^tier 'disk': no store at /data/kv$"),
    (CoreKVError("/data/kv/data.mdb is truncated"), CoreKVError,
     r"^tier 'disk': /data/kv/data.mdb is truncated$"),
    (OSError("the device is gone"), PluginError,
     r"^cache\.tiers\[2\]: tier 'toy' \(plugin 'toy_plugin'\) failed to open its admin view: "
     r"OSError: the device is gone$"),
])
def test_a_failing_admin_factory_names_the_field_or_the_tier(raised, expected, message):
    def admin(**options):
        raise raised

    with pytest.raises(expected, match=message) as caught:
        make_store_admin(spec_with(admin), {}, name="disk", where="cache.tiers[2]")
    assert type(caught.value) is expected
    if expected is ConfigError:
        assert caught.value.path == "cache.tiers[2].url"


def test_an_admin_factory_must_return_a_store_admin():
    with pytest.raises(PluginError, match="admin factory returned dict, expected a corekv.tier_admin.StoreAdmin"):
        make_store_admin(spec_with(lambda **options: {}), {}, name="toy")
    with pytest.raises(PluginError, match="declares no admin view"):
        make_store_admin(spec_with(None), {}, name="toy")


def test_a_registered_admin_that_is_not_callable_is_a_plugin_error():
    class Plugin:
        @hookimpl
        def corekv_register_tiers(self):
            return [TierSpec("odd_admin", factory=dict, admin="not a function")]

    with pytest.raises(PluginError, match="'odd_admin' has admin 'not a function'; expected a callable or None"):
        make_plugin_manager(plugins=[Plugin()]).tiers()


# -- open_views: the config's tiers, through the plugin manager ---------------------------------------
class PersistentWithoutAdmin(FsspecTier):
    """A persistent third-party tier whose plugin declares no admin view."""


class NoAdminPlugin:
    @hookimpl
    def corekv_register_tiers(self):
        return [TierSpec("no_admin", factory=PersistentWithoutAdmin,
                         options={"url": Option("str")})]


def fill_lmdb(path, num: int) -> None:
    with LMDBTier(path=str(path), size=1 << 20, block_bytes=64, fingerprint=b"model") as tier:
        keys = make_keys(num)
        tier.put([(k, block_payload(k, 64)) for k in keys])


def test_tiers_without_an_admin_view_are_skipped_with_the_reason(tmp_path):
    fill_lmdb(tmp_path / "kv", 3)
    manager = make_plugin_manager(plugins=[NoAdminPlugin()])
    cfg = load_config({"cache": {"tiers": [{"type": "host", "size": "1MiB"},
                                           {"type": "no_admin", "url": str(tmp_path / "fs")},
                                           {"type": "lmdb", "path": str(tmp_path / "kv"), "size": "1MiB"}]}},
                      env={}, plugin_manager=manager)
    views, skipped = store.open_views(cfg, plugin_manager=manager)
    try:
        assert [(v.name, v.type) for v in views] == [("lmdb", "lmdb")]
        assert skipped == ["host (host: lives in one process's memory, nothing persists to inspect)",
                           "no_admin (no_admin: plugin 'NoAdminPlugin' declares no admin view "
                           "(TierSpec.admin) for it)"]
        assert store.summarize(views[0])["entries"] == 3
    finally:
        for view in views:
            view.close()
    with pytest.raises(ConfigError, match=r"^no inspectable tier: no_admin \(no_admin: plugin"):
        store.open_views(cfg, "no_admin", plugin_manager=manager)


def test_a_view_that_fails_to_open_closes_the_ones_opened_before_it(tmp_path):
    fill_lmdb(tmp_path / "kv", 2)
    cfg = load_config({"cache": {"tiers": [
        {"type": "lmdb", "path": str(tmp_path / "kv"), "size": "1MiB"},
        {"type": "lmdb", "name": "missing", "path": str(tmp_path / "nothing-here"), "size": "1MiB"}]}},
        env={})
    with pytest.raises(FileNotFoundError, match="^tier 'missing': no LMDB store at "):
        store.open_views(cfg)
    with LMDBTier(path=str(tmp_path / "kv"), size=1 << 20, block_bytes=64, fingerprint=b"model") as tier:
        assert tier.num_entries == 2  # the first view released the store
