"""Memory benchmark (issue 10.5): do everyday facts survive eviction, and at what prefill cost?

    .venv/bin/python bench/recall_bench.py [--budgets 512,1024,2048] [--synthetic 20]
        [--probes bench/facts/everyday_probes.jsonl.gz] [--model GGUF]
        [--setups recall] [--search words] [--db URL | --throwaway-pg]

``--db`` replays on that database (each conversation deleted before it is replayed) instead of
an in-memory SQLite store; ``--throwaway-pg`` on a PostgreSQL cluster started for the run
(``chatctx.testing.ThrowawayPostgres``). ``--search words`` is recall by words alone (FTS5 on
SQLite, ``tsvector`` on PostgreSQL); ``--setups`` picks setups by label (comma-separated).

Dry replays (tokenizer and template only, no weights; SmolLM2 by default) of

A. the everyday-fact probe set built from real two-person chats by
   ``bench/facts/build_probes.py`` (facts said in passing, asked back 30-200 turns later in
   other words), and
B. synthetic support chats with identifier probes (``chatctx.synthetic``, 150 turns each),

for: trim-every-turn with no summary, then watermarks + in-place eviction with no summary,
the extractive summary, recall, and both. Context-level retention: the fact string is in the
context sent with the question (case-insensitive), over all probes, counting those of a
conversation stopped by an error as lost. Prefill amplification: tokens evaluated / new
tokens. "stopped": conversations that raised (a budget error, say). Everyday retention is also
split by template half: ``dev`` (looked at while tuning the summarizer) and ``heldout``.
The last section times the extractive summarizer per message.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import chatctx.replay._run as _run
from chatctx.context import ExtractiveSummarizer
from chatctx.context._facts import statements
from chatctx.model.codec import PromptCodec, open_codec
from chatctx.model.paths import default_model_path
from chatctx.replay import (
    LoggedConversation,
    ReplayConfig,
    Replayer,
    parse_logged,
    replay_all,
    summarize,
)
from chatctx.settings import ContextSettings
from chatctx.store import Message, Store
from chatctx.synthetic import support_conversation

HERE = Path(__file__).resolve().parent
PROBES = HERE / "facts" / "everyday_probes.jsonl.gz"
HAS_RECALL = "recall" in ContextSettings.model_fields
_RETAINED = _run._retained
# (label, policy, summarizer, recall)
SETUPS = (
    ("trim-every-turn, none", "trim-every-turn", "none", False),
    ("watermarks, none", "watermarks", "none", False),
    ("extractive", "watermarks", "extractive", False),
    ("recall", "watermarks", "none", True),
    ("extractive + recall", "watermarks", "extractive", True),
)
SELECTED = SETUPS


def load(path: Path) -> tuple[list[LoggedConversation], dict[tuple[str, int], str]]:
    """Conversations and each probe's template half, by (conversation id, asked turn)."""
    conversations, split = [], {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            conversation = parse_logged(line, line=number, source=str(path))
            conversations.append(conversation)
            for probe in json.loads(line)["probes"]:
                split[(conversation.id, probe["asked_turn"])] = probe.get("split", "all")
    return conversations, split


# Set by main(): the recall search (None: the default), and each conversation's store (None:
# an in-memory ReplayStore).
SEARCH: str | None = None
STORE: Callable[[str], Store] | None = None


def config(budget: int, policy: str, summarizer: str, recall: bool) -> ReplayConfig:
    fields: dict[str, Any] = {
        "mode": "dry",
        "budget": budget,
        "policy": policy,
        "summarizer": summarizer,
    }
    if HAS_RECALL:
        fields["recall"] = recall
        if SEARCH is not None:
            fields["recall_search"] = SEARCH
    return ReplayConfig(**fields)


def store_on(url: str) -> Callable[[str], Store]:
    """Each conversation replayed on ``url``, from scratch (a stored one is deleted)."""
    Store(url).close()  # upgraded once, here

    def open_store(conversation_id: str) -> Store:
        store = Store(url)
        if store.has_conversation(conversation_id):
            store.delete_conversation(conversation_id)
        return store

    return open_store


def run(
    conversations: Sequence[LoggedConversation], cfg: ReplayConfig, codec: PromptCodec
) -> dict[str, Any]:
    errors: list[str] = []
    outcomes: list[tuple[str, bool]] = []
    reports = []
    with Replayer(cfg, codec=codec, store=STORE) as replayer:
        for conversation in conversations:
            # Per-probe outcomes for the per-half figures: replay's own check, recorded
            # (ConversationReport only counts them). Probes are asked in turn order.
            recorded: list[bool] = []
            _run._retained = _recording(recorded)
            try:
                reports += replay_all(replayer, [conversation], errors=errors, on_error="skip")
            finally:
                _run._retained = _RETAINED
            asked = sorted(p.asked_turn for p in conversation.probes)
            if len(recorded) == len(asked):
                outcomes += [
                    (f"{conversation.id}:{a}", r) for a, r in zip(asked, recorded, strict=True)
                ]
    totals = summarize([t for r in reports for t in r.turns], reports)
    probes = sum(len(c.probes) for c in conversations)
    retained = sum(r.retained_in_context for r in reports)
    return {
        "outcomes": dict(outcomes),
        "retained": retained,
        "probes": probes,
        "amplification": totals["prefill_amplification"],
        "stopped": len(errors),
        "errors": errors,
        "summary_p50": _median([t.summary_tokens for r in reports for t in r.turns]),
    }


def _recording(into: list[bool]) -> Callable[[str, Sequence[dict[str, Any]]], bool]:
    def retained(fact: str, messages: Sequence[dict[str, Any]]) -> bool:
        found = _RETAINED(fact, messages)
        into.append(found)
        return found

    return retained


def _median(values: list[int]) -> int:
    return sorted(values)[len(values) // 2] if values else 0


def table(
    title: str,
    conversations: Sequence[LoggedConversation],
    codec: PromptCodec,
    budgets: Sequence[int],
    split: dict[tuple[str, int], str] | None,
) -> None:
    turns = sum(len(c.turns()) for c in conversations)
    probes = sum(len(c.probes) for c in conversations)
    print(
        f"\n## {title}\n\n{len(conversations)} conversations, {turns} user turns, {probes} probes"
    )
    halves = sorted(set(split.values())) if split else []
    head = "| budget | setup | retention |" + "".join(f" {h} |" for h in halves)
    print(f"\n{head} amplification | stopped | summary tokens (median) | s |")
    print("|---" * (7 + len(halves)) + "|")
    for budget in budgets:
        for label, policy, summarizer, recall in SELECTED:
            if recall and not HAS_RECALL:
                print(f"| {budget} | {label} | (recall not available) |" + " |" * (4 + len(halves)))
                continue
            cfg = config(budget, policy, summarizer, recall)
            t0 = time.perf_counter()
            result, cells = run(conversations, cfg, codec), ""
            for half in halves:
                keys = [k for k, v in (split or {}).items() if v == half]
                hits = sum(result["outcomes"].get(f"{cid}:{turn}", False) for cid, turn in keys)
                cells += f" {hits / len(keys):.2f} |" if keys else " - |"
            share = result["retained"] / result["probes"] if result["probes"] else 0.0
            amp = result["amplification"]
            print(
                f"| {budget} | {label} | {share:.2f} |{cells} "
                f"{amp:.2f} | {result['stopped']} | {result['summary_p50']} | "
                f"{time.perf_counter() - t0:.0f} |",
                flush=True,
            )
            for error in result["errors"][:3]:
                print(f"|  | stopped: {error[:160]} |" + " |" * (5 + len(halves)))


def speed(conversations: Sequence[LoggedConversation], codec: PromptCodec) -> None:
    """Extractive summarizer cost per message, folding 8 messages per call as evictions do."""
    messages = [
        Message(id=i + 1, conversation_id=c.id, position=i, role=m["role"], content=m["content"])
        for c in conversations
        for i, m in enumerate(c.messages)
    ]
    summarize_ = ExtractiveSummarizer(codec.count, max_tokens=128)
    t0 = time.perf_counter()
    for m in messages:
        statements(m.content)
    extract = time.perf_counter() - t0
    summary: str | None = None
    t0 = time.perf_counter()
    for start in range(0, len(messages), 8):
        summary = summarize_(summary, messages[start : start + 8])
    total = time.perf_counter() - t0
    print(
        f"\n## C. extractive summarizer speed\n\n{len(messages):,} messages: fact extraction "
        f"{extract / len(messages) * 1e6:.0f} µs/message; whole summarizer (8 messages per call, "
        f"max 128 tokens, exact token counts) {total / len(messages) * 1e6:.0f} µs/message"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="512,1024,2048")
    parser.add_argument("--synthetic", type=int, default=20, help="synthetic chats (0 = skip)")
    parser.add_argument("--probes", type=Path, default=PROBES)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--only", choices=["everyday", "synthetic", "speed"], default=None)
    parser.add_argument("--setups", default=None, help="labels, comma-separated (default: all)")
    parser.add_argument("--search", choices=["auto", "meaning", "words"], default=None)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--db", default=None, help="replay on this database URL")
    where.add_argument("--throwaway-pg", action="store_true", help="replay on a fresh PostgreSQL")
    args = parser.parse_args()
    global SEARCH, STORE, SELECTED
    SEARCH = args.search
    if args.setups:
        wanted = [s.strip() for s in args.setups.split(",")]
        SELECTED = tuple(s for s in SETUPS if s[0] in wanted)
        if len(SELECTED) != len(wanted):
            parser.error(f"--setups: known labels are {[s[0] for s in SETUPS]}")
    with ExitStack() as stack:
        if args.throwaway_pg:
            from chatctx.testing import ThrowawayPostgres

            server = stack.enter_context(ThrowawayPostgres())
            args.db = server.create_database("recall_bench")
        if args.db:
            STORE = store_on(args.db)
            print(f"store: {args.db.split('@')[-1]}")
        _main(args)


def _main(args: argparse.Namespace) -> None:
    budgets = [int(b) for b in args.budgets.split(",")]
    model = args.model or default_model_path()
    codec = open_codec(model)
    print(f"model (tokenizer and template only): {model.name}; recall available: {HAS_RECALL}")
    if HAS_RECALL:
        defaults = ReplayConfig().context
        search = SEARCH or getattr(defaults, "recall_search", "words")
        if search == "auto":
            from chatctx.model.embedder import embedder_available

            search = f"auto: {'meaning' if embedder_available() else 'words'}"
        print(
            f"recall settings: recall_budget {defaults.recall_budget}, recall_k "
            f"{defaults.recall_k}, recall_search {search}"
        )
    conversations, split = load(args.probes)
    if args.only in (None, "everyday"):
        table(
            f"A. everyday facts in real chats (chitchat-dataset 0.9.0; {args.probes.name})",
            conversations,
            codec,
            budgets,
            split,
        )
    if args.synthetic and args.only in (None, "synthetic"):
        synthetic = [
            parse_logged(json.dumps(support_conversation(150, seed=1000 + i)), line=i + 1)
            for i in range(args.synthetic)
        ]
        table("B. identifier probes in synthetic support chats", synthetic, codec, budgets, None)
    if args.only in (None, "speed"):
        speed(conversations, codec)


if __name__ == "__main__":
    main()
