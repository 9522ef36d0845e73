"""A support bot serving more customers at once than the model has slots.

One model is loaded with a few slots (KV sequences of ``--n-ctx`` tokens each). Every customer
has a persisted conversation, reopened by id for each message, and every message is answered
concurrently (``asyncio`` with ``ChatSession.asend``): each turn leases a slot from the
engine's pool, waits while all are busy, and its decoding is batched with the other
customers'. A customer whose slot went to someone else in the meantime has their KV cache
swapped out to RAM (or disk) and restored when they write again, so nothing is re-evaluated.

Customers write in rounds: all of them send their first message, read the replies, then send
the next, so each comes back after others have used the slots. Replies are printed per round,
each turn's figures are logged (stderr), and a summary of the pool ends the run. TTFT counts
from the request, so it includes waiting for a slot; "engine" is the engine's own share.

    python examples/support_bot.py                       # embedded SmolLM2, ./support_bot.db
    python examples/support_bot.py --model my-llama3.gguf --db sqlite:///bot.db --slots 3
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from chatctx import ChatSession, Engine, Reply, Store, Turn

POLICIES = (
    "You are Ava, the support assistant of Nimbus Home Networks. Be brief and friendly. "
    "Routers have a 2-year warranty. Replacements ship within 3 business days. Refunds only "
    "within 30 days of delivery. Never ask for a full card number."
)

INBOX = {  # customer: their messages, in the order they write them
    "cust-42": [
        "Hi! My Nimbus AX3000 keeps dropping the wifi. Order NH-48213.",
        "I updated the firmware and it still drops. Can I get a replacement?",
        "Thanks. What was my order number again?",
    ],
    "cust-77": [
        "Can I still return a router I bought 20 days ago?",
        "Great, how long does the refund take?",
    ],
    "cust-13": [
        "My mesh node blinks orange since this morning.",
        "Unplugging it did not help. What now?",
        "It is green again, thank you!",
    ],
    "cust-58": [
        "Do you ship replacements to Canada?",
        "And how long does that take?",
    ],
    "cust-91": [
        "The app asks for my card number to register the router. Is that normal?",
        "OK, I will not enter it. How do I register then?",
        "Done, thanks.",
    ],
    "cust-26": [
        "Is the AX3000 still under warranty after 18 months?",
        "It has a cracked antenna. Is that covered?",
    ],
}

log = logging.getLogger("support_bot")


def log_turn(turn: Turn) -> None:
    if turn.swap_in:
        swap = f"{turn.swap_in} ({(turn.swap_in_bytes or 0) / 1024:.1f} KiB, "
        swap += f"{turn.swap_in_ms or 0:.1f} ms)"
    elif turn.reprefill_reason:
        swap = f"refused, re-prefilled ({turn.reprefill_reason})"
    else:
        swap = "none"
    log.info(
        "%s turn %d: slot %d, swap-in %s, prompt %d tok (reused %d, evaluated %d), "
        "batch max %d, TTFT %.0f ms (engine %.0f ms)",
        turn.conversation_id,
        turn.id,
        turn.slot,
        swap,
        turn.prompt_tokens,
        turn.reused_tokens,
        turn.evaluated_tokens,
        turn.batch_max or 1,
        turn.ttft_ms or 0,
        turn.engine_ttft_ms or 0,
    )


async def answer(engine: Engine, store: Store, customer: str, text: str, max_tokens: int) -> Reply:
    """One message of ``customer``: reopen their conversation and wait for the reply."""
    with ChatSession.open(
        store,
        conversation_id=customer,
        model=engine,  # shared: no seq_id, so each turn leases a slot from the pool
        system_prompt=POLICIES,
        settings={"max_tokens": max_tokens, "seed": 1},
    ) as chat:
        return await chat.asend(text)


async def serve(engine: Engine, store: Store, max_tokens: int) -> None:
    rounds = max(len(messages) for messages in INBOX.values())
    for r in range(rounds):
        waiting = [(c, messages[r]) for c, messages in INBOX.items() if r < len(messages)]
        replies = await asyncio.gather(
            *(answer(engine, store, c, text, max_tokens) for c, text in waiting)
        )
        # Printed once the round is answered, so no reply cuts into another.
        for (customer, text), reply in zip(waiting, replies, strict=True):
            print(f"\n[{customer}] {text}\n[ava] {reply.text}", flush=True)
            if reply.turn is not None:
                log_turn(reply.turn)


def pool_summary(engine: Engine) -> str:
    info = engine.info()
    c: dict[str, Any] = engine.slot_table()["counters"]
    steps = c["batch_steps"]
    mean = c["batch_sequences"] / steps if steps else 0.0
    return (
        f"pool: {info.slots} slots of {info.n_ctx} tokens ({info.kv_cells} KV cells) "
        f"for {len(INBOX)} customers\n"
        f"swap-ins: {c['swap_in_ram']} from RAM, {c['swap_in_disk']} from disk "
        f"({c['swap_in_bytes'] / 2**20:.1f} MiB, {c['swap_in_ms']:.0f} ms); "
        f"swap-outs: {c['swap_out']}; re-prefills: {c['reprefill']}\n"
        f"batching: {steps} decode steps, {mean:.2f} sequences per step on average, "
        f"{c['batch_max']} at most"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="sqlite:///support_bot.db")
    parser.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--n-ctx", type=int, default=2048, help="one conversation's context")
    parser.add_argument("--slots", type=int, default=2, help="conversations cached at once")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    log.setLevel(logging.INFO)  # the turn figures; the libraries stay at warnings

    with (
        Engine.load(args.model, n_ctx=args.n_ctx, slots=args.slots) as engine,
        Store(args.db) as store,  # one store for every customer's conversation
    ):
        asyncio.run(serve(engine, store, args.max_tokens))
        print(f"\n{pool_summary(engine)}")


if __name__ == "__main__":
    main()
