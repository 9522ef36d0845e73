"""Recall by meaning vs BM25 (issue 10): which search finds a fact said long ago?

    .venv/bin/python bench/recall_embed_bench.py [--probes bench/facts/everyday_probes.jsonl.gz]
        [--model GGUF | --embedder] [--threads 1] [--cache .cache/recall_embed.npz]
        [--conversations N]

For every everyday-fact probe (``bench/facts/build_probes.py``) the candidates are the
conversation's messages before the question, user and assistant (recall searches both), and
the question is the query. Rankings:

- BM25: the conversation in an in-memory ``Store("sqlite://")``, searched as the session does
  (``search_messages(cid, question, before_position=..., limit=k, replies=True)``, then
  ``group_hits``, dropping hits that repeat the question).
- Embeddings through llama.cpp, cosine similarity: of SmolLM2-135M-Instruct (the embedded
  default model), or with ``--embedder`` of all-MiniLM-L6-v2 (the sentence embedder recall by
  meaning uses; MEAN is its own pooling); MEAN and LAST pooling (both read from one pass with
  pooling NONE), the question as is or after an instruction prefix. A hit's reply is attached
  as the store does.
- Hybrid: reciprocal-rank fusion (k=60, untuned) of the BM25 ranking and each embedding one.

Recall@k: the planted user message is among the first k hits. Overall and by template half
(``dev`` / ``heldout``). Embeddings are cached by text in ``--cache`` (a rerun embeds nothing).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from chatctx.context._recall import asks_back, group_hits, repeats
from chatctx.model.embedder import default_embedder_path
from chatctx.model.paths import default_model_path
from chatctx.store import Message, Store

HERE = Path(__file__).resolve().parent
PROBES = HERE / "facts" / "everyday_probes.jsonl.gz"
CACHE = HERE.parent / ".cache" / "recall_embed.npz"
KS = (1, 3, 5)
RRF_K = 60
# The one prefix tried (chosen before any run, not tuned): an instruction in the style of
# instruction-tuned embedders. SmolLM2 was never trained for it; the run says if it helps.
PREFIX = "Instruct: find the earlier chat message that answers this question.\nQuery: "


@dataclass
class Probe:
    cid: str
    split: str
    planted: int  # position of the user message that states the fact
    asked: int  # position of the question
    question: str


def load(path: Path, limit: int | None) -> tuple[list[dict[str, Any]], list[Probe]]:
    conversations, probes = [], []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            users = [i for i, m in enumerate(record["messages"]) if m["role"] == "user"]
            for p in record["probes"]:
                asked = users[p["asked_turn"]]
                question = record["messages"][asked]["content"]
                split = p.get("split", "all")
                probes.append(Probe(record["id"], split, users[p["planted_turn"]], asked, question))
            conversations.append(record)
            if limit is not None and len(conversations) >= limit:
                break
    return conversations, probes


def attach_replies(order: Sequence[int], by_pos: dict[int, Message], query: str) -> list[int]:
    """Message positions best first -> hit positions, as ``search_messages(replies=True)`` and
    the builder list them: a user message takes the assistant reply after it off the list."""
    seen: set[int] = set()
    hits: list[int] = []
    for pos in order:
        if pos in seen:
            continue
        seen.add(pos)
        message = by_pos[pos]
        nxt = by_pos.get(pos + 1)
        if message.role == "user" and nxt is not None and nxt.role == "assistant":
            seen.add(pos + 1)
        if not repeats(message, query):
            hits.append(pos)
    return hits


class Embedder:
    """Mean- and last-pooled, normalized embeddings from one llama.cpp pass (pooling NONE)."""

    def __init__(self, model: Path, threads: int, cache: Path) -> None:
        import llama_cpp

        t0 = time.perf_counter()
        self.llm = llama_cpp.Llama(
            model_path=str(model),
            embedding=True,
            pooling_type=llama_cpp.LLAMA_POOLING_TYPE_NONE,
            n_ctx=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        self.load_s = time.perf_counter() - t0
        self.tag = model.name
        self.cache_path = cache
        self.cache: dict[str, np.ndarray] = {}
        if cache.is_file():
            with np.load(cache) as data:
                self.cache = {k: data[k] for k in data.files}
        self.embedded = 0
        self.seconds = 0.0
        self.tokens = 0

    def __call__(self, text: str) -> np.ndarray:
        """A (2, n_embd) array: mean pooling, last-token pooling, each of unit length."""
        key = hashlib.sha1(f"{self.tag}\0{text}".encode()).hexdigest()
        if key not in self.cache:
            t0 = time.perf_counter()
            rows, count = self.llm.embed(text or " ", return_count=True)
            tokens = np.asarray(rows, dtype=np.float32)
            pooled = np.stack([tokens.mean(axis=0), tokens[-1]])
            self.seconds += time.perf_counter() - t0
            self.embedded += 1
            self.tokens += count
            self.cache[key] = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
        return self.cache[key]

    def save(self) -> None:
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_path.with_suffix(".tmp.npz")
        np.savez(tmp, **self.cache)
        os.replace(tmp, self.cache_path)


def rrf(*rankings: Sequence[int]) -> list[int]:
    score: dict[int, float] = {}
    for ranking in rankings:
        for rank, pos in enumerate(ranking):
            score[pos] = score.get(pos, 0.0) + 1.0 / (RRF_K + rank + 1)
    return sorted(score, key=lambda pos: (-score[pos], -pos))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", type=Path, default=PROBES)
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default: SmolLM2)")
    parser.add_argument(
        "--embedder",
        action="store_true",
        help="the sentence embedder recall uses (all-MiniLM-L6-v2) instead of --model",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--conversations", type=int, default=None, help="only the first N")
    args = parser.parse_args()

    conversations, probes = load(args.probes, args.conversations)
    model = default_embedder_path() if args.embedder else args.model or default_model_path()
    embed = Embedder(model, args.threads, args.cache)
    # method -> split -> list of ranks (None: not found)
    ranks: dict[str, dict[str, list[int | None]]] = {}
    bm25_empty = no_trigger = 0
    bm25_s = query_s = 0.0
    queries = 0
    rng = np.random.default_rng(10)

    def note(method: str, split: str, hits: Sequence[int], planted: int) -> None:
        rank = hits.index(planted) if planted in hits else None
        for key in (split, "all"):
            ranks.setdefault(method, {}).setdefault(key, []).append(rank)

    with Store("sqlite://") as store:
        for convo in conversations:
            cid = convo["id"]
            store.create_conversation(cid)
            messages = store.add_messages(cid, convo["messages"])
            by_pos = {m.position: m for m in messages}
            mine = [p for p in probes if p.cid == cid]
            for message in messages[: max(p.asked for p in mine)]:
                embed(message.content)
            embed.save()
            for p in mine:
                query = p.question
                no_trigger += not asks_back(query)
                # BM25 exactly as the session asks, once per k (the builder's recall_k).
                t0 = time.perf_counter()
                found = store.search_messages(
                    cid, query, before_position=p.asked, limit=max(KS), replies=True
                )
                bm25_s += time.perf_counter() - t0
                bm25_empty += not found
                for k in KS:
                    hits = [
                        h.message.position
                        for h in group_hits(
                            store.search_messages(
                                cid, query, before_position=p.asked, limit=k, replies=True
                            )
                        )
                        if not repeats(h.message, query)
                    ][:k]
                    for key in (p.split, "all"):
                        found_k = ranks.setdefault(f"bm25@{k}", {}).setdefault(key, [])
                        found_k.append(0 if p.planted in hits else None)
                bm25_all = [
                    h.message.position
                    for h in group_hits(
                        store.search_messages(
                            cid, query, before_position=p.asked, limit=p.asked, replies=True
                        )
                    )
                ]
                cands = [m.position for m in messages[: p.asked]]
                matrix = np.stack([embed(by_pos[pos].content) for pos in cands])
                # Control: random rankings (20 per probe, averaged), alone and fused the same
                # way. An embedding no better than these only gives BM25's misses a lottery.
                for _ in range(20):
                    shuffled = [int(x) for x in rng.permutation(cands)]
                    alone = attach_replies(shuffled, by_pos, query)
                    note("random (control)", p.split, alone, p.planted)
                    noise = attach_replies(rrf(bm25_all, shuffled), by_pos, query)
                    note("hybrid random (control)", p.split, noise, p.planted)
                for prefixed in (False, True):
                    before = embed.seconds
                    q = embed((PREFIX if prefixed else "") + query)
                    query_s += embed.seconds - before
                    queries += embed.seconds > before
                    for pooling, name in ((0, "mean"), (1, "last")):
                        sims = matrix[:, pooling, :] @ q[pooling]
                        order = [cands[i] for i in np.lexsort((-np.asarray(cands), -sims))]
                        label = f"{name}{', prefixed' if prefixed else ''}"
                        dense = attach_replies(order, by_pos, query)
                        note(f"embed {label}", p.split, dense, p.planted)
                        fused = attach_replies(rrf(bm25_all, dense), by_pos, query)
                        note(f"hybrid {label}", p.split, fused, p.planted)
    embed.save()

    splits = sorted({p.split for p in probes})
    print(f"{len(probes)} probes in {len(conversations)} conversations; splits {splits}")
    head = "| method | @1 | @3 | @5 |" + "".join(f" {s} @1/@3/@5 |" for s in splits)
    head += " @5 vs BM25 (+/-) |"
    print("\n" + head + "\n" + "|---" * (5 + len(splits)) + "|")

    def at(rs: list[int | None], k: int) -> float:
        return sum(r is not None and r < k for r in rs) / len(rs)

    def bm25(key: str, k: int) -> float:
        return at(ranks[f"bm25@{k}"][key], 1)

    cells = " | ".join(f"{bm25('all', k):.2f}" for k in KS)
    print(
        f"| BM25 (FTS5, as the session) | {cells} |"
        + "".join(" " + " / ".join(f"{bm25(s, k):.2f}" for k in KS) + " |" for s in splits)
        + " |"
    )
    base = [r is not None for r in ranks[f"bm25@{max(KS)}"]["all"]]
    for method, by_split in ranks.items():
        if method.startswith("bm25"):
            continue
        cells = " | ".join(f"{at(by_split['all'], k):.2f}" for k in KS)
        paired = ""  # probes found @5 that BM25 misses / missed that BM25 finds
        if len(by_split["all"]) == len(base):
            hit = [r is not None and r < max(KS) for r in by_split["all"]]
            won = sum(h and not b for h, b in zip(hit, base, strict=True))
            lost = sum(b and not h for h, b in zip(hit, base, strict=True))
            paired = f"+{won} / -{lost}"
        print(
            f"| {method} | {cells} |"
            + "".join(
                " " + " / ".join(f"{at(by_split[s], k):.2f}" for k in KS) + " |" for s in splits
            )
            + f" {paired} |"
        )
    n = len(probes)
    sizes = sorted(p.asked for p in probes)
    print(f"\ncandidates per probe (messages before the question): median {sizes[n // 2]},")
    print(f"{sizes[0]}-{sizes[-1]}; see the random control for chance.")
    print(f"BM25 returned nothing for {bm25_empty}/{n} probes; the question trigger")
    print(f"(asks_back) would not fire for {no_trigger}/{n}.")
    print(f"BM25 search: {bm25_s / n * 1000:.2f} ms per query (in-memory SQLite).")
    print(f"model load: {embed.load_s:.2f} s (n_threads={args.threads})")
    if embed.embedded:
        print(
            f"embedding: {embed.seconds / embed.embedded * 1000:.0f} ms per message "
            f"({embed.embedded} embedded this run, {embed.tokens / embed.embedded:.1f} tokens "
            f"each, {embed.tokens / embed.seconds:.0f} tokens/s)"
        )
    else:
        print(f"embedding: every text was in {args.cache} (delete it to time the embeddings)")
    if queries:
        print(f"query embedding: {query_s / queries * 1000:.0f} ms per query")
    print(f"loadavg: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
