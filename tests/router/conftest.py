"""Fixtures for the router tests: three real ``corekv serve`` workers (subprocesses on loopback
serving the tiny model, each publishing KV events), started once per session, a fourth that
needs an API key, and a router run in-process under uvicorn on a thread for each test that
needs one."""
from __future__ import annotations

import pytest
import yaml
from processes import ServeProcess, free_port, running
from router_helpers import BLOCK_SIZE, NUM_BLOCKS, NUM_WORKERS, WORKER_KEY, RouterThread


@pytest.fixture(scope="session")
def workers(tiny_model_folder, tmp_path_factory):
    """Three workers of the tiny model (block_size 4, 128 blocks), each with KV events on."""
    folder = tmp_path_factory.mktemp("router-workers")
    procs = []
    for i in range(NUM_WORKERS):
        config = {"model": str(tiny_model_folder), "device": "cpu",
                  "engine": {"block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS},
                  "kv_events": {"enabled": True, "include_token_ids": True,
                                "endpoint": f"tcp://127.0.0.1:{free_port()}",
                                "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}}
        path = folder / f"worker{i}.yaml"
        path.write_text(yaml.safe_dump(config))
        procs.append(ServeProcess(path, free_port(), folder / f"worker{i}.log", "--log-level", "warning"))
    with running(procs):
        yield procs


@pytest.fixture(scope="session")
def keyed_worker(tiny_model_folder, tmp_path_factory):
    """A worker of the tiny model started with the key ``WORKER_KEY`` in ``$COREKV_API_KEY``."""
    folder = tmp_path_factory.mktemp("router-keyed-worker")
    path = folder / "worker.yaml"
    path.write_text(yaml.safe_dump({"model": str(tiny_model_folder), "device": "cpu",
                                    "engine": {"block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS}}))
    proc = ServeProcess(path, free_port(), folder / "worker.log", "--log-level", "warning")
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("COREKV_API_KEY", WORKER_KEY)  # NOTE: the subprocess inherits it at start
            proc.start()
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_folder):
    from corekv.engine.models import load_tokenizer

    return load_tokenizer(str(tiny_model_folder))


@pytest.fixture
def make_router(tokenizer):
    """``make_router(urls, policy="cache_aware", use_events=False, api_key=None,
    worker_api_key=None, max_request_bytes=None, **thresholds)`` -> a started RouterThread
    (stopped after the test)."""
    from corekv.router.app import build_app
    from corekv.router.policy import CacheAwareConfig, make_policy
    from corekv.router.health import WorkerPool

    started = []

    def make(urls, policy="cache_aware", *, use_events=False, max_retries=2,
             health_interval_s=0.2, api_key=None, worker_api_key=None, max_request_bytes=None,
             admin_key=None, **thresholds):
        pool = WorkerPool(urls, block_size=BLOCK_SIZE, max_tree_blocks=4096,
                          health_interval_s=health_interval_s, use_events=use_events,
                          worker_api_key=worker_api_key)
        limit = {} if max_request_bytes is None else {"max_request_bytes": max_request_bytes}
        app = build_app(pool, make_policy(policy, CacheAwareConfig(**thresholds)), tokenizer,
                        max_retries=max_retries, request_timeout_s=120, api_key=api_key,
                        admin_key=admin_key, **limit)
        router = RouterThread(app, free_port()).__enter__()
        started.append(router)
        return router

    yield make
    for router in started:
        router.__exit__(None, None, None)
