"""Long synthetic support conversations with planted facts, for benchmarks and probes.

Deterministic for a seed. Facts (an order number, a name, a device model, a ticket, an email)
are planted early; much later the user asks for them back. Each conversation carries a
``probes`` list: ``{"fact", "kind", "planted_turn", "asked_turn", "question"}`` (turns are
0-based user-turn indexes).
"""

from __future__ import annotations

import random
from typing import Any

SYSTEM_PROMPT = (
    "You are Ava, the support assistant of Nimbus Home Networks. Be brief and friendly. "
    "Routers have a 2-year warranty; replacements ship within 3 business days; refunds only "
    "within 30 days of delivery; never ask for a full card number."
)

_FIRST = ("Maria", "Jonas", "Aiko", "Priya", "Tomasz", "Fatima", "Liam", "Sofia", "Chen", "Omar")
_LAST = ("Lopez", "Berg", "Tanaka", "Sharma", "Nowak", "Haddad", "Walsh", "Rossi", "Wei", "Khan")
_MODELS = ("AX3000", "AX5400 Pro", "Mesh M2", "Beam 6E", "HomeHub 4", "AX1800 Lite")
_TOPICS = (
    (
        "the wifi keeps dropping every few minutes",
        "Let's check the firmware first: open the "
        "Nimbus app, go to Settings > System and tap Update. Then restart the router.",
    ),
    (
        "the 5 GHz network does not show up on my laptop",
        "Some older laptops only see channels "
        "36 to 48. In the app, set the 5 GHz channel to 36 and save.",
    ),
    (
        "the speed is much slower than my plan",
        "Please run a speed test with a cable plugged "
        "into port 1. If the wired speed is fine, the issue is wireless interference.",
    ),
    (
        "the status light is blinking orange",
        "Orange blinking means no internet from the "
        "modem. Power-cycle the modem, wait two minutes, then restart the router.",
    ),
    (
        "my smart plugs cannot connect",
        "Smart plugs often need 2.4 GHz only. Turn on the "
        "separate 2.4 GHz network under Wireless > Advanced.",
    ),
    (
        "the parental controls stopped working",
        "Open Family in the app, pick the profile and "
        "re-enable the schedule. Changes apply within a minute.",
    ),
    (
        "I want to change the admin password",
        "Go to Settings > Security > Admin password. Use at least 12 characters.",
    ),
    (
        "the guest network asks for a password I never set",
        "The guest password is printed in the app under Wireless > Guest. You can change it there.",
    ),
)
_FILLER_USER = (
    "I tried that but it did not help.",
    "Okay, doing it now.",
    "That worked for a while.",
    "Can you explain that step again?",
    "The app shows something different on my phone.",
    "Is there anything else I can check?",
    "It happened again this morning.",
)
_FILLER_ASSISTANT = (
    "Thanks for checking. Let's try one more thing: move the router away from the microwave "
    "and other electronics, and keep it off the floor.",
    "I understand. Could you tell me which devices are affected, and whether they are on "
    "the 2.4 GHz or the 5 GHz network?",
    "Good. Leave it running for an hour and tell me if the problem comes back. I will keep "
    "this case open in the meantime.",
    "No problem. Open the app, tap the router icon, then Advanced. You will see the channel "
    "list there; pick the one with the fewest neighbours.",
)


def _facts(rng: random.Random) -> dict[str, str]:
    name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    return {
        "order": f"NH-{rng.randint(10000, 99999)}",
        "name": name,
        "model": rng.choice(_MODELS),
        "ticket": f"T-{rng.randint(1000, 9999)}",
        "email": f"{name.split()[0].lower()}.{rng.randint(10, 99)}@example.net",
    }


_PLANT = {
    "order": ("My order number is {v}.", "Thanks, I found order {v} in our system."),
    "name": ("By the way, my name is {v}.", "Nice to meet you, {v}."),
    "model": ("The router is a Nimbus {v}.", "Got it, the {v}."),
    "ticket": ("Support gave me ticket {v} last week.", "I see ticket {v}; I'll add notes."),
    "email": ("You can reach me at {v}.", "I've noted {v} for updates."),
}
_ASK = {
    "order": "Sorry, what was my order number again?",
    "name": "Do you still remember my name?",
    "model": "Which router model did I mention I have?",
    "ticket": "What was the ticket number I mentioned?",
    "email": "Which email address did I give you?",
}


def support_conversation(
    turns: int = 150, *, seed: int = 0, conversation_id: str | None = None
) -> dict[str, Any]:
    """One conversation of ``turns`` user turns, OpenAI format plus ``probes``."""
    rng = random.Random(seed)
    facts = _facts(rng)
    kinds = list(facts)
    plant_at = {kind: min(turns - 1, 1 + i * 2) for i, kind in enumerate(kinds)}
    ask_after = max(turns // 2, max(plant_at.values()) + 1)
    ask_slots = sorted(
        rng.sample(range(ask_after, turns), k=min(len(kinds), max(0, turns - ask_after)))
    )
    ask_at = dict(zip(kinds, ask_slots, strict=False))
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    topic = rng.choice(_TOPICS)
    for turn in range(turns):
        planted = [k for k, t in plant_at.items() if t == turn]
        asked = [k for k, t in ask_at.items() if t == turn]
        if turn % 12 == 0:
            topic = rng.choice(_TOPICS)
            user, reply = f"Hi, {topic[0]}.", topic[1]
        else:
            user, reply = rng.choice(_FILLER_USER), rng.choice(_FILLER_ASSISTANT)
        for kind in planted:
            say, ack = _PLANT[kind]
            user = f"{user} {say.format(v=facts[kind])}"
            reply = f"{ack.format(v=facts[kind])} {reply}"
        for kind in asked:
            user = _ASK[kind]
            reply = f"It is {facts[kind]}."
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": reply})
    probes = [
        {
            "fact": facts[k],
            "kind": k,
            "planted_turn": plant_at[k],
            "asked_turn": ask_at[k],
            "question": _ASK[k],
        }
        for k in kinds
        if k in ask_at
    ]
    return {"id": conversation_id or f"synthetic-{seed}", "messages": messages, "probes": probes}
