"""How the fsspec tier reaches its store: the filesystem opened with safe options, and batches of
per-object calls run concurrently under one deadline.

Opening (:func:`open_filesystem`): ``storage_options`` go to the filesystem as given, except that
a credential among them is refused (a config is read, logged and shared: credentials come from
the environment or a named profile), listings are not cached unless asked for (a cached listing
hides the blocks other machines wrote since), and an S3 client gets connect/read timeouts and one
retry, so no single call hangs for minutes.

Calling (:class:`Calls`): an object store is asked per object, so a batch of blocks is a batch of
calls; on an async filesystem (s3fs, gcsfs, http) they run concurrently, at most ``concurrency``
at a time, and a call that has not answered ``timeout`` seconds after it was sent is cancelled
and answered with :class:`CallTimedOut`, as is every call of its batch not sent yet: a stalled
store costs a batch one ``timeout``, and a large batch on a healthy store is not cut short. A
local filesystem is called in turn (a disk has no reason to stall, and its calls cannot be
cancelled).
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import fsspec
import fsspec.asyn

from corekv.errors import ConfigError

#: option names that carry a credential (exact, lower-case), and parts of names that do
_CREDENTIAL_NAMES = frozenset({"key", "secret", "token", "password", "passwd"})
_CREDENTIAL_PARTS = ("secret", "password", "passwd", "token", "credential", "_key", "private_key")
#: protocols of s3fs, whose botocore client takes timeouts and retries in ``config_kwargs``
_S3_PROTOCOLS = frozenset({"s3", "s3a"})


class CallTimedOut(TimeoutError):
    """A call that had not answered when its batch's deadline passed (it was cancelled)."""


def check_no_credentials(options: Mapping[str, Any], path: str = "storage_options") -> None:
    """ConfigError naming the first option under ``options`` (nested ones too) that holds a
    credential; the message never quotes its value."""
    for name, value in options.items():
        lowered = str(name).lower()
        if lowered in _CREDENTIAL_NAMES or any(part in lowered for part in _CREDENTIAL_PARTS):
            raise ConfigError(
                f"{path}.{name}: credentials do not belong in the config (it is read, logged and "
                "shared); remove it and give them through the environment (for s3://: "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) or name a profile "
                "(storage_options: {profile: NAME})", path=f"{path}.{name}")
        if isinstance(value, Mapping):
            check_no_credentials(value, f"{path}.{name}")


