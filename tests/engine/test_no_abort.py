"""Would-be crashes run in a child process: each must end in a chatctx error, not a signal.

Before the checks these aborted the interpreter (SIGSEGV on a freed context, GGML_ASSERT on
an unknown sequence). The oracle is the child's exit status and its last line.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PRELUDE = """
import sys
from chatctx import ChatSession, Engine
from chatctx.errors import ChatctxError
engine = Engine.load(sys.argv[1], n_ctx=256)
"""

CASES = {
    "info after close": "engine.close(); engine.info()",
    "kv cells after close": "engine.close(); engine.kv_usage()",
    "tokenize after close": "engine.close(); engine.tokenize('hi')",
    "clear unknown sequence": "engine.clear(7)",
    "negative sequence": "engine.kv_cells(-1)",
    "generate on unknown sequence": "engine.generate([1, 2, 3], seq_id=3)",
    "generation iterated after close": (
        "g = engine.generate(engine.prompt_tokens([{'role': 'user', 'content': 'hi'}]));"
        "next(iter(g), None); engine.close(); list(g); print('ended', g.result.stop_reason);"
        "engine.info()"
    ),
    "logits at a bad index": "engine.context.logits(5)",
    "stream collected after its session closed": (
        "import gc\n"
        "chat = ChatSession.open('sqlite://', model=engine, settings={'max_tokens': 8})\n"
        "s = chat.stream('hello'); next(s); engine.close(); chat.close(); del s; gc.collect()\n"
        "print('collected'); engine.info()"
    ),
}


def run_child(code: str, model: Path) -> subprocess.CompletedProcess[str]:
    script = PRELUDE + textwrap.dedent(
        f"""
try:
{textwrap.indent(code, "    ")}
except ChatctxError as exc:
    print("chatctx error:", type(exc).__name__, exc)
    sys.exit(0)
print("no error")
"""
    )
    return subprocess.run(
        [sys.executable, "-c", script, str(model)], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("name", list(CASES))
def test_no_process_abort(name: str, tiny_llama3_path: Path) -> None:
    result = run_child(CASES[name], tiny_llama3_path)
    assert result.returncode == 0, f"{name}: exit {result.returncode}\n{result.stderr[-2000:]}"
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("chatctx error: "), f"{name}: {result.stdout}"
    if "after close" in name or "closed" in name:
        assert "ClosedError" in last
    else:
        assert "ConfigError" in last or "GenerationError" in last


def test_close_ends_a_stream_running_in_another_thread(tiny_llama3_path: Path) -> None:
    import threading

    from chatctx import Engine
    from chatctx.settings import GenerationSettings

    # The tiny model makes 400 tokens in about 0.5 s here, and llama.cpp's threads can keep
    # this thread from running that long on 2 cores: a reply long enough to outlast that.
    most = 4000
    with Engine.load(tiny_llama3_path, n_ctx=4096) as engine:
        prompt = engine.prompt_tokens([{"role": "user", "content": "count to a thousand"}])
        generation = engine.generate(
            prompt, settings=GenerationSettings(max_tokens=most, temperature=0.0)
        )
        started = threading.Event()
        chunks: list[str] = []

        def consume() -> None:
            for chunk in generation:
                chunks.append(chunk)
                started.set()

        worker = threading.Thread(target=consume)
        worker.start()
        assert started.wait(30)
        engine.close()
        worker.join(30)
        assert not worker.is_alive()
        assert generation.result is not None
        assert generation.result.stop_reason in ("closed", "interrupted")
        assert generation.result.usage.generated_tokens < most
