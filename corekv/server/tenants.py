"""Per-tenant API keys: each key names a tenant, and the tenant, not the request, sets the salt.

A key file (``corekv serve --api-keys FILE``) maps tenant names to their keys and holds one admin
key::

    admin: 7Qk...                 # /admin/*, /metrics (and so the KV-event endpoint), any salt
    tenants:
      tenant-a: x8W...            # requests run with cache_salt "tenant-a"
      tenant-b: pL2...

With it, :class:`TenantGuard` (ASGI middleware, in front of every route) answers 401 to a
request without a known key and 403 to a tenant's request for ``/admin/*`` or ``/metrics``; it
puts the caller's :class:`Tenant` in the request scope. A tenant's requests run under its own
salt (its name, the salt ``cache.pinned`` entries name): prefixes, tier entries and KV events of
two tenants never meet, and a body naming another ``cache_salt`` is a 403. The admin key's
requests are unscoped (the body's ``cache_salt`` applies, as with a single ``--api-key``).
:class:`TenantUsage` counts each tenant's requests and tokens, for ``/admin/stats`` and
``/metrics`` (labelled by tenant), which only the admin key reads.
"""
from __future__ import annotations

import hmac
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.responses import JSONResponse

from corekv.server.auth import OPEN_PATHS, check_api_key
from corekv.server.protocol import APIError

__all__ = ["Tenant", "TenantKeys", "TenantGuard", "TenantUsage", "ADMIN", "tenant_of"]

_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_ADMIN_PATHS = ("/admin/", "/metrics")


@dataclass(frozen=True)
class Tenant:
    """Who sent a request: a tenant (its ``name`` is its salt) or the admin (``is_admin``)."""

    name: str
    is_admin: bool = False

    @property
    def salt(self) -> str | None:
        """The cache_salt this caller's requests run under; None: the request's own (admin)."""
        return None if self.is_admin else self.name


ADMIN = Tenant("admin", is_admin=True)


class TenantKeys:
    """The keys of a key file: ``admin`` and ``{tenant name: key}``; every key distinct.

    Errors name the file and the field, never a key (they reach logs and terminals).
    """

    def __init__(self, admin: str, tenants: Mapping[str, str], *, where: str = "api keys"):
        check_api_key(admin, f"{where}: admin")
        if not isinstance(tenants, Mapping) or not tenants:
            raise ValueError(f"{where}: tenants must be a non-empty mapping of tenant names to keys, "
                             "e.g. tenants: {tenant-a: KEY}")
        self._key_to_tenant: dict[bytes, Tenant] = {admin.encode(): ADMIN}
        for name, key in tenants.items():
            if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name):
                raise ValueError(f"{where}: tenant name {name!r} must be 1-64 letters, digits, '_', "
                                 "'.' or '-' (it becomes the tenant's cache_salt)")
            check_api_key(key, f"{where}: tenants.{name}")
            if key.encode() in self._key_to_tenant:
                raise ValueError(f"{where}: tenants.{name} has the same key as another tenant or the "
                                 "admin; give every tenant its own key")
            self._key_to_tenant[key.encode()] = Tenant(name)

    @classmethod
    def from_file(cls, path: str | Path) -> TenantKeys:
        """Read a key file (YAML: ``admin: KEY`` and ``tenants: {name: KEY}``)."""
        from corekv.config.sources import parse_yaml

        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-keys: cannot read {str(path)!r} ({type(e).__name__}); pass a "
                             "readable YAML file with admin: and tenants:") from None
        try:
            data = parse_yaml(text, str(path))
        except Exception:  # NOTE: a YAML error quotes the text, which holds keys
            data = None
        if not isinstance(data, Mapping) or set(data) != {"admin", "tenants"}:
            raise ValueError(f"--api-keys: {str(path)!r} must be a YAML mapping with exactly the keys "
                             "admin (the admin key) and tenants (tenant name: key)")
        return cls(data["admin"], data["tenants"], where=str(path))

    @property
    def tenant_names(self) -> list[str]:
        return sorted(t.name for t in self._key_to_tenant.values() if not t.is_admin)

    def tenant_for(self, key: bytes) -> Tenant | None:
        """The tenant whose key ``key`` is, or None; compares every key in constant time."""
        found = None
        for candidate, tenant in self._key_to_tenant.items():
            # NOTE: no early exit: the time taken does not tell which key (or how much) matched
            if hmac.compare_digest(key, candidate):
                found = tenant
        return found


