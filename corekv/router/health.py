"""Health checks of the router's workers: :class:`WorkerPool` polls each worker's ``GET /health``.

A worker that refuses the connection, or fails two checks in a row, leaves the rotation (and
its cache view is dropped); one that passes again rejoins with its ``GET /admin/info`` read again
(a vLLM server does not serve it: the worker is then of kind ``vllm``) and its KV events
subscribed again. With a ``worker_api_key``, every request to a worker (these
checks and the forwarded requests alike) presents it as ``Authorization: Bearer <key>``.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from corekv.router.workers import EventEndpoints, Worker
from corekv.server.auth import bearer_headers

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0
FAILED_CHECKS_TO_MARK_DOWN = 2  # in a row; a refused connection marks a worker down at once


class WorkerPool:
    """The workers, in ``--workers`` order, and the task that checks their health.

    Invariant: ``workers[i].index == i``; only the event loop's thread changes a worker's state.

    :param worker_events: the KV-event publishers named for some workers, by URL as in ``urls``
        (``--worker-events``); the others' come from their ``/admin/info``.
    """

    def __init__(self, urls: Sequence[str], *, block_size: int, max_tree_blocks: int,
                 health_interval_s: float, use_events: bool = True,
                 worker_api_key: str | None = None,
                 worker_events: Mapping[str, EventEndpoints] | None = None):
        worker_events = dict(worker_events or {})
        unknown = sorted(set(worker_events) - set(urls))
        if unknown:
            raise ValueError(f"worker_events: got {', '.join(unknown)}, not among the workers' "
                             f"URLs {list(urls)}; name events for listed workers only")
        self.workers = [Worker(i, url, block_size=block_size, max_tree_blocks=max_tree_blocks,
                               events=worker_events.get(url))
                        for i, url in enumerate(urls)]
        self.health_interval_s = health_interval_s
        self.use_events = use_events
        #: what every request to a worker carries (the worker key, if any)
        self.worker_headers = bearer_headers(worker_api_key)
        self._client: Any = None
        self._task: asyncio.Task | None = None
        self._num_failed = [0] * len(self.workers)  # consecutive failed checks per worker

    def healthy_workers(self) -> list[Worker]:
        return [w for w in self.workers if w.is_healthy]

    async def start(self) -> None:
        """Check every worker once (so the first requests find the healthy ones), then keep
        checking every ``health_interval_s`` in the background."""
        import httpx

        # NOTE: a busy worker (a long prefill on a small CPU) answers late, not never
        self._client = httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S, headers=self.worker_headers)
        await self.check_all()
        self._task = asyncio.create_task(self._check_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for worker in self.workers:
            worker.stop_events(wait=True)
        if self._client is not None:
            await self._client.aclose()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers))

    async def check(self, worker: Worker) -> bool:
        """Poll ``GET /health``; a worker that recovers rejoins with its info re-read."""
        import httpx

        is_refused = False
        try:
            response = await self._client.get(worker.url + "/health")
            reason = None if response.status_code == 200 else f"/health answered {response.status_code}"
        except httpx.HTTPError as e:
            reason = f"/health failed: {type(e).__name__}: {e}"
            is_refused = isinstance(e, httpx.ConnectError)
        if reason is not None:
            self._num_failed[worker.index] += 1
            # NOTE: a refused connection means the worker is gone; a slow or odd answer may be
            # load, and marking down drops the worker's cache view, so it must happen twice.
            failed_enough = self._num_failed[worker.index] >= FAILED_CHECKS_TO_MARK_DOWN
            if worker.is_healthy and (is_refused or failed_enough):
                worker.mark_down(reason)
            return False
        self._num_failed[worker.index] = 0
        if not worker.is_healthy:
            worker.set_info(await self._read_info(worker))
            if self.use_events:
                worker.start_events(asyncio.get_running_loop())
            worker.is_healthy = True
            logger.warning("worker %s is up (%s; cache view: %s)", worker.url, worker.kind,
                           "events" if worker.events_tree is not None else "routed prompts")
        return True

    async def _read_info(self, worker: Worker) -> dict[str, Any] | None:
        import httpx

        try:
            response = await self._client.get(worker.url + "/admin/info")
            info = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as e:
            logger.warning("worker %s: GET /admin/info failed (%s)", worker.url, e)
            return None
        if response.status_code == 401:
            logger.warning("worker %s: GET /admin/info answered 401: start the router with the "
                           "workers' key (--worker-api-key or $COREKV_WORKER_API_KEY)", worker.url)
        return info if isinstance(info, dict) else None

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # NOTE: a bug in one round must not end health checking for good
                logger.exception("health check round failed")
