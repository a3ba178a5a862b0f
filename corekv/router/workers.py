"""The router's view of its workers: health, in-flight load, and what each one has cached.

A worker is a ``corekv serve`` worker (its ``GET /admin/info`` answers) or any other server of the
OpenAI API, taken for a vLLM server (``kind`` ``"vllm"``). Its cache is known from its KV events
when the router can reach a publisher, named on the command line (:class:`EventEndpoints`,
``corekv route --worker-events``) or else announced by ``/admin/info`` (``kv_events``), and its
events carry token ids; else it is guessed from the prompts routed to it. A worker that fails (a
health check, see :mod:`corekv.router.health`, or a forwarded request) leaves the rotation and its
cache view is dropped: a worker that comes back has usually restarted with an empty cache.

Tenants stay apart in both views: the routed view is namespaced by the request's ``cache_salt``,
the events view by the tenant key of the request's salt, ``cache_salt_key(salt)``
(:func:`corekv.kv_event_wire.cache_salt_key`). A salted chain's first block carries it in its
``extra_keys`` from a corekv worker; a vLLM worker puts the salt itself there, which the router
turns into the same key as the event arrives (the worker's kind decides), so both kinds of worker
match the same request, and no salt is kept in clear in the events view.
"""
from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from corekv.kv_event_wire import AllBlocksCleared, BlockRemoved, BlockStored, cache_salt_key
from corekv.router.tree import BlockTree

logger = logging.getLogger(__name__)

#: the media whose events describe the worker's device cache (``None``: corekv; ``GPU``: vLLM)
DEVICE_MEDIA = (None, "GPU")