def open_filesystem(url: str, storage_options: Mapping[str, Any] | None, *, timeout: float):
    """``(filesystem, root)`` for ``url``; a URL fsspec cannot open is a ConfigError for it."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"url must be an fsspec URL string, got {url!r}; e.g. file:///data/kv "
                          "or s3://bucket/prefix", path="url")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise ConfigError(f"storage_options must be a mapping of the filesystem's options, got "
                          f"{type(storage_options).__name__}", path="storage_options")
    check_no_credentials(storage_options or {})
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    options = _with_defaults(protocol, dict(storage_options or {}), timeout)
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError, TypeError) as e:
        raise ConfigError(f"url {url!r} cannot be opened by fsspec ({e}); install the "
                          "filesystem's package (e.g. s3fs for s3://), fix the URL or the "
                          "storage_options", path="url") from e
    if protocol in _S3_PROTOCOLS and isinstance(getattr(fs, "retries", None), int):
        # NOTE: s3fs retries a timed-out request 5 times on its own, around botocore's attempts
        # (it takes no option for it): one try of its own leaves botocore's two attempts.
        fs.retries = 1
    if protocol in _S3_PROTOCOLS and hasattr(fs, "connect"):
        # NOTE: the client is built here, once (no request is sent): built inside the first
        # call, it would spend that call's deadline importing botocore's service models.
        fs.connect()
    return fs, root.rstrip("/")


def _with_defaults(protocol: str, options: dict[str, Any], timeout: float) -> dict[str, Any]:
    # NOTE: fsspec's listings cache never expires by default: a tier that listed its store
    # would answer membership from that listing and miss every block written elsewhere since.
    if "use_listings_cache" not in options and "listings_expiry_time" not in options:
        options["use_listings_cache"] = False
    if protocol not in ("file", "local", "memory"):
        # NOTE: fsspec hands out one cached instance per set of options: without this, a tier
        # would share its client, and the credentials found when it was made, with every other
        # tier and admin view of the process for the same store.
        options.setdefault("skip_instance_cache", True)
    if protocol in _S3_PROTOCOLS:
        # NOTE: botocore's defaults (60 s reads, up to 5 attempts, inside s3fs's own 5) let one
        # call to a stalled endpoint last minutes; the batch deadline cancels it anyway, and
        # these bound what runs on the event loop meanwhile.
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeout)
        config.setdefault("read_timeout", timeout)
        config.setdefault("retries", {"max_attempts": 2, "mode": "standard"})
        options["config_kwargs"] = config
    return options


class Calls:
    """Runs one filesystem method over many objects, concurrently where the filesystem is async.

    Invariants: :meth:`each` returns one outcome per argument tuple, in order: the method's result
    or the exception it raised (``FileNotFoundError`` for an absent object, :class:`CallTimedOut`
    past the deadline); it never raises for a call's failure; on an async filesystem a store that
    stops answering costs it about one ``timeout``.
    """

    def __init__(self, fs, *, timeout: float, concurrency: int):
        self.fs = fs
        self.timeout = timeout
        self.concurrency = concurrency
        self.is_async = bool(getattr(fs, "async_impl", False))

    def each(self, method: str, arg_tuples: Sequence[tuple], **kwargs) -> list[Any]:
        """``fs.<method>(*args, **kwargs)`` for every ``args`` in ``arg_tuples``."""
        if not arg_tuples:
            return []
        if self.is_async:
            try:
                # NOTE: the loop's own bound, for a loop that does not come back at all: the
                # calls' deadlines end a batch after ceil(calls / concurrency) timeouts at most
                waves = -(-len(arg_tuples) // self.concurrency)
                return fsspec.asyn.sync(self.fs.loop, self._gather, method, list(arg_tuples), kwargs,
                                        timeout=waves * self.timeout + 5)
            except fsspec.asyn.FSTimeoutError:  # the loop itself did not come back: all late
                return [CallTimedOut(f"{method} did not answer in {self.timeout} s")] * len(arg_tuples)
        outcomes = []
        call = getattr(self.fs, method)
        for args in arg_tuples:
            try:
                outcomes.append(call(*args, **kwargs))
            except Exception as e:  # noqa: BLE001 - a store's failure is an outcome, not a crash
                outcomes.append(e)
        return outcomes

    def listing(self, prefix: str, **kwargs) -> Any:
        """``fs.find(prefix, **kwargs)``, or the exception it raised. NOTE: a listing is a request
        per page (1000 objects on S3), so it has no deadline as a whole: each page is bounded by
        the client's own timeouts and retries (:func:`open_filesystem` sets them for S3)."""
        try:
            return self.fs.find(prefix, **kwargs)
        except Exception as e:  # noqa: BLE001 - a store's failure is an outcome, not a crash
            return e

    async def _gather(self, method: str, arg_tuples: list[tuple], kwargs: dict) -> list[Any]:
        limit = asyncio.Semaphore(self.concurrency)
        call = getattr(self.fs, f"_{method}")
        stalled = asyncio.Event()

        async def limited(args):
            async with limit:
                if stalled.is_set():  # NOTE: the store stopped answering: do not queue more calls
                    raise CallTimedOut(f"{method} not sent: an earlier call of its batch timed out")
                try:
                    return await asyncio.wait_for(call(*args, **kwargs), self.timeout)
                except asyncio.TimeoutError:
                    stalled.set()
                    raise CallTimedOut(f"{method} did not answer in {self.timeout} s") from None

        return await asyncio.gather(*(limited(args) for args in arg_tuples), return_exceptions=True)
