"""Build ``chatctx/data/common_words.txt``: the everyday chat vocabulary.

    pip install --no-deps chitchat-dataset==0.9.0     # the data (MIT), not a chatctx dependency
    .venv/bin/python bench/facts/build_common_words.py [--source dataset.json] [--min-chats 5]

The extractive summarizer calls a word *specific* when it is not in this list ("propranolol",
"Poughkeepsie", "bouldering"): specific words are what a later question needs, and a
sentence without one is usually chit-chat. The list holds every word of 3 or more letters,
case-folded, used in at least ``--min-chats`` of the chats of PyPI ``chitchat-dataset``
0.9.0 (MIT licence; BYU's Chit-Chat Challenge) that have **fewer** than 50 user turns:
6,890 chats. Each line is a word and the number of chats it is used in; the first line,
``# chats N``, is how many chats were counted. The counts say how rare a common word is
("went" is in 635 chats, "therapy" in 22): see ``chatctx.context._facts.rarity``. The fact
benchmarks (``build_probes.py``) use only chats with 50 or more user turns, so no chat is in
both. Deterministic: the same source gives the same file.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

from build_probes import MIN_TURNS, load, messages_of

OUT = Path(__file__).resolve().parents[2] / "chatctx" / "data" / "common_words.txt"
_WORD = re.compile(r"[^\W\d_]+")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", help="dataset.json (default: the installed package's)")
    parser.add_argument("--min-chats", type=int, default=5)
    parser.add_argument("-o", "--out", type=Path, default=OUT)
    args = parser.parse_args()
    chats = 0
    used_in: Counter[str] = Counter()
    for chat in load(args.source).values():
        messages = messages_of(chat)
        if sum(m["role"] == "user" for m in messages) >= MIN_TURNS:
            continue  # long chats are the benchmarks' material
        chats += 1
        words = set()
        for m in messages:
            words.update(w for w in _WORD.findall(m["content"].casefold()) if len(w) >= 3)
        used_in.update(words)
    common = sorted(w for w, n in used_in.items() if n >= args.min_chats)
    lines = [f"# chats {chats}"] + [f"{w} {used_in[w]}" for w in common]
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{args.out}: {len(common):,} words used in {args.min_chats}+ of {chats:,} chats")


if __name__ == "__main__":
    main()
