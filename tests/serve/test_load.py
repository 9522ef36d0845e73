"""Load: 32 concurrent clients x 10 stateful turns on 4 slots, four tenants of eight. No
errors, no lost message (the database is the oracle); p95 TTFT under load against one
client alone is reported (``load.json`` in the test's tmp dir, and printed)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from chatctx.monitor import percentile
from tests.serve.conftest import ServerProcess

CLIENTS = 32
TURNS = 10
TENANTS = {f"sk-load-tenant-{t}": f"tenant{t}" for t in range(4)}


async def client_run(
    base_url: str, key: str, conversation: str, turns: int
) -> tuple[list[tuple[str, str]], list[float], list[Any]]:
    """One customer: ``turns`` streamed turns sending only the new message."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)
    sent: list[tuple[str, str]] = []
    ttfts: list[float] = []
    usages: list[Any] = []
    try:
        for turn in range(turns):
            question = f"{conversation} asks question {turn}: where is my parcel?"
            started = time.perf_counter()
            stream = await client.chat.completions.create(
                model="chatctx",
                messages=[{"role": "user", "content": question}],
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"conversation": conversation},
            )
            parts: list[str] = []
            first: float | None = None
            async for chunk in stream:
                if chunk.choices:
                    if first is None:
                        first = time.perf_counter() - started
                    parts.append(chunk.choices[0].delta.content or "")
                else:
                    usages.append(chunk.usage)
            assert first is not None
            ttfts.append(first * 1000)
            sent.append((question, "".join(parts)))
    finally:
        await client.close()
    return sent, ttfts, usages


@pytest.mark.slow
def test_32_clients_10_turns_on_4_slots(
    tiny_llama3_path: Path, start_server: Any, tmp_path: Path
) -> None:
    server: ServerProcess = start_server(
        tiny_llama3_path, "--n-ctx", "1024", "--slots", "4", keys=TENANTS
    )
    base = f"{server.url}/v1"
    keys = list(TENANTS)

    _, alone_ttfts, _ = asyncio.run(client_run(base, keys[0], "alone", TURNS))

    async def everyone() -> list[Any]:
        runs = [client_run(base, keys[i % 4], f"load-{i}", TURNS) for i in range(CLIENTS)]
        return await asyncio.gather(*runs, return_exceptions=True)

    started = time.perf_counter()
    results = asyncio.run(everyone())
    elapsed = time.perf_counter() - started
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors == [], errors[:3]

    lost = 0
    with server.store() as store:
        for i, (sent, _, usages) in enumerate(results):
            stored_id = f"{TENANTS[keys[i % 4]]}:load-{i}"
            history = [(m.role, m.content, m.status) for m in store.messages(stored_id)]
            expected = [
                (role, text, "complete")
                for question, reply in sent
                for role, text in (("user", question), ("assistant", reply))
            ]
            lost += sum(1 for item in expected if item not in history)
            assert history == expected, stored_id
            turns = store.turns(stored_id)
            assert [t.prompt_tokens for t in turns] == [u.prompt_tokens for u in usages]
            assert [t.reused_tokens for t in turns] == [
                u.prompt_tokens_details.cached_tokens for u in usages
            ]
        all_turns = [t for c in store.list_conversations() for t in store.turns(c.id)]
    assert lost == 0
    load_ttfts = [t for _, ttfts, _ in results for t in ttfts]
    swapped_in = sum(1 for t in all_turns if t.swap_in is not None)
    report = {
        "clients": CLIENTS,
        "turns_per_client": TURNS,
        "slots": 4,
        "errors": len(errors),
        "lost_messages": lost,
        "elapsed_s": round(elapsed, 1),
        "turns_per_s": round(CLIENTS * TURNS / elapsed, 2),
        "ttft_alone_p50_ms": round(percentile(alone_ttfts, 50) or 0, 1),
        "ttft_alone_p95_ms": round(percentile(alone_ttfts, 95) or 0, 1),
        "ttft_load_p50_ms": round(percentile(load_ttfts, 50) or 0, 1),
        "ttft_load_p95_ms": round(percentile(load_ttfts, 95) or 0, 1),
        "turns_restored_from_swap": swapped_in,
        "max_batch": max(t.batch_max or 1 for t in all_turns),
    }
    report["p95_ratio_load_vs_alone"] = round(
        report["ttft_load_p95_ms"] / max(report["ttft_alone_p95_ms"], 1e-9), 2
    )
    (tmp_path / "load.json").write_text(json.dumps(report, indent=2))
    print("\nload:", json.dumps(report))
    assert report["max_batch"] > 1  # the turns really were batched together
    assert swapped_in > 0  # 33 conversations on 4 slots: caches went to RAM and came back
