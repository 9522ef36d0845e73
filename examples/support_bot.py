"""A small support bot embedding chatctx.ChatSession.

Each customer gets a persisted conversation (reopened on their next message), the system
prompt carries the shop's policies, replies stream as they are generated, and every turn's
KV-cache figures are logged.

    python examples/support_bot.py                       # embedded SmolLM2, ./support_bot.db
    python examples/support_bot.py --model my-llama3.gguf --db sqlite:///bot.db
"""

from __future__ import annotations

import argparse
import logging
import sys

from chatctx import ChatSession, Engine, Turn

POLICIES = (
    "You are Ava, the support assistant of Nimbus Home Networks. Be brief and friendly. "
    "Routers have a 2-year warranty. Replacements ship within 3 business days. Refunds only "
    "within 30 days of delivery. Never ask for a full card number."
)

INBOX = [  # (customer, message), as they might arrive
    ("cust-42", "Hi! My Nimbus AX3000 keeps dropping the wifi. Order NH-48213."),
    ("cust-77", "Can I still return a router I bought 20 days ago?"),
    ("cust-42", "I updated the firmware and it still drops. Can I get a replacement?"),
    ("cust-77", "Great, how long does the refund take?"),
    ("cust-42", "Thanks. What was my order number again?"),
]

log = logging.getLogger("support_bot")


def log_turn(turn: Turn) -> None:
    log.info(
        "%s turn %d: prompt %d tok (reused %d, evaluated %d, evicted %s, shifted %s), "
        "KV cells %s, TTFT %.0f ms",
        turn.conversation_id,
        turn.id,
        turn.prompt_tokens,
        turn.reused_tokens,
        turn.evaluated_tokens,
        turn.evicted_tokens,
        turn.shifted_tokens,
        turn.cells_used,
        turn.ttft_ms or 0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="sqlite:///support_bot.db")
    parser.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--n-ctx", type=int, default=2048)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    # One model for every customer, one KV sequence (slot) per customer so each keeps its
    # cached prompt while the others talk, plus a spare sequence for summaries.
    customers = sorted({customer for customer, _ in INBOX})
    slots = {customer: seq for seq, customer in enumerate(customers)}
    with Engine.load(args.model, n_ctx=args.n_ctx, n_seq_max=len(customers) + 1) as engine:
        for customer, text in INBOX:
            turns: list[Turn] = []
            with ChatSession.open(
                args.db,
                conversation_id=customer,
                model=engine,
                seq_id=slots[customer],
                system_prompt=POLICIES,
                settings={"max_tokens": args.max_tokens, "seed": 1},
                on_turn=turns.append,
            ) as chat:
                print(f"\n[{customer}] {text}\n[ava] ", end="", flush=True)
                for chunk in chat.stream(text):
                    print(chunk, end="", flush=True)
                print(flush=True)
            for turn in turns:  # after the reply, so the log does not cut into it
                log_turn(turn)


if __name__ == "__main__":
    main()