class TenantGuard:
    """ASGI middleware: resolve the bearer key to a :class:`Tenant` (401 when unknown), refuse a
    tenant the admin paths (403), and leave the tenant in ``scope["state"]["tenant"]``."""

    def __init__(self, app: Any, keys: TenantKeys, *, open_paths: frozenset[str] = OPEN_PATHS):
        self.app, self.keys, self.open_paths = app, keys, open_paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        credentials = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = credentials.strip().partition(b" ")
        tenant = self.keys.tenant_for(token.strip()) if scheme.lower() == b"bearer" else None
        if tenant is None:
            error, headers = APIError("no valid API key: send 'Authorization: Bearer <key>' with your "
                                      "tenant's key", status=401, code="invalid_api_key"), \
                {"WWW-Authenticate": "Bearer"}
        elif not tenant.is_admin and scope["path"].startswith(_ADMIN_PATHS):
            error, headers = APIError(f"{scope['path']} needs the admin key; a tenant's key serves "
                                      "/v1/* only", status=403, code="admin_only"), {}
        else:
            scope.setdefault("state", {})["tenant"] = tenant
            await self.app(scope, receive, send)
            return
        await JSONResponse(error.body(), status_code=error.status, headers=headers)(scope, receive, send)


def tenant_of(request: Any) -> Tenant | None:
    """The request's tenant (None when the server has no key file)."""
    return request.scope.get("state", {}).get("tenant")


def scoped_salt(tenant: Tenant | None, requested: str | None) -> str | None:
    """The cache_salt a request runs under: its tenant's; a different one in the body is a 403."""
    if tenant is None or tenant.is_admin:
        return requested
    if requested is not None and requested != tenant.salt:
        raise APIError("cache_salt: a tenant's requests run under its own salt, set by its API key; "
                       "leave cache_salt out (or send your tenant's name)", status=403,
                       param="cache_salt", code="salt_not_allowed")
    return tenant.salt


class TenantUsage:
    """Requests and tokens per tenant since the server started (thread-safe)."""

    _FIELDS = ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens")

    def __init__(self, names: Iterable[str] = ()):
        self._lock = threading.Lock()
        self._usage: dict[str, dict[str, int]] = {name: dict.fromkeys(self._FIELDS, 0) for name in names}

    def record(self, tenant: Tenant | None, outputs: Iterable[Any]) -> None:
        """Count finished requests' outputs (``RequestOutput``) for ``tenant``."""
        if tenant is None or tenant.is_admin:
            return
        with self._lock:
            usage = self._usage.setdefault(tenant.name, dict.fromkeys(self._FIELDS, 0))
            for output in outputs:
                if output is None:
                    continue
                usage["requests"] += 1
                usage["prompt_tokens"] += len(output.prompt_token_ids)
                usage["cached_prompt_tokens"] += output.num_cached_tokens
                usage["completion_tokens"] += sum(len(c.token_ids) for c in output.outputs)

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {name: dict(usage) for name, usage in sorted(self._usage.items())}

    def exposition(self) -> bytes:
        """The counters in Prometheus' text format, one series per tenant."""
        lines = []
        snapshot = self.snapshot()
        for field in self._FIELDS:
            metric = f"corekv_tenant_{field}_total"
            lines += [f"# HELP {metric} {field.replace('_', ' ')} of the tenant's requests",
                      f"# TYPE {metric} counter"]
            lines += [f'{metric}{{tenant="{name}"}} {usage[field]}' for name, usage in snapshot.items()]
        return ("\n".join(lines) + "\n").encode()
