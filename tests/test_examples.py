"""Every example runs as written (in a fast form: the tiny model, few tokens), and the figures
it prints are checked against what the database, the input logs or llama.cpp hold."""

from __future__ import annotations

import ast
import csv
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from click.testing import CliRunner

from chatctx import Engine, Store
from chatctx.cli import cli

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / "examples" / "data" / "support_logs.jsonl"


def run(script: str, *args: str, cwd: Path) -> tuple[str, str]:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, result.stderr


def example_module(script: str) -> ModuleType:
    """The example itself, imported: its data is the oracle for what it must have done."""
    spec = importlib.util.spec_from_file_location(
        script.removesuffix(".py"), ROOT / "examples" / script
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TURN_LINE = re.compile(
    r"^(?P<customer>cust-\d+) turn (?P<id>\d+): slot (?P<slot>\d+), swap-in "
    r"(?P<swap>ram|disk|none)(?: \((?P<kib>[\d.]+) KiB, (?P<ms>[\d.]+) ms\))?, "
    r"prompt (?P<prompt>\d+) tok \(reused (?P<reused>\d+), evaluated (?P<evaluated>\d+)\), "
    r"batch max (?P<batch>\d+), TTFT (?P<ttft>\d+) ms \(engine (?P<engine>\d+) ms\)$",
    re.MULTILINE,
)
POOL_SUMMARY = re.compile(
    r"\npool: (?P<slots>\d+) slots of (?P<n_ctx>\d+) tokens \((?P<cells>\d+) KV cells\) for "
    r"(?P<customers>\d+) customers\nswap-ins: (?P<ram>\d+) from RAM, (?P<disk>\d+) from disk "
    r"\([\d.]+ MiB, \d+ ms\); swap-outs: (?P<out>\d+); re-prefills: (?P<reprefill>\d+)\n"
    r"batching: (?P<steps>\d+) decode steps, (?P<mean>[\d.]+) sequences per step on average, "
    r"(?P<max>\d+) at most\n\Z"
)


def test_support_bot(tmp_path: Path, tiny_llama3_path: Path) -> None:
    inbox: dict[str, list[str]] = example_module("support_bot.py").INBOX
    slots = 2
    assert len(inbox) > slots  # the point of the example: more customers than slots
    db = f"sqlite:///{tmp_path / 'bot.db'}"
    out, log = run(
        "support_bot.py",
        *("--model", str(tiny_llama3_path), "--max-tokens", "4", "--n-ctx", "512"),
        *("--slots", str(slots), "--db", db),
        cwd=tmp_path,
    )
    printed = {int(m["id"]): m.groupdict() for m in TURN_LINE.finditer(log)}
    with (
        Store(db) as store,
        Engine.load(tiny_llama3_path, n_ctx=512, slots=slots, n_threads=1) as engine,
    ):
        history = {c: store.messages(c) for c in inbox}
        turns = {c: store.turns(c) for c in inbox}
        system = {c: store.get_conversation(c).system_prompt for c in inbox}
        kv_cells = engine.info().kv_cells
        # Every customer's history: their messages in order, one stored reply to each.
        for customer, messages in inbox.items():
            roles = [m.role for m in history[customer]]
            assert roles == ["user", "assistant"] * len(messages)
            assert [m.content for m in history[customer][::2]] == messages
            assert len(turns[customer]) == len(messages)
        # The replies were printed round by round, in inbox order, each whole.
        exchanges = "".join(
            f"\n[{c}] {messages[r]}\n[ava] {history[c][2 * r + 1].content}\n"
            for r in range(max(map(len, inbox.values())))
            for c, messages in inbox.items()
            if r < len(messages)
        )
        assert out.startswith(exchanges)
        for customer in inbox:
            previous = None
            for i, turn in enumerate(turns[customer]):
                # The log line prints the stored turn record.
                line = printed.pop(turn.id)
                assert line["customer"] == customer and int(line["slot"]) == turn.slot
                assert line["swap"] == (turn.swap_in or "none")
                if turn.swap_in:
                    assert line["kib"] == f"{(turn.swap_in_bytes or 0) / 1024:.1f}"
                assert [int(line[k]) for k in ("prompt", "reused", "evaluated", "batch")] == [
                    turn.prompt_tokens,
                    turn.reused_tokens,
                    turn.evaluated_tokens,
                    turn.batch_max,
                ]
                assert line["ttft"] == f"{turn.ttft_ms or 0:.0f}"
                assert line["engine"] == f"{turn.engine_ttft_ms or 0:.0f}"
                # Leased from the pool (no pinned seq_id), on one of --slots slots.
                assert turn.slot is not None and 0 <= turn.slot < slots
                assert turn.slot == turn.seq_id and turn.reprefill_reason is None
                # The prompt, recounted from the stored conversation up to this message.
                sent = [{"role": "system", "content": system[customer]}] + [
                    m.to_openai() for m in history[customer][: 2 * i + 1]
                ]
                assert history[customer][2 * i].id == turn.user_message_id
                assert turn.prompt_tokens == len(engine.prompt_tokens(sent))
                # llama.cpp's cells of the turn's slot when it ended: what it reused plus
                # what it evaluated, then each generated token but the last one sampled.
                decoded = turn.generated_tokens - (turn.stop_reason == "length")
                assert turn.cells_used is not None
                assert turn.cells_used[str(turn.slot)] == turn.prompt_tokens + decoded
                assert turn.reused_tokens + turn.evaluated_tokens == turn.prompt_tokens
                if previous is None:  # a fresh conversation: nothing cached to reuse
                    assert turn.reused_tokens == 0 and turn.swap_in is None
                elif turn.swap_in or turn.slot == previous.slot:
                    # Its cache was still there or came back from the swap: the previous
                    # prompt is reused, only the reply and the new message are evaluated.
                    assert turn.reused_tokens >= previous.prompt_tokens
                previous = turn
        assert printed == {}  # no log line without a stored turn
    stored = [t for ts in turns.values() for t in ts]
    swapped = [t for t in stored if t.swap_in == "ram"]
    assert swapped, "more customers than slots: some came back to a swapped-out cache"
    # The pool summary counts what the stored turns record.
    summary = POOL_SUMMARY.search(out)
    assert summary is not None, out[-1000:]
    assert out == exchanges + summary.group(0)
    assert [int(summary[k]) for k in ("slots", "n_ctx", "cells", "customers")] == [
        slots,
        512,
        kv_cells,
        len(inbox),
    ]
    assert (int(summary["ram"]), int(summary["disk"])) == (len(swapped), 0)
    assert int(summary["out"]) >= len(swapped) and int(summary["reprefill"]) == 0
    assert int(summary["max"]) == max(t.batch_max or 1 for t in stored)
    assert 1.0 <= float(summary["mean"]) <= int(summary["max"])
    # Each step decodes one token of at most --slots sequences.
    decoded = sum(t.generated_tokens - (t.stop_reason == "length") for t in stored)
    assert int(summary["steps"]) >= decoded / slots


def table_rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["budget", "policy"])
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def test_tune_budget(tmp_path: Path, tiny_llama3_path: Path) -> None:
    out_dir = tmp_path / "t"
    out, _ = run(
        "tune_budget.py",
        *("--model", str(tiny_llama3_path), "--budgets", "384,768", "--out", str(out_dir)),
        cwd=tmp_path,
    )
    rows = json.loads((out_dir / "tune.json").read_text())
    with (out_dir / "tune.csv").open() as f:
        written = list(csv.DictReader(f))
    printed = table_rows(out)
    assert len(printed) == len(rows) == len(written) == 8
    for cells, row, line in zip(printed, rows, written, strict=True):
        facts = row["fact_retention"]
        assert cells == [
            str(row["budget"]),
            row["policy"],
            row["eviction"],
            f"{row['prefill_amplification']:.2f}",
            f"{row['cache_hit_ratio']:.2f}",
            str(facts) if facts is not None else "-",
        ]
        assert (line["budget"], line["policy"], line["eviction"]) == tuple(cells[:3])
        assert float(line["prefill_amplification"]) == pytest.approx(row["prefill_amplification"])
    # The recommendation, chosen again from the printed table by the documented rule: the
    # smallest budget whose fact retention is at least 0.9, then the lowest amplification.
    meeting = [c for c in printed if c[5] != "-" and float(c[5]) >= 0.9]
    best = min(meeting, key=lambda c: (int(c[0]), float(c[3])))
    recommended = ast.literal_eval(out.split("recommended: ", 1)[1].splitlines()[0])
    assert [str(recommended["budget"]), recommended["policy"], recommended["eviction"]] == best[:3]
    assert (out_dir / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


SUMMARY_LINE = re.compile(
    r"^(?P<id>\S+): (?P<turns>\d+) turns, amplification (?P<ampl>[\d.]+), cache hits "
    r"(?P<hits>\d+)%, facts kept (?P<facts>\S+)\n  costliest turn (?P<turn>\d+): evaluated "
    r"(?P<evaluated>\d+) of (?P<prompt>\d+) prompt tokens \((?P<kind>\w+) eviction, "
    r"(?P<shifted>\d+) tokens shifted",
    re.MULTILINE,
)


def short_logs(path: Path, turns: int = 24) -> Path:
    """The sample logs, each conversation cut after ``turns`` user turns (keeps it fast)."""
    lines = []
    for line in LOGS.read_text().splitlines():
        doc = json.loads(line)
        key = "messages" if "messages" in doc else "conversations"
        kept, users = [], 0
        for m in doc[key]:
            users += m.get("role", m.get("from")) in ("user", "human")
            if users > turns:
                break
            kept.append(m)
        lines.append(json.dumps(doc | {key: kept}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_replay_logs(tmp_path: Path, tiny_llama3_path: Path) -> None:
    # Teacher-forced (llama.cpp prefills every turn) and dry (tokenizer only) must print the
    # same figures; the turn counts are those of the input file, and the figures those of the
    # library's per-turn rows for the same replay.
    logs = short_logs(tmp_path / "logs.jsonl")
    printed = {}
    for mode in (["--dry-run"], []):
        out, _ = run(
            "replay_logs.py", str(logs), "--model", str(tiny_llama3_path), *mode, cwd=tmp_path
        )
        printed[bool(mode)] = [m.groupdict() for m in SUMMARY_LINE.finditer(out)]
        overall = re.search(r"overall: amplification ([\d.]+)", out)
        assert overall is not None
        printed[bool(mode)].append({"overall": overall.group(1)})
    assert printed[True] == printed[False]
    dry = printed[True]
    assert {d["id"]: int(d["turns"]) for d in dry[:-1]} == {
        "ticket-4100": 24,
        "ticket-4101": 24,
        "ticket-4102": 24,
        "ticket-4200-sharegpt": 24,
    }
    args = ["replay", str(logs), "--dry-run", "--budget", "512", "--json"]
    result = CliRunner().invoke(cli, [*args, "--model", str(tiny_llama3_path)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    for d in dry[:-1]:
        rows = [r for r in doc["turns"] if r["conversation"] == d["id"]]
        worst = max(rows, key=lambda r: r["evaluated_tokens"])
        assert (int(d["turn"]), int(d["evaluated"]), int(d["prompt"]), int(d["shifted"])) == (
            worst["turn"],
            worst["evaluated_tokens"],
            worst["prompt_tokens"],
            worst["shifted_tokens"],
        )
        evaluated = sum(r["evaluated_tokens"] for r in rows)
        new = sum(r["new_tokens"] for r in rows)
        assert d["ampl"] == f"{evaluated / new:.2f}"
        reused = sum(r["reused_tokens"] for r in rows)
        assert d["hits"] == f"{reused / sum(r['prompt_tokens'] for r in rows):.0%}"[:-1]
    total = sum(r["evaluated_tokens"] for r in doc["turns"]) / sum(
        r["new_tokens"] for r in doc["turns"]
    )
    assert dry[-1]["overall"] == f"{total:.2f}"
