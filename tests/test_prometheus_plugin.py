"""The ``prometheus`` plugin: each engine's cache events become metrics in its own registry.

A real engine on the tiny random Llama drives the device events and request hooks. The engine
does not call ``corekv_on_blocks_offloaded`` / ``corekv_on_blocks_loaded`` without storage tiers,
so those are called through the engine's own plugin manager, as the cache manager calls them.
"""
from __future__ import annotations

import logging
import subprocess
import sys
import urllib.request

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from corekv.engine.llm_engine import Engine  # noqa: E402
from corekv.engine.tiny_model import make_tiny_llama  # noqa: E402
from corekv.engine.sampling import SamplingParams  # noqa: E402
from corekv.offload import TierRun  # noqa: E402
from corekv.plugin import make_plugin_manager  # noqa: E402
from corekv.plugins import prometheus  # noqa: E402
from corekv.plugins.prometheus import PORT_ENV, PrometheusExporter, exporter_for  # noqa: E402

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
SHARED = "You are a helpful assistant who answers in one line. " * 2


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama()


def make_engine(tiny, **cache):
    config = {"model": "tiny", "engine": {"num_blocks": 64, "block_size": 16},
              "cache": {"backend": "hash_blocks", **cache}}
    return Engine.from_config(config, model=tiny)


