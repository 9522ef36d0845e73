"""Memory beyond English (issue 44): facts of either speaker, and values changed mid-chat, in
several languages, kept in the prompt with the default settings?

    .venv/bin/python bench/multilingual_bench.py [--probes bench/facts/multilingual_eval.jsonl.gz]
        [--budgets 512,1024] [--embedder minilm|multilingual-e5-small|words] [--json]
        [--misses]  # each ask lost, on a development set

Dry replays (tokenizer and template only, no weights) of support chats
written in Korean, Japanese, Chinese, Spanish and English, each with facts the customer said,
facts the agent said, and values changed later ("update": the probe names the new value and
the one it replaced), asked back in other words in the last quarter of the chat. Settings are
the defaults (watermarks, the extractive summary, recall) at each budget; the embedder for
recall by meaning is picked with ``--embedder`` (``words``: recall by words only). The
tokenizer and template are Llama 3's (a random-weight GGUF written for the run, as the tests
write it; the model chatctx is for): SmolLM2's English-centred vocabulary spends three times
as many tokens on Korean, which would measure its tokenizer, not the memory.

Per language and kind: **retention**, the asked fact in the prompt sent with the question
(case-insensitive, the question itself left out); **stale**, asks whose prompt holds the
replaced value and not the new one (the bot would answer the old value with confidence),
over the updates; **amplification**, tokens evaluated / new tokens. The last lines give the
replay's wall time and the embedder's time per message embedded.

``bench/facts/multilingual_dev.jsonl.gz`` and ``multilingual_dev2.jsonl.gz`` (written later,
to check what the first suggests) are the sets to tune on; ``multilingual_eval`` is frozen:
report on it, never tune on it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EVAL = HERE / "facts" / "multilingual_eval.jsonl.gz"
KINDS = ("user_fact", "assistant_fact", "update")


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probes", type=Path, default=EVAL)
    parser.add_argument("--budgets", default="512,1024")
    parser.add_argument(
        "--embedder", choices=("minilm", "multilingual-e5-small", "words"), default="minilm"
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="GGUF whose tokenizer is used (Llama 3's)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a context setting other than its default (repeatable), e.g. recall_budget=160",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--misses",
        action="store_true",
        help="list each ask whose fact the prompt lacked (the sets tuned on only)",
    )
    args = parser.parse_args(argv)
    if args.misses and args.probes.resolve() == EVAL:
        parser.error(
            "--misses is for the sets tuned on: the eval set is frozen, never read ask by ask"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(argv)
    if args.embedder == "multilingual-e5-small":
        os.environ["CHATCTX_EMBEDDER"] = args.embedder
    # Imported after the embedder is chosen: the shared one is made on first use.
    import chatctx.replay._run as run
    from chatctx.backends.engine import local_embedder
    from chatctx.model.codec import open_codec
    from chatctx.replay import ReplayConfig, Replayer, parse_logged, replay_all, summarize

    with gzip.open(args.probes, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    raw = [json.loads(line) for line in lines if line.strip()]
    conversations = [
        parse_logged(line, line=n, source=str(args.probes)) for n, line in enumerate(lines, 1)
    ]
    if args.model is None:
        from chatctx.testing import write_tiny_llama3

        args.model = write_tiny_llama3(Path(tempfile.mkdtemp()) / "llama3-tokenizer.gguf")
    codec = open_codec(args.model)
    embedder = local_embedder() if args.embedder != "words" else None
    check = run._retained  # the replay's own check, recorded per ask below
    results: list[dict[str, Any]] = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        search = "words" if args.embedder == "words" else "meaning"
        changed = dict(item.split("=", 1) for item in args.set)
        # Context fields flat: folded into ``context`` (``ReplayConfig``'s validator).
        config = ReplayConfig.model_validate(
            {"mode": "dry", "budget": budget, "recall_search": search, **changed}
        )
        seen: list[list[dict[str, Any]]] = []  # the prompt (less the question) of each ask

        def record(fact: str, messages: Sequence[dict[str, Any]], into: list[Any] = seen) -> bool:
            into.append(list(messages))
            return check(fact, messages)

        calls0 = embedder.calls if embedder is not None else 0
        seconds0 = getattr(embedder, "seconds", 0.0)
        t0 = time.perf_counter()
        rows: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        reports = []
        errors: list[str] = []
        misses: list[dict[str, Any]] = []
        with Replayer(config, codec=codec) as replayer:
            for conversation, data in zip(conversations, raw, strict=True):
                seen.clear()
                run._retained = record
                try:
                    reports += replay_all(replayer, [conversation], errors=errors, on_error="skip")
                finally:
                    run._retained = check
                probes = sorted(data["probes"], key=lambda p: p["asked_turn"])
                if len(seen) != len(probes):
                    continue  # stopped by an error: its probes count as lost below
                for probe, prompt in zip(probes, seen, strict=True):
                    text = "\n".join(str(m.get("content", "")) for m in prompt).casefold()
                    new = probe["fact"].casefold() in text
                    old = probe.get("replaced")
                    stale = bool(old) and old.casefold() in text and not new
                    if not new:
                        misses.append({"id": data["id"], **probe, "stale": stale})
                    for key in ((data["lang"], probe["kind"]), (data["lang"], "all")):
                        row = rows[key]
                        row[0] += new
                        row[1] += 1
                        row[2] += stale
                        row[3] += bool(old)
        wall = time.perf_counter() - t0
        totals = summarize([t for r in reports for t in r.turns], reports)
        by_lang = defaultdict(list)
        for report, data in zip(reports, raw, strict=False):
            by_lang[data["lang"]].append(report)
        amplification = {
            lang: summarize([t for r in rs for t in r.turns], rs)["prefill_amplification"]
            for lang, rs in by_lang.items()
        }
        embedded = (embedder.calls - calls0) if embedder is not None else 0
        searched = sorted(t.recall_ms for r in reports for t in r.turns if t.recall_ms > 0)
        results.append(
            {
                "budget": budget,
                "embedder": args.embedder,
                "rows": {f"{lang}/{kind}": row for (lang, kind), row in sorted(rows.items())},
                "amplification": amplification,
                "amplification_all": totals["prefill_amplification"],
                "stopped": len(errors),
                **({"misses": misses} if args.misses else {}),
                "wall_s": wall,
                "embedded": embedded,
                "recall_turns": len(searched),
                "recall_ms_p50": searched[len(searched) // 2] if searched else None,
                "recall_ms_p95": searched[int(len(searched) * 0.95)] if searched else None,
                "embed_ms_per_message": (
                    (getattr(embedder, "seconds", 0.0) - seconds0) / embedded * 1000
                    if embedded
                    else None
                ),
            }
        )
        if not args.json:
            _print(results[-1], sorted(by_lang))
            for miss in misses if args.misses else []:
                print(
                    f"missed {miss['id']} turn {miss['asked_turn']} ({miss['kind']}"
                    + (", stale" if miss["stale"] else "")
                    + f"): {miss['fact']!r} of {miss['said']!r}"
                )
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    return 0


def _share(hit: int, total: int) -> str:
    return f"{hit / total:.2f} ({hit}/{total})" if total else "-"


def _print(result: dict[str, Any], langs: Sequence[str]) -> None:
    rows = result["rows"]
    print(f"\n## budget {result['budget']}, embedder {result['embedder']}\n")
    print("| language | all | user facts | assistant facts | updates | stale | amplification |")
    print("|---|---|---|---|---|---|---|")
    for lang in langs:
        cells = [_share(*rows.get(f"{lang}/{k}", [0, 0])[:2]) for k in ("all", *KINDS)]
        stale = rows.get(f"{lang}/update", [0, 0, 0, 0])
        print(
            f"| {lang} | {' | '.join(cells)} | {_share(stale[2], stale[3])} | "
            f"{result['amplification'][lang]:.2f} |"
        )
    per = result["embed_ms_per_message"]
    print(
        f"\nall: amplification {result['amplification_all']:.2f}, stopped "
        f"{result['stopped']}, wall {result['wall_s']:.1f} s, {result['embedded']} texts "
        "embedded" + (f", {per:.1f} ms each" if per is not None else "")
    )
    if result["recall_turns"]:
        print(
            f"turns that searched to recall: {result['recall_turns']}, "
            f"{result['recall_ms_p50']:.1f} ms p50, {result['recall_ms_p95']:.1f} ms p95"
        )


if __name__ == "__main__":
    raise SystemExit(main())
