"""Synthetic support-agent conversations with tool calls, for ``bench/agent_bench.py``.

    .venv/bin/python bench/agent_traces.py --conversations 40 --seed 1 > traces.jsonl

Each conversation is a customer's chat with an agent that looks orders up, tracks parcels,
reads knowledge-base articles and opens tickets: OpenAI-format messages (the assistant's
``tool_calls``, ``role: tool`` results as JSON, the final answer), 30-40 user turns. Tool
results are realistic and varied: orders with items, prices and addresses, shipment
histories, KB articles of roughly 500-2,000 tokens. Each conversation plants facts that only
a tool result holds (a tracking number, a ticket id, an article's figure); the agent's answer
does not repeat them, and the customer asks for them back 5-25 turns later ("probes":
``{"fact", "asked_turn"}``, the replay's format).

The vocabulary lives here, in the benchmark: nothing in ``chatctx/`` or its tests knows it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from typing import Any

FIRST = ["Ana", "Bilal", "Chen", "Dara", "Emeka", "Freya", "Goran", "Hana", "Iker", "Jun"]
LAST = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Silva", "Novak", "Haddad", "Kowalski"]
CITIES = ["Porto", "Leeds", "Graz", "Osaka", "Tucson", "Lyon", "Gdansk", "Cork", "Bergen"]
STREETS = ["Elm Street", "Harbour Road", "Mill Lane", "Kingsway", "Rue Verte", "Parkallee"]
PRODUCTS = [
    ("espresso machine", 189.95),
    ("standing desk", 429.0),
    ("noise-cancelling headphones", 249.49),
    ("hiking boots", 139.5),
    ("cast iron pan", 54.9),
    ("robot vacuum", 319.99),
    ("bike helmet", 79.25),
    ("air purifier", 212.75),
    ("mechanical keyboard", 119.39),
    ("baby monitor", 98.15),
]
CARRIERS = ["DHL", "UPS", "GLS", "PostNord", "Yamato", "FedEx"]
EVENTS = [
    "label created",
    "picked up by carrier",
    "arrived at sorting centre",
    "departed sorting centre",
    "customs clearance started",
    "customs cleared",
    "arrived at local depot",
    "out for delivery",
    "delivery attempted, recipient absent",
    "held at depot",
]
TOPICS = [
    ("returns", "returning an item"),
    ("warranty", "warranty claims"),
    ("delivery", "delivery times and options"),
    ("payments", "payment methods and refunds"),
    ("accounts", "account security"),
    ("repairs", "repairs and spare parts"),
]
KB_SENTENCES = [
    "Customers who {verb} should first check that the {thing} is complete and undamaged.",
    "Our team reviews every request within {n} working days of receiving it.",
    "If the {thing} was a gift, the person who received it can start the process too.",
    "Items marked as final sale are excluded unless they arrived faulty.",
    "We send an email confirmation as soon as the {thing} has been registered.",
    "Please keep the original packaging until the case is closed, as carriers may ask for it.",
    "A prepaid label is included for customers in the {region} region.",
    "Customers in other regions pay the shipping cost, which we refund if the item is faulty.",
    "Refunds go back to the original payment method; bank transfers can take longer.",
    "The process is the same for items bought in our stores and online.",
    "For large items we arrange a collection slot with the carrier by phone.",
    "Business customers can ask their account manager to handle the {thing} for them.",
    "Opened software, gift cards and personalised items cannot be returned.",
    "When a replacement is out of stock we offer a refund or a comparable model.",
    "You will find the case history in your account under Orders, then Requests.",
    "Photos of the damage speed up the assessment considerably.",
    "Our partner workshops in {city} and {city2} handle most repairs on site.",
    "A loan device can be provided for repairs expected to take longer than a week.",
]
REGIONS = ["EU", "Nordic", "UK", "Pacific", "North American"]
SMALL_TALK = [
    ("Hi, I have a few questions about my orders.", "Hello! Happy to help, what can I do?"),
    ("Thanks, that helps.", "You're welcome."),
    ("Sorry, I had to step away for a moment.", "No problem, take your time."),
    ("Is your support open on weekends?", "Yes, chat support is open every day from 8 to 20."),
    ("Can I change my email address in the account?", "Yes, under Settings, then Profile."),
    ("Do you ship to other countries?", "We ship to most of Europe, the UK and Japan."),
    ("Okay.", "Is there anything else I can help with?"),
    ("My neighbour ordered the same thing last month.", "I hope they are happy with it!"),
    ("Great, thank you for checking.", "Anytime."),
    ("I'm comparing a few products before buying more.", "Sure, let me know if I can help."),
]


def _code(rng: random.Random, prefix: str, digits: int) -> str:
    return prefix + "".join(rng.choice("0123456789") for _ in range(digits))


def _call(rng: random.Random, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    call_id = "call_" + "".join(
        rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(12)
    )
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


class Conversation:
    """One customer's chat, built turn by turn."""

    def __init__(self, rng: random.Random, number: int) -> None:
        self.rng = rng
        self.id = f"agent-{number:03d}"
        self.name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        self.turns: list[tuple[str, list[dict[str, Any]]]] = []
        self.probes: list[dict[str, Any]] = []
        self.asks: list[tuple[int, str, str]] = []  # (ask at turn, question, fact)
        self.orders: list[str] = []

    def plain(self) -> None:
        user, answer = self.rng.choice(SMALL_TALK)
        self.turns.append((user, [{"role": "assistant", "content": answer}]))

    def _tool_turn(
        self, user: str, name: str, arguments: dict[str, Any], result: Any, answer: str
    ) -> None:
        call = _call(self.rng, name, arguments)
        self.turns.append(
            (
                user,
                [
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)},
                    {"role": "assistant", "content": answer},
                ],
            )
        )

    def _ask_later(self, question: str, fact: str) -> None:
        at = len(self.turns) + self.rng.randint(5, 25)
        self.asks.append((at, question, fact))

    def order_lookup(self) -> None:
        rng = self.rng
        order = _code(rng, "ORD-", 6)
        self.orders.append(order)
        items = rng.sample(PRODUCTS, rng.randint(1, 4))
        lines = [
            {"sku": _code(rng, "SKU", 5), "name": n, "qty": rng.randint(1, 2), "unit_price": p}
            for n, p in items
        ]
        total = f"{sum(line['qty'] * line['unit_price'] for line in lines):.2f}"
        street = f"{rng.randint(2, 180)} {rng.choice(STREETS)}"
        result = {
            "order_id": order,
            "customer": self.name,
            "status": rng.choice(["processing", "shipped", "delivered", "partially shipped"]),
            "placed_at": f"2026-{rng.randint(1, 11):02d}-{rng.randint(1, 28):02d}",
            "items": lines,
            "total": f"{total} EUR",
            "shipping_address": {"street": street, "city": rng.choice(CITIES)},
            "payment": {
                "method": rng.choice(["card", "PayPal", "invoice"]),
                "last4": _code(rng, "", 4),
            },
            "warehouse": rng.choice(["WH-North", "WH-Central", "WH-Port"]),
        }
        self._tool_turn(
            f"Can you look up my order {order}?",
            "lookup_order",
            {"order_id": order},
            result,
            "I found the order; everything is registered and I can see its status and items.",
        )
        self._ask_later(f"What was the total of order {order} again?", total)

    def shipment(self) -> None:
        rng = self.rng
        # One parcel per order: a question about an order's parcel has one answer.
        order = self.orders.pop(rng.randrange(len(self.orders))) if self.orders else None
        order = order or _code(rng, "ORD-", 6)
        tracking = _code(rng, rng.choice(["1Z", "JD", "LX", "RR"]), 10)
        carrier = rng.choice(CARRIERS)
        history = [
            {
                "at": f"2026-11-{day:02d}T{rng.randint(6, 21):02d}:{rng.randint(0, 59):02d}",
                "event": event,
                "location": rng.choice(CITIES),
            }
            for day, event in zip(
                range(rng.randint(1, 9), 30), EVENTS[: rng.randint(3, len(EVENTS))], strict=False
            )
        ]
        result = {
            "order_id": order,
            "carrier": carrier,
            "tracking_number": tracking,
            "service": rng.choice(["standard", "express", "economy"]),
            "weight_kg": round(rng.uniform(0.3, 24.0), 1),
            "events": history,
            "estimated_delivery": f"2026-12-{rng.randint(1, 20):02d}",
        }
        self._tool_turn(
            f"Where is the parcel for {order}?",
            "track_shipment",
            {"order_id": order},
            result,
            "Your parcel is on its way; the carrier has scanned it several times this week.",
        )
        self._ask_later(f"Sorry, what was the tracking number for order {order}?", tracking)

    def article(self) -> None:
        rng = self.rng
        topic, about = rng.choice(TOPICS)
        article_id = _code(rng, "KB-", 5)
        figure = rng.randint(14, 120)
        sentences = []
        for _ in range(rng.randint(25, 110)):
            sentences.append(
                rng.choice(KB_SENTENCES).format(
                    verb=f"need help with {about}",
                    thing=rng.choice(["item", "request", "claim", "parcel"]),
                    n=rng.randint(2, 9),
                    region=rng.choice(REGIONS),
                    city=rng.choice(CITIES),
                    city2=rng.choice(CITIES),
                )
            )
        planted = f"For {about}, the deadline is {figure} days after delivery."
        sentences.insert(rng.randint(0, len(sentences)), planted)
        result = {
            "article_id": article_id,
            "title": f"Everything about {about}",
            "updated": f"2026-{rng.randint(1, 11):02d}-01",
            "body": " ".join(sentences),
        }
        self._tool_turn(
            f"What are your rules for {about}?",
            "search_kb",
            {"query": topic},
            result,
            f"I checked our help centre article about {about}; the main points are the "
            "deadline, the packaging and how refunds are paid.",
        )
        self._ask_later(f"How many days was the deadline for {about} again?", f"{figure} days")

    def ticket(self) -> None:
        rng = self.rng
        ticket = _code(rng, "TCK-", 7)
        product = rng.choice(PRODUCTS)[0]
        result = {
            "ticket_id": ticket,
            "subject": f"damaged {product}",
            "queue": rng.choice(["returns", "damaged goods", "billing", "delivery"]),
            "priority": rng.choice(["normal", "high"]),
            "sla_hours": rng.choice([24, 48, 72]),
            "assignee": f"{rng.choice(FIRST)} ({rng.choice(['team A', 'team B', 'night shift'])})",
        }
        self._tool_turn(
            f"The {product} arrived damaged, can you open a case?",
            "open_ticket",
            {"subject": f"damaged {product}", "customer": self.name},
            result,
            "I've opened a case for you; our team will be in touch.",
        )
        self._ask_later(f"What was the ticket number for the damaged {product}?", ticket)


