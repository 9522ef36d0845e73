"""Two threads on one engine: a turn and a background side generation interleave safely.

Oracle: the same greedy generation run alone on a fresh engine of the same configuration
(split KV streams, where llama.cpp's results do not depend on other sequences).
"""

from __future__ import annotations

import threading
from pathlib import Path

from chatctx import Engine
from chatctx.errors import GenerationError
from chatctx.settings import GenerationSettings
from tests.llama_counters import counted, prime_counters

GREEDY = GenerationSettings(max_tokens=24, temperature=0.0, repeat_penalty=1.0)
MESSAGES = [
    {"role": "system", "content": "You are a support assistant."},
    {"role": "user", "content": "My router drops the connection every evening, why?"},
]
SIDE = [{"role": "user", "content": "Summarize: " + "the customer talked about routers. " * 20}]


def solo(path: Path) -> tuple[tuple[int, ...], str]:
    with Engine.load(path, n_ctx=512, n_seq_max=2, kv_unified=False) as engine:
        result = engine.generate(engine.prompt_tokens(MESSAGES), settings=GREEDY).wait()
        side = engine.side_generate(engine.prompt_tokens(SIDE), settings=GREEDY)
        return result.tokens, side


def test_turn_and_background_side_generation_match_solo_runs(tiny_llama3_path: Path) -> None:
    expected_tokens, expected_side = solo(tiny_llama3_path)
    with Engine.load(tiny_llama3_path, n_ctx=512, n_seq_max=2, kv_unified=False) as engine:
        side_text: list[str] = []
        side_started = threading.Event()

        def background() -> None:
            side_started.set()
            side_text.append(
                engine.side_generate(engine.prompt_tokens(SIDE), settings=GREEDY, background=True)
            )

        worker = threading.Thread(target=background)
        worker.start()
        side_started.wait(10)
        results = []
        for _ in range(3):  # several turns while the side generation runs
            engine.clear(0)
            generation = engine.generate(engine.prompt_tokens(MESSAGES), settings=GREEDY)
            results.append(generation.wait())
        worker.join(120)
        assert not worker.is_alive()
        assert all(r.tokens == expected_tokens for r in results)
        assert side_text == [expected_side]
        # The spare sequence is emptied after a side generation; the turn's cells are intact.
        spare = engine.spare_seq
        assert spare is not None and engine.kv_cells(spare) == 0
        assert engine.kv_cells(0) == len(engine.cached_tokens(0))


def test_cancel_side_stops_a_side_generation_in_its_prefill(tiny_llama3_path: Path) -> None:
    # Cancelling must not wait for a first token: a long background prefill yields none.
    long_side = [{"role": "user", "content": "Summarize: " + "routers and modems. " * 150}]
    with Engine.load(tiny_llama3_path, n_ctx=1024, n_seq_max=2, n_threads=1) as engine:
        spare = engine.spare_seq
        assert spare is not None
        prompt = engine.prompt_tokens(long_side)
        prime_counters(engine)
        before = counted(engine)
        cancel = threading.Event()
        raised: list[BaseException] = []

        def side() -> None:
            try:
                engine.side_generate(prompt, settings=GREEDY, background=True, cancel=cancel)
            except BaseException as exc:
                raised.append(exc)

        worker = threading.Thread(target=side)
        worker.start()
        for _ in range(4000):  # until llama.cpp holds part of the prompt
            if engine.kv_cells(spare) > 0:
                break
            threading.Event().wait(0.001)
        cells_at_cancel = engine.kv_cells(spare)
        engine.cancel_side(cancel)
        worker.join(60)
        assert not worker.is_alive()
        assert 0 < cells_at_cancel < len(prompt)  # it was cancelled while prefilling ...
        assert counted(engine) - before < len(prompt)  # ... and llama.cpp never finished it
        assert len(raised) == 1 and isinstance(raised[0], GenerationError)
        assert engine.kv_cells(spare) == 0  # emptied, read from llama.cpp
        engine.clear()  # nothing holds a sequence any more