def samples(exporter: PrometheusExporter) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` parsed back from the exposition text."""
    text = exporter.exposition().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_builtin_entry_point_registers_the_plugin():
    assert make_plugin_manager(autoload=False).plugin_names()["prometheus"] == "corekv"


def test_requests_prompt_tokens_and_ttft_are_counted_from_a_real_engine(tiny):
    with make_engine(tiny) as engine:
        outputs = engine.generate([SHARED + "first", SHARED + "second"], GREEDY)
        outputs += engine.generate([SHARED + "third"], GREEDY)
        got = samples(exporter_for(engine))
    cached = sum(o.num_cached_tokens for o in outputs)
    computed = sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in outputs)
    assert cached > 0, "the shared prefix should have hit"
    assert got[("corekv_requests_finished_total", (("finish_reason", "length"),))] == 3
    assert got[("corekv_prompt_tokens_cached_total", (("tier", "device"),))] == cached
    assert got[("corekv_prompt_tokens_computed_total", ())] == computed
    assert got[("corekv_time_to_first_token_seconds_count", ())] == 3
    assert got[("corekv_time_to_first_token_seconds_sum", ())] == pytest.approx(sum(o.ttft_s for o in outputs))


def test_corekv_collect_metrics_answers_the_engines_own_exposition(tiny):
    with make_engine(tiny) as engine, make_engine(tiny) as other:
        engine.generate([SHARED + "first"], GREEDY)
        texts = engine.plugin_manager.hook.corekv_collect_metrics(engine=engine)
        assert texts == [exporter_for(engine).exposition()]
        assert texts != other.plugin_manager.hook.corekv_collect_metrics(engine=other)


def test_device_block_events_and_pool_gauges_match_the_backend(tiny):
    with make_engine(tiny) as engine:
        engine.generate([SHARED + "first"], GREEDY)
        exporter = exporter_for(engine)
        got = samples(exporter)
        assert got[("corekv_blocks_stored_total", (("tier", "device"),))] == engine.backend.num_cached_blocks > 0
        assert got[("corekv_kv_blocks", (("state", "total"),))] == 64
        assert got[("corekv_kv_blocks", (("state", "free"),))] == engine.backend.num_free_blocks
        # a reset removes every cached block: the removed counter catches up with the stored one
        engine.backend.reset()
        engine._after_step([])
        got = samples(exporter)
    assert got[("corekv_blocks_removed_total", (("tier", "device"),))] == got[
        ("corekv_blocks_stored_total", (("tier", "device"),))]


def test_offloaded_and_loaded_blocks_are_counted_per_tier(tiny):
    with make_engine(tiny) as engine:
        hook = engine.plugin_manager.hook
        hook.corekv_on_blocks_offloaded(tier="host", block_hashes=[b"a", b"b", b"c"])
        hook.corekv_on_blocks_offloaded(tier="lmdb", block_hashes=[b"a"])
        hook.corekv_on_blocks_loaded(tier="host", block_hashes=[b"a", b"b"])
        got = samples(exporter_for(engine))
    assert got[("corekv_blocks_offloaded_total", (("tier", "host"),))] == 3
    assert got[("corekv_blocks_offloaded_total", (("tier", "lmdb"),))] == 1
    assert got[("corekv_blocks_loaded_total", (("tier", "host"),))] == 2
    assert ("corekv_blocks_loaded_total", (("tier", "lmdb"),)) not in got


def test_speculative_decoding_counters_follow_the_engine_stats(tiny):
    config = {"model": "tiny", "engine": {"num_blocks": 64, "block_size": 16,
                                          "speculative": {"method": "ngram", "prompt_lookup_min": 1}}}
    with Engine.from_config(config, model=tiny) as engine:
        exporter = exporter_for(engine)
        assert samples(exporter)[("corekv_spec_decode_draft_tokens_total", ())] == 0
        engine.generate(["abcabcabcabcabcabc", SHARED], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        got, stats = samples(exporter), engine.stats()["speculative"]
    assert stats["num_proposed_tokens"] > 0
    assert got[("corekv_spec_decode_verifications_total", ())] == stats["num_speculations"]
    assert got[("corekv_spec_decode_draft_tokens_total", ())] == stats["num_proposed_tokens"]
    assert got[("corekv_spec_decode_accepted_tokens_total", ())] == stats["num_accepted_tokens"]
    assert got[("corekv_spec_decode_mean_acceptance_length", ())] == pytest.approx(stats["mean_acceptance_length"])
    with make_engine(tiny) as engine:
        assert samples(exporter_for(engine))[("corekv_spec_decode_accepted_tokens_total", ())] == 0


def test_reload_decisions_follow_the_engine_stats(tiny, tmp_path):
    config = {"model": "tiny", "engine": {"num_blocks": 64, "block_size": 16},
              "cache": {"reload_policy": "cost", "tiers": [{"type": "host", "size": "4MiB"}]}}
    with Engine.from_config(config, model=tiny) as engine:
        exporter = exporter_for(engine)
        assert samples(exporter)[("corekv_reload_skipped_blocks_total", ())] == 0
        cost = engine.offload.cost
        for _ in range(cost.min_samples):  # injected: a host tier 1 s a block, prefill 1 ms a token
            cost.observe_load(0, 1, 1.0)
            cost.observe_step(64, 0.064)
        assert cost.num_blocks_to_load([TierRun(0, 3)]) == 0
        assert not cost.worth_asking(0, 3)
        got = samples(exporter)
        stats = engine.stats()["reload"]
    assert got[("corekv_reload_skipped_blocks_total", ())] == 3
    assert got[("corekv_reload_skipped_blocks_by_tier_total", (("tier", "host"),))] == 3
    assert got[("corekv_reload_skipped_blocks_by_reason_total", (("reason", "slower_than_recompute"),))] == 3
    assert got[("corekv_reload_skipped_lookups_total", ())] == 1
    # the host tier was measured when it opened (the seed), then the injected loads moved it
    assert stats["seeded"] == ["host"]
    assert got[("corekv_reload_load_latency_seconds", (("tier", "host"),))] == stats["load_latency_s"]["host"]
    assert got[("corekv_reload_load_seconds_per_block", (("tier", "host"),))] == pytest.approx(
        stats["load_s_per_block"]["host"])
    assert stats["load_s_per_block"]["host"] > 0.5
    assert got[("corekv_reload_prefill_seconds_per_token", ())] == pytest.approx(1e-3)
    with make_engine(tiny) as engine:  # no tiers
        assert samples(exporter_for(engine))[("corekv_reload_skipped_blocks_total", ())] == 0


def test_each_engine_has_its_own_registry(tiny):
    with make_engine(tiny) as first, make_engine(tiny) as second:
        first.generate(["one request"], GREEDY)
        a, b = exporter_for(first), exporter_for(second)
        assert a is not b and a.registry is not b.registry
        key = ("corekv_requests_finished_total", (("finish_reason", "length"),))
        assert samples(a)[key] == 1 and key not in samples(b)


def test_start_http_server_serves_the_exposition(tiny):
    with make_engine(tiny) as engine:
        engine.generate(["served"], GREEDY)
        exporter = exporter_for(engine)
        port = exporter.start_http_server(0)
        try:
            with pytest.raises(RuntimeError, match="already serves"):
                exporter.start_http_server(0)
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        finally:
            exporter.close()
    assert b'corekv_requests_finished_total{finish_reason="length"} 1.0' in body


@pytest.mark.parametrize("port", [-1, 70000, "9400", True])
def test_start_http_server_rejects_a_bad_port(port):
    with pytest.raises(ValueError, match=f"port must be an int in 0..65535, got {port!r}"):
        PrometheusExporter().start_http_server(port)


def test_the_port_environment_variable_starts_a_server(tiny, monkeypatch):
    monkeypatch.setenv(PORT_ENV, "0")
    with make_engine(tiny) as engine:
        exporter = exporter_for(engine)
        try:
            port = exporter._server.server_port
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
            assert b"corekv_kv_blocks" in body
        finally:
            exporter.close()


def test_a_bad_port_variable_is_logged_and_the_engine_still_serves(tiny, monkeypatch, caplog):
    monkeypatch.setenv(PORT_ENV, "not-a-port")
    with caplog.at_level(logging.WARNING, logger="corekv.plugins.prometheus"), make_engine(tiny) as engine:
        assert engine.generate(["still works"], GREEDY)[0].finish_reason == "length"
        assert exporter_for(engine)._server is None
    assert PORT_ENV in caplog.text and "not-a-port" in caplog.text


def test_without_prometheus_client_the_plugin_does_nothing(tiny, monkeypatch):
    """``sys.modules[name] = None`` makes the import fail exactly as an absent package does."""
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    assert not prometheus.is_available()
    with make_engine(tiny) as engine:
        assert exporter_for(engine) is None
        assert engine.generate(["no metrics"], GREEDY)[0].finish_reason == "length"


def test_importing_the_plugin_does_not_import_prometheus_client():
    code = "import corekv.plugins.prometheus, sys; print('prometheus_client' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_exporter_for_rejects_what_is_not_an_engine():
    with pytest.raises(TypeError, match="expected a corekv.Engine"):
        exporter_for(object())


def test_the_server_stops_when_its_engine_is_closed(tiny):
    engine = make_engine(tiny)
    exporter = exporter_for(engine)
    port = exporter.start_http_server(0)
    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    engine.close()  # corekv_on_engine_closed; the engine is still referenced here
    assert exporter._server is None
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()


def test_the_server_stops_when_its_engine_is_garbage_collected(tiny):
    import gc

    engine = make_engine(tiny)
    exporter = exporter_for(engine)
    port = exporter.start_http_server(0)
    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    del engine  # never closed
    gc.collect()
    assert exporter._server is None
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