def conversation(rng: random.Random, number: int) -> dict[str, Any]:
    chat = Conversation(rng, number)
    length = rng.randint(30, 40)
    actions = [chat.order_lookup, chat.shipment, chat.article, chat.ticket]
    while len(chat.turns) < length:
        due = [a for a in chat.asks if a[0] <= len(chat.turns)]
        if due:
            _, question, fact = due[0]
            chat.asks.remove(due[0])
            chat.probes.append({"fact": fact, "asked_turn": len(chat.turns)})
            chat.turns.append(
                (question, [{"role": "assistant", "content": "Let me check that for you."}])
            )
        elif rng.random() < 0.45:
            rng.choice(actions)()
        else:
            chat.plain()
    system = "You are the support agent of an online shop. Use the tools to answer."
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for user, logged in chat.turns:
        messages.append({"role": "user", "content": user})
        messages += logged
    return {
        "id": chat.id,
        "messages": messages,
        "probes": chat.probes,
    }


def traces(count: int, seed: int) -> Iterator[dict[str, Any]]:
    rng = random.Random(seed)
    for number in range(count):
        yield conversation(rng, number)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    for trace in traces(args.conversations, args.seed):
        sys.stdout.write(json.dumps(trace) + "\n")


if __name__ == "__main__":
    main()
