"""Build the everyday-fact probe set from real two-person chats (issue 10.5).

    pip install --no-deps chitchat-dataset==0.9.0     # the data (MIT), not a chatctx dependency
    .venv/bin/python bench/facts/build_probes.py [--source dataset.json] [-o FILE]

Source: the Chit-Chat Challenge corpus of BYU's PCC lab (PyPI ``chitchat-dataset`` 0.9.0,
MIT licence): 7,168 free-form chats between two people typing to each other, 278 of them with
50 or more exchanges. Each chosen chat is used as it is, alone (no chaining): its first
speaker is the "user", the other the "assistant"; consecutive lines a person typed form one
message (joined with newlines); chats longer than 250 user turns are cut there.

Into each chat, 3 facts (4 in chats of 100+ user turns) are planted in early user turns, the
way people say things in passing (added to what the user was already typing), and asked back
30-200 user turns later in other words, replacing that user turn. The fact string is the one
canonical answer the replay looks for, case-insensitively, in the context sent with the
question; it never occurs anywhere else in the chat (checked).

The templates were written after the extractive summarizer's patterns, without looking at
them, and are split in two halves: ``dev`` (the only ones looked at while tuning the
summarizer) and ``heldout`` (never tuned against). The probe's ``split`` says which; bench
results are reported for both. Deterministic: the same source gives the same file.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "everyday_probes.jsonl.gz"
SEED = 20261130
CONVERSATIONS = 40
MAX_TURNS = 250
MIN_TURNS = 50

# kind -> (values, plant templates, questions). Templates alternate dev / heldout by index:
# even index = dev, odd = heldout. {v} is the fact string exactly as probed.
KINDS: dict[str, tuple[list[str], list[str], list[str]]] = {
    "allergy": (
        ["shellfish", "penicillin", "peanuts", "bee stings", "kiwi", "sesame", "latex"],
        [
            "oh and I'm allergic to {v} btw",
            "{v} and me do not get along, I swell up like a balloon",
            "i cant have {v}, found that out in the ER last year",
            "ugh had a reaction to {v} again, hives everywhere",
            "fyi im allergic to {v} so no surprises lol",
            "note to self stay away from {v}. last time was scary",
        ],
        [
            "what am I allergic to again?",
            "remind me what gives me hives",
            "what was the thing I react badly to?",
        ],
    ),
    "parking": (
        ["level four", "level 2", "row G7", "section B12", "the third floor", "spot 41"],
        [
            "I parked on {v} today, gotta remember that",
            "car's on {v} of the garage if anyone asks haha",
            "left my car in {v} of the parking deck",
            "{v}. thats where the car is. dont let me forget",
            "found a parking space on {v} finally",
            "the jeep is sitting on {v} right now",
        ],
        [
            "remind me where I left the car?",
            "where did I say my car was",
            "ok where was the car again",
        ],
    ),
    "pet": (
        ["biscuit", "pickles", "mochi", "waffles", "nugget", "ziggy", "pumpkin"],
        [
            "my dog is called {v}",
            "{v} just knocked my water over again, worst cat ever",
            "we named the new puppy {v}",
            "got a little rescue dog last month, {v}, hes a beagle",
            "my cats name is {v} and she hates mornings",
            "gotta walk {v} soon, she's whining at the door. dog problems",
        ],
        [
            "what's my pet called again?",
            "do you remember my dog's name",
            "what did I say the animal's name was",
        ],
    ),
    "sister": (
        ["maria", "priya", "keiko", "aurelia", "ines", "marisol", "freya"],
        [
            "my sister's name is {v}",
            "{v} (my older sister) is coming to stay with me next week",
            "my little sis {v} just got her license, terrifying",
            "talked to my sister {v} for like two hours last night",
            "my sister is called {v}, she's the smart one",
            "{v} says hi btw. she's my sister",
        ],
        [
            "what's my sister's name, did I tell you?",
            "who was my sister again",
            "remind me what my sister is called",
        ],
    ),
    "job": (
        [
            "dental hygienist",
            "air traffic controller",
            "pastry chef",
            "paralegal",
            "welder",
            "pharmacist",
            "court stenographer",
        ],
        [
            "I work as a {v} so my hours are all over the place",
            "been a {v} for six years now, still like it",
            "my job? {v}. it pays the bills",
            "long day at work, being a {v} is exhausting",
            "im a {v} by day",
            "the {v} life is not as glamorous as it sounds lol",
        ],
        [
            "what do I do for a living again?",
            "do you remember my job",
            "what did I say my work was",
        ],
    ),
    "trip": (
        ["lisbon", "reykjavik", "osaka", "marrakesh", "krakow", "tallinn", "cusco"],
        [
            "we're flying to {v} on the 14th!!",
            "booked tickets to {v} for spring break",
            "heading to {v} next month for my cousins wedding",
            "my flight to {v} leaves friday morning",
            "going to {v} in april, never been",
            "{v} in three weeks, cant wait",
        ],
        [
            "where am I travelling to again?",
            "which city was my trip to",
            "where did I say I'm going on vacation",
        ],
    ),
    "street": (
        ["willow lane", "harbor street", "maple drive", "birch court", "juniper road"],
        [
            "I live on {v}, right by the bakery",
            "my new apartment is on {v}",
            "we just moved to {v} last month",
            "our place on {v} has terrible water pressure",
            "address is 22 {v} if you ever want to send me something",
            "{v} is where I'm at now, quiet street",
        ],
        [
            "what street do I live on?",
            "do you remember my address",
            "where's my place again, which street",
        ],
    ),
    "food": (
        ["pad thai", "tiramisu", "bibimbap", "shakshuka", "pierogi", "chicken tikka masala"],
        [
            "{v} is my all-time favorite food",
            "honestly I could eat {v} every single day",
            "my favourite food is {v}",
            "nothing beats {v}. nothing",
            "if I could only eat one thing forever it'd be {v}",
            "made {v} for dinner again, my comfort food for sure",
        ],
        [
            "what's my favorite food?",
            "what did I say I could eat every day",
            "remember my comfort food?",
        ],
    ),
    "band": (
        ["fleetwood mac", "radiohead", "the cranberries", "tame impala", "abba", "the smiths"],
        [
            "my favorite band is {v}",
            "been listening to {v} on repeat all week",
            "{v} is the best band ever and I will fight anyone on this",
            "saw {v} live once, best night of my life",
            "I love {v} so much",
            "nobody in my family gets why I'm obsessed with {v}",
        ],
        [
            "which band did I say I love?",
            "what music am I obsessed with again",
            "who's my favourite band",
        ],
    ),
    "room": (["1207", "318", "4B", "742", "909", "1516"], [], []),
    "birthday": (
        ["march 3rd", "june 21st", "october 9th", "january 30th", "august 12th"],
        [
            "my birthday is {v}",
            "turning 25 on {v}, feeling old",
            "I was born on {v}",
            "{v} is my bday btw, mark your calendar",
            "my birthday is coming up, {v}",
            "everyone forgets my birthday since its {v}",
        ],
        [
            "when's my birthday, did I say?",
            "do you remember what day I was born",
            "what date is my birthday again",
        ],
    ),
    "car": (
        ["subaru outback", "vespa", "honda civic", "ford ranger", "mini cooper", "prius"],
        [
            "I drive a {v}",
            "my {v} broke down again this morning",
            "just bought a used {v}, my first car",
            "the {v} needs new tires, sigh",
            "got my {v} washed finally",
            "my dad gave me his old {v}",
        ],
        [
            "what do I drive again?",
            "what car did I say I have",
            "remind me what my car is",
        ],
    ),
    "hometown": (
        ["boise", "tulsa", "duluth", "halifax", "spokane", "savannah"],
        [
            "I grew up in {v}",
            "I'm originally from {v}",
            "born and raised in {v}",
            "back home in {v} we never had snow days",
            "im from {v} originally, moved here for school",
            "{v} kid through and through",
        ],
        [
            "where am I from originally?",
            "what town did I grow up in",
            "where's home for me, did I tell you",
        ],
    ),
    "medication": (
        ["metformin", "levothyroxine", "sertraline", "albuterol", "lisinopril"],
        [
            "I take {v} every morning",
            "forgot my {v} today, ugh",
            "my doctor put me on {v}",
            "have to pick up my {v} refill later",
            "been on {v} for a couple years",
            "{v} makes me so sleepy",
        ],
        [
            "what medication am I on again?",
            "remind me which meds I take",
            "what was the prescription I mentioned",
        ],
    ),
    "appointment": (
        ["4:15", "9:40", "2:30", "11:45", "3:20"],
        [
            "my dentist appointment is at {v} tomorrow",
            "have to be at the doctor's at {v} on monday",
            "got an interview at {v} thursday, wish me luck",
            "haircut at {v}, cant be late again",
            "my appointment got moved to {v}",
            "vet appointment for the dog at {v}",
        ],
        [
            "what time was my appointment?",
            "when do I have to be there again",
            "remind me what time I said",
        ],
    ),
    "instrument": (
        ["cello", "bassoon", "ukulele", "banjo", "oboe", "accordion"],
        [
            "I play the {v}",
            "been taking {v} lessons since january",
            "my {v} teacher is super strict",
            "practiced {v} for three hours today, fingers hurt",
            "I've played {v} in an orchestra since high school",
            "bought a secondhand {v} off craigslist",
        ],
        [
            "what instrument do I play?",
            "what was I learning to play",
            "remember which instrument I mentioned",
        ],
    ),
}
# Numbers said in passing: room, locker, apartment.
KINDS["room"] = (
    KINDS["room"][0],
    [
        "my room number is {v}",
        "I'm in {v} this semester, third floor",
        "locker {v}, I always forget it",
        "apartment {v} if you're delivering anything",
        "our hotel room is {v}",
        "my dorm is room {v}",
    ],
    [
        "what was my room number?",
        "which number did I give you for my place",
        "remind me of the number I told you",
    ],
)
# How a planted sentence joins what the user was typing.
JOINS = ("{u}\n{f}", "{u} {f}", "{f}\n{u}", "{u}\noh and {f}", "{u}. anyway {f}")


def load(source: str | None) -> dict[str, Any]:
    if source is None:
        try:
            import chitchat_dataset
        except ImportError as exc:
            raise SystemExit(
                "needs the data: pip install --no-deps chitchat-dataset==0.9.0 "
                "(or --source path/to/dataset.json)"
            ) from exc
        source = str(Path(chitchat_dataset.__file__).parent / "dataset.json")
    with open(source, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def messages_of(chat: dict[str, Any]) -> list[dict[str, str]]:
    """The chat as alternating user/assistant messages, first speaker = user."""
    merged: list[tuple[str, list[str]]] = []
    for block in chat["messages"]:
        for utterance in block:
            text = " ".join(str(utterance["text"]).split())
            if not text:
                continue
            if merged and merged[-1][0] == utterance["sender"]:
                merged[-1][1].append(text)
            else:
                merged.append((utterance["sender"], [text]))
    if not merged:
        return []
    first = merged[0][0]
    return [
        {"role": "user" if sender == first else "assistant", "content": "\n".join(lines)}
        for sender, lines in merged
    ]


def choose(
    data: dict[str, Any], offset: float = 0.0, avoid: frozenset[str] = frozenset()
) -> list[tuple[str, list[dict[str, str]]]]:
    """``CONVERSATIONS`` chats spread over the length range of those with 50+ user turns;
    ``offset`` (0 to 1, a fraction of the stride) picks another set of the same spread. A
    pick in ``avoid`` (ids of other probe sets' chats) moves to the next longer chat not used."""
    long = []
    for cid in sorted(data):
        msgs = messages_of(data[cid])
        n = sum(m["role"] == "user" for m in msgs)
        if n >= MIN_TURNS:
            long.append((n, cid, msgs))
    long.sort()
    step = len(long) / CONVERSATIONS
    picks: list[int] = []
    for i in range(CONVERSATIONS):
        pick = int((i + offset) * step)
        while f"chitchat-{long[pick][1][:8]}" in avoid or pick in picks:
            pick = (pick + 1) % len(long)
        picks.append(pick)
    return [(long[i][1], long[i][2]) for i in picks]


Kinds = dict[str, tuple[list[str], list[str], list[str]]]


def plant(
    cid: str,
    msgs: list[dict[str, str]],
    rng: random.Random,
    counts: dict[str, int],
    kinds_: Kinds = KINDS,
    split: str | None = None,
) -> dict[str, Any]:
    user_at = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    if len(user_at) > MAX_TURNS:  # cut after the 250th user turn's replies
        msgs = msgs[: user_at[MAX_TURNS]]
        user_at = user_at[:MAX_TURNS]
    n = len(user_at)
    text = "\n".join(m["content"] for m in msgs).casefold()
    k = 4 if n >= 100 else 3
    # Least-used kinds first, so the set covers every kind about evenly.
    kinds = sorted(kinds_, key=lambda kind: (counts.get(kind, 0), rng.random()))
    plant_turns = sorted(rng.sample(range(1, min(20, n - 31)), k))
    used_asks: set[int] = set(plant_turns)
    probes = []
    for turn in plant_turns:
        while kinds:
            kind = kinds.pop(0)
            values, templates, questions = kinds_[kind]
            fresh = [v for v in values if v.casefold() not in text]
            if fresh:
                break
        else:
            raise SystemExit(f"{cid}: no kind left to plant")
        counts[kind] = counts.get(kind, 0) + 1
        value = rng.choice(fresh)
        t_index = rng.randrange(len(templates))
        sentence = templates[t_index].format(v=value)
        question = rng.choice(questions)
        lo, hi = turn + 30, min(turn + 200, n - 1)
        ask = rng.choice([t for t in range(lo, hi + 1) if t not in used_asks])
        used_asks.add(ask)
        m = msgs[user_at[turn]]
        m["content"] = rng.choice(JOINS).format(u=m["content"], f=sentence)
        msgs[user_at[ask]]["content"] = question
        text += "\n" + value.casefold()  # not planted twice
        probes.append(
            {
                "fact": value,
                "kind": kind,
                "planted_turn": turn,
                "asked_turn": ask,
                "question": question,
                "said": sentence,
                "split": split or ("dev" if t_index % 2 == 0 else "heldout"),
            }
        )
    for p in probes:  # the answer appears only where it was planted
        said = [i for i, m in enumerate(msgs) if p["fact"].casefold() in m["content"].casefold()]
        assert said == [user_at[p["planted_turn"]]], (cid, p)
    return {
        "id": f"chitchat-{cid[:8]}",
        "source": "chitchat-dataset 0.9.0 (MIT), conversation " + cid,
        "messages": msgs,
        "probes": sorted(probes, key=lambda p: p["asked_turn"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", help="dataset.json (default: the installed package's)")
    parser.add_argument("-o", "--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--templates",
        type=Path,
        help="JSON {kind: {values, templates, questions}} instead of the built-in kinds; "
        "every probe's split is then the file's stem",
    )
    parser.add_argument("--offset", type=float, default=0.0, help="another set of chats (0-1)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument(
        "--avoid",
        type=Path,
        nargs="*",
        default=[],
        help="probe sets (.jsonl.gz) whose chats this set must not use",
    )
    args = parser.parse_args()
    data = load(args.source)
    rng = random.Random(args.seed)
    counts: dict[str, int] = {}
    kinds, split = KINDS, None
    if args.templates:
        spec = json.loads(args.templates.read_text(encoding="utf-8"))
        kinds = {k: (v["values"], v["templates"], v["questions"]) for k, v in spec.items()}
        split = args.templates.stem.removesuffix("_templates")
    avoid: set[str] = set()
    for path in args.avoid:
        with gzip.open(path, "rt", encoding="utf-8") as other:
            avoid.update(json.loads(line)["id"] for line in other)
    chosen = choose(data, args.offset, frozenset(avoid))
    rows = [plant(cid, msgs, rng, counts, kinds, split) for cid, msgs in chosen]
    # No name and no time in the gzip header: the same rows give the same bytes.
    with (
        open(args.out, "wb") as f,
        gzip.GzipFile(filename="", fileobj=f, mode="wb", mtime=0) as raw,
    ):
        for row in rows:
            raw.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
    turns = [sum(m["role"] == "user" for m in r["messages"]) for r in rows]
    probes = [p for r in rows for p in r["probes"]]
    gaps = [p["asked_turn"] - p["planted_turn"] for p in probes]
    print(
        f"{args.out}: {len(rows)} conversations, user turns {min(turns)}-{max(turns)} "
        f"(median {sorted(turns)[len(turns) // 2]}), {len(probes)} probes "
        f"({sum(p['split'] == 'heldout' for p in probes)} held-out), asked {min(gaps)}-"
        f"{max(gaps)} turns after planting, kinds: "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    )


if __name__ == "__main__":
    main()