@dataclass(frozen=True)
class EventEndpoints:
    """Where a worker publishes its KV events (vLLM's ``--kv-events-config`` names them alike):
    the PUB ``endpoint``, its replay ROUTER ``replay_endpoint`` (``None``: no replay) and the
    ``topic`` to receive (``""``: every topic). Checked by ``corekv route --worker-events``."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class Worker:
    """One worker: a ``corekv serve`` worker or another OpenAI server (vLLM's).

    Invariants: ``load`` is the number of requests the router has sent and not yet finished
    (each :meth:`begin` is ended by exactly one :meth:`finish`); ``pending`` holds exactly those
    requests' prompts; the cache view is ``events_tree`` while a subscriber feeds it, else
    ``routed_tree``; both trees are touched on the event loop's thread only, and the events
    view's namespaces are tenant keys (:func:`_request_namespace`), never salts in clear.

    :param events: the publisher named for this worker (``--worker-events``); it takes precedence
        over the one ``/admin/info`` announces.
    """

    def __init__(self, index: int, url: str, *, block_size: int, max_tree_blocks: int,
                 events: EventEndpoints | None = None):
        self.index, self.url = index, url.rstrip("/")
        self.block_size, self.max_tree_blocks = block_size, max_tree_blocks
        self.named_events = events
        self.is_healthy = False
        self.load = 0
        self.info: dict[str, Any] | None = None
        self.routed_tree = BlockTree(block_size, max_blocks=max_tree_blocks)
        self.events_tree: BlockTree | None = None
        self.subscriber: Any = None
        self.pending: dict[int, tuple[Hashable, list[int], int]] = {}  # salt, ids, new blocks
        self.num_requests = self.num_failures = self.num_event_batches = 0
        self._ids = itertools.count()

    @property
    def kind(self) -> str:
        """``corekv`` when the worker's ``/admin/info`` answered, else ``vllm`` (any other OpenAI
        server: vLLM's conventions, its salts in clear in the events, are assumed)."""
        return "corekv" if self.info is not None else "vllm"

    @property
    def num_tree_blocks(self) -> int:
        """Blocks believed cached here; with events, also the new blocks of prompts in flight
        (NOTE: their events come after the prefill, and until then a burst of new prompts would
        all pick the same "emptiest" worker)."""
        if self.events_tree is None:
            return self.routed_tree.num_blocks
        return self.events_tree.num_blocks + sum(p[2] for p in self.pending.values())

    def match(self, token_ids: Sequence[int], cache_salt: Hashable) -> int:
        """Prompt tokens believed cached here: the tree's match, or a prompt still in flight here
        (NOTE: its KV events come only once its prefill ran; until then a request that shares its
        prefix should still follow it)."""
        if self.events_tree is None:
            return self.routed_tree.match(token_ids, cache_salt)
        best = self.events_tree.match(token_ids, _request_namespace(cache_salt))
        for salt, other, _ in self.pending.values():
            if salt == cache_salt and best < len(token_ids):
                best = max(best, _common_blocks(token_ids, other, self.block_size))
        return best

    def begin(self, token_ids: Sequence[int], cache_salt: Hashable) -> int:
        """Count a request sent here (and remember its prompt); returns the id :meth:`finish` takes."""
        request_id = next(self._ids)
        self.load += 1
        self.num_requests += 1
        token_ids = token_ids if isinstance(token_ids, list) else list(token_ids)  # NOTE: sliced
        if self.events_tree is None:
            self.routed_tree.insert(token_ids, cache_salt)
            num_new = 0
        else:
            num_cached = self.events_tree.match(token_ids, _request_namespace(cache_salt))
            num_new = (len(token_ids) - num_cached) // self.block_size
        self.pending[request_id] = (cache_salt, token_ids, num_new)
        return request_id

    def finish(self, request_id: int) -> None:
        if self.pending.pop(request_id, None) is not None:
            self.load -= 1

    def mark_down(self, reason: str) -> None:
        """Leave the rotation until a health check succeeds; forget the cache view."""
        if self.is_healthy:
            logger.warning("worker %s is down (%s)", self.url, reason)
        self.is_healthy = False
        self.routed_tree.clear()
        self.stop_events()

    def set_info(self, info: dict[str, Any] | None) -> None:
        """Take the worker's ``/admin/info`` (its block size sizes the cache view)."""
        self.info = info
        block_size = (info or {}).get("block_size")
        if isinstance(block_size, int) and block_size >= 1 and block_size != self.block_size:
            logger.warning("worker %s uses block_size %d, not %d", self.url, block_size,
                           self.block_size)
            self.block_size = block_size
            self.routed_tree = BlockTree(block_size, max_blocks=self.max_tree_blocks)

    def apply_batch(self, seq: int, batch: Any) -> None:
        """Apply one KV event batch (on the event loop's thread).

        A stored block without token ids (the worker has ``kv_events.include_token_ids: false``)
        ends the events view: computing corekv's block hashes from a prompt takes the model's
        weights, which the router does not load, so hashes alone match nothing, and the prompts
        routed here are the better guess. The view takes the block size the events carry (a vLLM
        worker's ``--block-size`` is announced nowhere else) while it is empty."""
        tree = self.events_tree
        if tree is None:
            return  # NOTE: a batch queued before the subscriber was closed
        self.num_event_batches += 1
        kind = self.kind
        for event in batch.events:
            if isinstance(event, BlockStored) and event.medium in DEVICE_MEDIA:
                if event.lora_id is not None or event.lora_name is not None:
                    continue
                if event.block_hashes and not event.token_ids:
                    self._route_on_prompts("its KV events carry no token ids "
                                           "(kv_events.include_token_ids: false)")
                    return
                if event.block_size != tree.block_size:
                    tree = self._resize_events_view(event.block_size)
                    if tree is None:
                        continue
                tree.store(event.block_hashes, event.parent_block_hash, event.token_ids,
                           _chain_namespace(event, kind))
            elif isinstance(event, BlockRemoved) and event.medium in DEVICE_MEDIA:
                tree.remove(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                tree.clear()

    def clear_events_view(self) -> None:
        """The publisher restarted (its count began again) between two health checks: its cache
        is new, and the events from now on describe all of it (on the event loop's thread)."""
        if self.events_tree is not None:
            self.events_tree.clear()

    def state(self) -> dict[str, Any]:
        """The worker as ``GET /workers`` shows it."""
        events = None
        if self.subscriber is not None:
            events = {"endpoint": self.subscriber.endpoint, "batches": self.num_event_batches,
                      "last_seq": self.subscriber.last_seq, "missed": self.subscriber.num_missed}
        return {"url": self.url, "kind": self.kind, "healthy": self.is_healthy,
                "in_flight": self.load, "requests": self.num_requests, "failures": self.num_failures,
                "cache_view": "events" if self.events_tree is not None else "routed_prompts",
                "tree_blocks": self.num_tree_blocks, "events_connected": self.subscriber is not None,
                "events": events, "block_size": self.block_size,
                "model": (self.info or {}).get("model")}

    def start_events(self, loop: asyncio.AbstractEventLoop) -> None:
        """Subscribe to the KV events named for this worker, else to those ``self.info``
        announces (if any); failures leave the routed-prompt view in place."""
        if self.subscriber is not None:
            return
        spec = self.named_events
        if spec is None:
            announced = (self.info or {}).get("kv_events")
            if not announced:
                return
            spec = self._announced_endpoints(announced)
            if spec is None:
                return
        try:
            from corekv.kv_event_subscriber import KVEventSubscriber

            endpoint = self._at_worker_host(spec.endpoint)
            replay = self._at_worker_host(spec.replay_endpoint) if spec.replay_endpoint else None
            subscriber = KVEventSubscriber(
                endpoint, replay_endpoint=replay, topic=spec.topic,
                on_batch=lambda seq, batch: loop.call_soon_threadsafe(self.apply_batch, seq, batch),
                on_restart=lambda: loop.call_soon_threadsafe(self.clear_events_view),
                start_seq=0 if replay else None)
            self.events_tree = BlockTree(self.block_size)
            self.subscriber = subscriber.start()
        except Exception as e:  # NOTE: events are an optimisation: route on routed prompts instead
            logger.warning("worker %s: cannot subscribe to its KV events %s (%s); routing on the "
                           "prompts sent to it instead", self.url, spec, e)
            self.events_tree = self.subscriber = None

    def stop_events(self, *, wait: bool = False) -> None:
        """Unsubscribe; the view falls back to routed prompts (``wait``: until the thread ended)."""
        subscriber, self.subscriber, self.events_tree = self.subscriber, None, None
        if subscriber is None:
            return
        if wait:
            subscriber.close()
        else:
            # NOTE: close() joins the receiving thread (up to a poll interval): not on the loop
            threading.Thread(target=subscriber.close, name="corekv-route-unsubscribe",
                             daemon=True).start()

    # -- helpers --------------------------------------------------------------------------------
    def _announced_endpoints(self, announced: Any) -> EventEndpoints | None:
        """The endpoints ``/admin/info`` announces, or ``None`` (with a warning) for a publisher
        on the worker's loopback that this router cannot reach, or an announcement it cannot read."""
        try:
            spec = EventEndpoints(announced["endpoint"], announced.get("replay_endpoint") or None,
                                  announced.get("topic") or "")
            if not all(isinstance(v, str) for v in (spec.endpoint, spec.replay_endpoint or "",
                                                    spec.topic)):
                raise TypeError("expected str addresses and topic")
        except (TypeError, KeyError, AttributeError) as e:
            logger.warning("worker %s announces KV events %r that cannot be read (%s); routing on "
                           "the prompts sent to it instead", self.url, announced, e)
            return None
        if self._reachable(spec.endpoint) is None:
            logger.warning("worker %s publishes its KV events on %s, its own loopback, which "
                           "this router cannot reach; routing on the prompts sent to it "
                           "instead (set kv_events.endpoint to tcp://*:PORT there to let "
                           "routers on other machines subscribe)", self.url, spec.endpoint)
            return None
        if spec.replay_endpoint and self._reachable(spec.replay_endpoint) is None:
            spec = EventEndpoints(spec.endpoint, None, spec.topic)
        return spec

    def _resize_events_view(self, block_size: int) -> BlockTree | None:
        """The events view for ``block_size``-token blocks: a new one while the view is empty,
        else ``None`` (the event is skipped: the view holds blocks of another size)."""
        if self.events_tree.num_blocks:
            logger.debug("worker %s: skipped a KV event of %d-token blocks (the view holds %d)",
                         self.url, block_size, self.events_tree.block_size)
            return None
        if block_size != self.block_size:
            logger.warning("worker %s: its KV events have %d-token blocks, not %d; its cache view "
                           "follows the events", self.url, block_size, self.block_size)
        self.block_size = block_size
        self.routed_tree = BlockTree(block_size, max_blocks=self.max_tree_blocks)
        self.events_tree = BlockTree(block_size)
        return self.events_tree

    def _route_on_prompts(self, reason: str) -> None:
        """Drop the events view for the routed-prompt one, seeded with the prompts in flight."""
        logger.warning("worker %s: %s; routing on the prompts sent to it instead", self.url, reason)
        self.stop_events()
        for salt, token_ids, _ in self.pending.values():
            self.routed_tree.insert(token_ids, salt)

    def _reachable(self, endpoint: str) -> str | None:
        """The address this router subscribes at for an announced publisher: see
        :meth:`_at_worker_host`; ``None`` for one on the worker's loopback when the worker is on
        another machine (NOTE: connecting would reach this machine's loopback instead, perhaps
        another worker's publisher). A publisher named on the command line is trusted as named."""
        scheme, _, rest = endpoint.partition("://")
        host, sep, _ = rest.rpartition(":")
        if scheme == "tcp" and sep and _is_loopback(host) and not _is_loopback(
                urlsplit(self.url).hostname or ""):
            return None
        return self._at_worker_host(endpoint)

    def _at_worker_host(self, endpoint: str) -> str:
        """A publisher bound to every interface (``tcp://*:5557``) is reached at the worker's
        host; any other address as it is."""
        scheme, _, rest = endpoint.partition("://")
        host, sep, port = rest.rpartition(":")
        if scheme == "tcp" and sep and host in ("*", "0.0.0.0", "[::]", "::"):
            return f"tcp://{urlsplit(self.url).hostname}:{port}"
        return endpoint


def _request_namespace(cache_salt: Hashable) -> Hashable:
    """The events view's namespace of a request's blocks: what :func:`_chain_namespace` reads
    from the first block of a chain the worker stored for this salt."""
    key = cache_salt_key(cache_salt) if isinstance(cache_salt, str) else None
    return None if key is None else (key,)


def _chain_namespace(event: BlockStored, kind: str) -> Hashable:
    """The namespace of a chain that ``event`` starts, from its first block's extra keys
    (``None`` without any): a corekv worker's are the tenant key already; a vLLM worker's str
    keys (its salt, in clear) become ``cache_salt_key(key)`` here, the key corekv's workers send,
    so a salted request finds its chains on both kinds of worker and the salt is not kept.

    NOTE: the worker's kind decides, not the key's look: a vLLM tenant whose salt looks like
    another tenant's key is digested again, never taken for that tenant. A chain whose extra keys
    hold anything else (a LoRA, multimodal or prompt-embedding keys, another publisher's) gets a
    namespace of its own that no request maps to: never merged with a tenant's blocks, only
    never matched."""
    first = event.extra_keys[0] if event.extra_keys else None
    if not first:
        return None
    if kind == "vllm":
        return tuple(cache_salt_key(key) if isinstance(key, str) else key for key in first)
    return tuple(first)


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _common_blocks(a: Sequence[int], b: Sequence[int], block_size: int) -> int:
    """Tokens in the whole blocks ``a`` and ``b`` share from the start (binary search on slices)."""
    low, high = 0, min(len(a), len(b)) // block_size
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid * block_size] == b[:mid * block_size]:
            low = mid
        else:
            high = mid - 1
    return low * block_size
