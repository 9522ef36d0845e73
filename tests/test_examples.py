"""Every example runs as written (in a fast form: the tiny model, few tokens), and the figures
it prints are checked against what the database, the input logs or llama.cpp hold."""

from __future__ import annotations

import ast
import csv
import json
import re
import subprocess
import sys
from pathlib import Path

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


TURN_LINE = re.compile(
    r"^(?P<customer>cust-\d+) turn (?P<id>\d+): prompt (?P<prompt>\d+) tok "
    r"\(reused (?P<reused>\d+), evaluated (?P<evaluated>\d+), evicted (?P<evicted>\d+), "
    r"shifted (?P<shifted>\d+)\), KV cells (?P<cells>\{.*\}), TTFT (?P<ttft>\d+) ms$",
    re.MULTILINE,
)
EXCHANGE = re.compile(r"\n\[(cust-\d+)\] ([^\n]*)\n\[ava\] (.*?)\n(?=\n\[cust-|\Z)", re.DOTALL)


def test_support_bot(tmp_path: Path, tiny_llama3_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'bot.db'}"
    out, log = run(
        "support_bot.py",
        *("--model", str(tiny_llama3_path), "--max-tokens", "4", "--n-ctx", "512", "--db", db),
        cwd=tmp_path,
    )
    printed = [m.groupdict() for m in TURN_LINE.finditer(log)]
    exchanges = EXCHANGE.findall(out)
    assert [c for c, _ in [(p["customer"], 0) for p in printed]] == [c for c, _, _ in exchanges]
    assert len(printed) == 5
    slots = {"cust-42": "0", "cust-77": "1"}  # one KV sequence per customer, sorted
    with (
        Store(db) as store,
        Engine.load(tiny_llama3_path, n_ctx=512, n_threads=1) as engine,
    ):
        turns = {t.id: t for c in slots for t in store.turns(c)}
        history = {c: store.messages(c) for c in slots}
        system = {c: store.get_conversation(c).system_prompt for c in slots}
        previous: dict[str, dict[str, int]] = {}  # llama.cpp's cells after each customer's turn
        seen = {c: 0 for c in slots}
        for line, (customer, text, reply) in zip(printed, exchanges, strict=True):
            turn = turns[int(line["id"])]
            cells = ast.literal_eval(line["cells"])
            # The line prints the stored turn record.
            figures = ("prompt", "reused", "evaluated", "evicted", "shifted")
            assert [int(line[k]) for k in figures] == [
                turn.prompt_tokens,
                turn.reused_tokens,
                turn.evaluated_tokens,
                turn.evicted_tokens,
                turn.shifted_tokens,
            ]
            assert cells == turn.cells_used and turn.conversation_id == customer
            # The stored messages: the user's text and the streamed reply, in order.
            user, answer = history[customer][seen[customer] : seen[customer] + 2]
            seen[customer] += 2
            assert (user.content, answer.content) == (text, reply)
            # The prompt, recounted with llama.cpp's tokenizer from the stored conversation.
            sent = [{"role": "system", "content": system[customer]}] + [
                m.to_openai() for m in history[customer][: seen[customer] - 1]
            ]
            assert turn.prompt_tokens == len(engine.prompt_tokens(sent))
            # llama.cpp's cells for this customer's sequence: what it reused plus what it
            # evaluated (the prompt), then each generated token but the last one sampled.
            decoded = turn.generated_tokens - (turn.stop_reason == "length")
            slot = slots[customer]
            assert cells[slot] == turn.reused_tokens + turn.evaluated_tokens + decoded
            # What was cached before and not reused was removed; the other customer's
            # sequence was not touched.
            before = previous.get(customer, {}).get(slot, 0)
            assert turn.evicted_tokens == before - turn.reused_tokens
            for other, seq in slots.items():
                if other != customer and other in previous:
                    assert cells[seq] == previous[other][seq]
            previous[customer] = cells


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
