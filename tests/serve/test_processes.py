"""Two ``chatctx serve`` processes on one database take a conversation's turns one at a time.

Each process locks a conversation for its own turns; across processes the store's turn claim
does it. Oracle: the stored conversation read back, where every user message must be
followed by its own reply (before, the two processes' turns interleaved: user, user,
assistant, assistant).
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from chatctx.store import Store
from tests.serve.conftest import ROOT

DATABASES = ("sqlite", "postgresql")


def test_two_processes_take_one_conversations_turns_in_turn(
    start_server: Any, tiny_llama3_path: Path, embedder_path: Path, tmp_path: Path, pg_url: str
) -> None:
    for db in DATABASES:
        url = f"sqlite:///{tmp_path / 'shared.db'}" if db == "sqlite" else pg_url
        env = {"CHATCTX_HOME": str(tmp_path / "home"), "CHATCTX_EMBEDDER": str(embedder_path)}
        args = ("--n-ctx", "1024", "--slots", "2", "--db", url)
        servers = [start_server(tiny_llama3_path, *args, env=env) for _ in range(2)]

        def turn(i: int, servers: list[Any] = servers) -> int:
            response = httpx.post(
                f"{servers[i % 2].url}/v1/chat/completions",
                json={
                    "conversation": "shared",
                    "messages": [{"role": "user", "content": f"question {i} from worker {i % 2}"}],
                    "max_tokens": 48,
                    "temperature": 0,
                },
                timeout=120,
            )
            return response.status_code

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            codes = list(pool.map(turn, range(12)))
        assert codes == [200] * 12, codes
        with Store(url) as store:
            messages = store.messages("shared")
            claim = store.turn_claim("shared")
        pairs = [(m.role, m.content) for m in messages]
        assert [role for role, _ in pairs] == ["user", "assistant"] * 12, pairs
        assert sorted(text for role, text in pairs if role == "user") == sorted(
            f"question {i} from worker {i % 2}" for i in range(12)
        )
        assert claim is None  # every turn let its claim go
        for server in servers:
            server.stop()


def test_a_claim_left_by_a_killed_process_is_taken_over_at_once(
    start_server: Any, tiny_llama3_path: Path, embedder_path: Path, tmp_path: Path
) -> None:
    """A process killed with kill -9 mid-turn leaves the conversation's turn claim behind (it
    would hold 60 s); a serve process on the same machine sees that process gone and takes
    the conversation's next turn at once, not a 409 after ``--conversation-wait``."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    Store(url).close()  # migrated before the two processes use it
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from chatctx.store._turn_claim import new_owner\n"
            "from chatctx.store import Store\n"
            "assert Store(sys.argv[1]).claim_turn('shared', new_owner(), 60.0)\n"
            "print('held', flush=True)\n"
            "time.sleep(120)\n",
            url,
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    holder.kill()
    holder.wait()
    with Store(url) as store:
        left = store.turn_claim("shared")
    assert left is not None and f":{holder.pid}:" in left[0]  # the dead process's claim
    env = {"CHATCTX_HOME": str(tmp_path / "home"), "CHATCTX_EMBEDDER": str(embedder_path)}
    args = ("--n-ctx", "1024", "--db", url, "--conversation-wait", "3")
    server = start_server(tiny_llama3_path, *args, env=env)
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "conversation": "shared",
            "messages": [{"role": "user", "content": "hello, are you there?"}],
            "max_tokens": 8,
            "temperature": 0,
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    reply = response.json()["choices"][0]["message"]["content"]
    with Store(url) as store:
        stored = [(m.role, m.content) for m in store.messages("shared")]
        assert store.turn_claim("shared") is None
    assert stored == [("user", "hello, are you there?"), ("assistant", reply)]
