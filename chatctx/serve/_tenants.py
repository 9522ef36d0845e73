"""Keys, tenants and the limits on turns.

A bearer key names a tenant. A tenant's conversations are stored as ``<tenant>:<id>``, so
one tenant's id can never reach another's conversation: tenant B asking for ``abc`` looks
up ``B:abc``, and gets 404 unless B created it. Without keys there is one anonymous tenant
and ids are stored as given (the CLI sees the same conversations).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from chatctx.serve._errors import APIError


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request is from; ``name`` None on a server without keys."""

    name: str | None

    @property
    def label(self) -> str:
        return self.name or "-"

    def stored_id(self, conversation: str) -> str:
        return conversation if self.name is None else f"{self.name}:{conversation}"

    def owns(self, stored_id: str) -> bool:
        return self.name is None or stored_id.startswith(f"{self.name}:")

    def client_id(self, stored_id: str) -> str:
        """The id this tenant knows ``stored_id`` by (call only where ``owns`` holds)."""
        return stored_id if self.name is None else stored_id[len(self.name) + 1 :]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class Tenancy:
    """Maps ``Authorization: Bearer <key>`` to a tenant (keys are kept as digests)."""

    def __init__(self, keys: Mapping[str, str] | None) -> None:
        self._tenants = {_digest(k): t for k, t in (keys or {}).items()}
        self.open = not self._tenants

    def authenticate(self, authorization: str | None) -> Tenant:
        if self.open:
            return Tenant(None)
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(
                401,
                "missing API key: send Authorization: Bearer <key>",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        wanted = _digest(key.strip())
        found = None
        for digest, tenant in self._tenants.items():  # every key compared, in constant time
            if hmac.compare_digest(digest, wanted):
                found = tenant
        if found is None:
            raise APIError(
                401,
                "incorrect API key",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return Tenant(found)


class TurnLimiter:
    """At most ``limit`` turns in flight per tenant; one more is a 429 at once."""

    def __init__(self, limit: int, *, retry_after: int) -> None:
        self.limit = limit
        self.retry_after = retry_after
        self.in_flight: dict[str | None, int] = {}

    def acquire(self, tenant: Tenant) -> None:
        current = self.in_flight.get(tenant.name, 0)
        if current >= self.limit:
            raise APIError(
                429,
                f"too many turns in flight for this key: {self.limit} at once, the limit "
                "max_concurrent_turns (chatctx serve --max-concurrent-turns N raises it; turns "
                f"beyond the model's slots wait in line for one); retry after {self.retry_after} s",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(self.retry_after)},
            )
        self.in_flight[tenant.name] = current + 1

    def release(self, tenant: Tenant) -> None:
        left = self.in_flight.get(tenant.name, 0) - 1
        if left > 0:
            self.in_flight[tenant.name] = left
        else:
            self.in_flight.pop(tenant.name, None)

    @property
    def total(self) -> int:
        return sum(self.in_flight.values())


class _Entry:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0  # holding or waiting


class ConversationLocks:
    """One turn per conversation at a time; a later one waits, then 409 after ``wait_s``."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._entries: dict[str, _Entry] = {}

    async def acquire(self, stored_id: str) -> None:
        entry = self._entries.setdefault(stored_id, _Entry())
        entry.users += 1
        try:
            async with asyncio.timeout(self.wait_s):  # no task per acquire, as wait_for has
                await entry.lock.acquire()
        except TimeoutError:
            self._drop(stored_id, entry)
            raise APIError(
                409,
                f"another turn of this conversation is still in flight after "
                f"{self.wait_s:g} s; retry when it has finished",
                code="conversation_busy",
            ) from None
        except BaseException:
            self._drop(stored_id, entry)
            raise

    def release(self, stored_id: str) -> None:
        entry = self._entries[stored_id]
        entry.lock.release()
        self._drop(stored_id, entry)

    def busy(self, stored_id: str) -> bool:
        entry = self._entries.get(stored_id)
        return entry is not None and entry.users > 0

    def _drop(self, stored_id: str, entry: _Entry) -> None:
        entry.users -= 1
        if entry.users == 0 and self._entries.get(stored_id) is entry:
            del self._entries[stored_id]
