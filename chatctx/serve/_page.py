"""The live cache page: ``GET /`` (plain HTML and a small script) and ``GET /v1/cache``.

The page polls ``/v1/cache`` every second: the slots and the conversation in each, cells
used against the slot's room, swapped conversations (RAM or disk), and the hit ratio and
TTFT of the last turns. With keys, a tenant sees its own conversations by name and the
others' only as occupied slots; the page takes its key from ``#key=...`` in its address
(the fragment never reaches the server's log) or from a field on the page.
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from chatctx.monitor import SlotTable, percentile
from chatctx.serve._routes import ServiceDep, TenantDep, slot_table
from chatctx.serve._service import Service
from chatctx.serve._tenants import Tenant

page_router = APIRouter()
RECENT_TURNS = 50


def _name(tenant: Tenant, owner: str | None) -> dict[str, Any]:
    """How a slot's or a swap's owner is shown to ``tenant``."""
    if owner is None:
        return {"conversation": None, "kind": "free"}
    if owner.startswith("stateless:"):
        return {"conversation": None, "kind": "stateless"}
    if tenant.owns(owner):
        return {"conversation": tenant.client_id(owner), "kind": "conversation"}
    return {"conversation": None, "kind": "other"}


def cache_view(service: Service, tenant: Tenant) -> dict[str, Any]:
    """What the cache page shows, as ``tenant`` may see it."""
    table: SlotTable | None = slot_table(service)
    backend = service.backend
    room = backend.n_ctx if backend is not None and not backend.closed else None
    slots = []
    swapped = []
    counters: dict[str, Any] = {}
    if table is not None:
        room = table.n_ctx
        for row in table.slots:
            slots.append(
                {
                    "slot": row.slot,
                    "seq_id": row.seq_id,
                    **_name(tenant, row.conversation),
                    "cells": row.cells,
                    "room": table.n_ctx,
                    "leased": row.leased,
                    "last_use": row.last_use.isoformat() if row.last_use else None,
                }
            )
        for swap in table.swapped:
            swapped.append(
                {
                    **_name(tenant, swap.conversation),
                    "where": swap.where,
                    "tokens": swap.tokens,
                    "bytes": swap.bytes,
                    "saved_at": swap.saved_at.isoformat(),
                }
            )
        counters = {
            key: table.counters[key]
            for key in ("swap_out", "swap_in_ram", "swap_in_disk", "reprefill", "batch_max")
        }
        counters["ram_bytes"] = table.counters["ram_bytes"]
        counters["disk_bytes"] = table.counters["disk_bytes"]
    elif backend is not None and not backend.closed:
        usage = backend.kv_usage()
        slots = [
            {"slot": seq, "seq_id": seq, "conversation": None, "kind": "unknown", "cells": cells}
            | {"room": room, "leased": None, "last_use": None}
            for seq, cells in sorted(usage.items())
        ]
    recent = [
        {k: v for k, v in entry.items() if k != "tenant"}
        for entry in list(service.recent)  # a copy: the event loop appends meanwhile
        if tenant.name is None or entry["tenant"] == tenant.name
    ][-RECENT_TURNS:]
    prompt = sum(r["prompt_tokens"] for r in recent)
    ttfts = [r["ttft_ms"] for r in recent if r["ttft_ms"] is not None]
    queued = [r["queue_ms"] for r in recent if r.get("queue_ms") is not None]
    return {
        "model": service.model_id if service.loaded else None,
        "ready": service.loaded,
        "draining": service.draining,
        "updated_at": time.time(),
        "room": room,
        "slots": slots,
        "swapped": swapped,
        "counters": counters,
        "turns_in_flight": len(service.cancels),
        "recent_turns": recent,
        "summary": {
            "turns": len(recent),
            "hit_ratio": sum(r["cached_tokens"] for r in recent) / prompt if prompt else None,
            "ttft_p50_ms": percentile(ttfts, 50),
            "ttft_p95_ms": percentile(ttfts, 95),
            "queue_p50_ms": percentile(queued, 50),
            "queue_p95_ms": percentile(queued, 95),
        },
    }


@page_router.get("/v1/cache", tags=["operations"])
async def cache(tenant: TenantDep, service: ServiceDep) -> dict[str, Any]:
    """The cache page's data: slots, swaps and the last turns (this tenant's)."""
    return await asyncio.to_thread(cache_view, service, tenant)


@page_router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def page() -> HTMLResponse:
    """The live cache page."""
    html = resources.files("chatctx.serve").joinpath("page.html").read_text(encoding="utf-8")
    return HTMLResponse(html)
