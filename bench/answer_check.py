"""Do the facts a prompt keeps reach the model's answer? Layouts side by side, on a real model.

    python bench/answer_check.py [--layouts append,abridge] [--budget 1024] [--chats 40]
        [--probes bench/facts/final_probes.jsonl.gz] [--max-tokens 48] [--model GGUF]

Each chat is replayed teacher-forced without a model through llama-server's simulated walk
(as ``memory_cost.py``), and at each turn that asks for a planted fact the prompt chatctx
built is kept. Then a real model (SmolLM2-135M-Instruct unless ``--model``) answers each kept
prompt greedily, on one sequence cleared before each prompt. An answer counts when it holds
every word of the fact that says something ("the light rail": "light" and "rail"; "about
1200": "1200"), case aside. Prints, per layout: facts in the prompt (retention), answers
that say the fact, and those among the prompts that held it. The same model and settings
for every layout, so the layouts differ only in what the prompt says and how.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Any

import recall_bench as rb
from llama_server_bench import RESERVE

from chatctx.backends.engine import Engine
from chatctx.context import BuildResult, ContextBuilder
from chatctx.model.codec import open_codec
from chatctx.model.memory import pad256
from chatctx.model.paths import default_model_path
from chatctx.replay import DryBackend, ReplayConfig, Replayer
from chatctx.replay._run import _retained
from chatctx.settings import GenerationSettings

_FILLER = frozenset("the a an about around my like".split())  # noqa: SIM905
_WORD = re.compile(r"[\w$']+")


def says(fact: str, answer: str) -> bool:
    """Whether ``answer`` holds every word of ``fact`` that says something."""
    words = [w for w in _WORD.findall(fact.casefold()) if w not in _FILLER] or [fact.casefold()]
    text = answer.casefold()
    return all(w in text for w in words)


def prompts(args: argparse.Namespace, layout: str, model: Path) -> list[dict[str, Any]]:
    """The prompt of every probe turn of the first ``--chats`` chats, in ``layout``."""
    codec = open_codec(model)
    conversations, _ = rb.load(args.probes)
    config = ReplayConfig(
        mode="teacher", budget=args.budget, reserve=RESERVE, recall=True, layout=layout
    )
    builds: list[BuildResult] = []
    original = ContextBuilder.build

    def recording(self: ContextBuilder, **kwargs: Any) -> BuildResult:
        built = original(self, **kwargs)
        builds.append(built)
        return built

    out: list[dict[str, Any]] = []
    ContextBuilder.build = recording  # type: ignore[method-assign]
    try:
        for c in conversations[: args.chats]:
            turns: list[Any] = []
            builds.clear()
            with (
                DryBackend(
                    codec,
                    n_ctx=pad256(args.budget + RESERVE),
                    model_path=model,
                    cache_edits="deletions",
                ) as dry,
                Replayer(config, engine=dry) as replayer,
            ):
                replayer.replay(c, on_turn=turns.append)
            asked = {p.asked_turn: p for p in c.probes}
            for index, built in enumerate(builds[-len(turns) :]):
                probe = asked.get(index)
                if probe is not None:
                    out.append(
                        {
                            "chat": c.id,
                            "turn": index,
                            "fact": probe.fact,
                            "tokens": built.tokens,
                            # retention as the replay counts it: before the question
                            "kept": _retained(probe.fact, built.messages[:-1]),
                        }
                    )
    finally:
        ContextBuilder.build = original  # type: ignore[method-assign]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="append,abridge")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--chats", type=int, default=40)
    parser.add_argument("--probes", type=Path, default=rb.HERE / "facts" / "final_probes.jsonl.gz")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    model = args.model or default_model_path()
    layouts = args.layouts.split(",")
    kept = {layout: prompts(args, layout, model) for layout in layouts}
    settings = GenerationSettings(max_tokens=args.max_tokens, temperature=0.0)
    n_ctx = pad256(args.budget + RESERVE + args.max_tokens)
    print(f"{args.probes.name}, {args.chats} chats, budget {args.budget}, {model.name}, greedy")
    print("| layout | facts in the prompt | answers saying the fact | of those in the prompt |")
    print("|---|---|---|---|")
    with Engine.load(model, n_ctx=n_ctx, n_seq_max=1, n_threads=args.threads) as engine:
        for layout in layouts:
            items = kept[layout]
            started = time.perf_counter()
            right = right_kept = 0
            for item in items:
                engine.clear(0)
                result = engine.generate(item["tokens"], seq_id=0, settings=settings).wait()
                item["said"] = says(item["fact"], result.text)
                right += item["said"]
                right_kept += item["said"] and item["kept"]
            n_kept = sum(i["kept"] for i in items)
            print(
                f"| {layout} | {n_kept}/{len(items)} | {right}/{len(items)} | "
                f"{right_kept}/{n_kept} | ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    if len(layouts) == 2:
        a, b = layouts
        pairs = list(zip(kept[a], kept[b], strict=True))
        only = [sum(x["said"] and not y["said"] for x, y in pairs)]
        only.append(sum(y["said"] and not x["said"] for x, y in pairs))
        print(f"answered in {a} only: {only[0]}; in {b} only: {only[1]}")


if __name__ == "__main__":
    main()
