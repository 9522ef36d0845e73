"""``chatctx serve --backend URL``: the service runs its turns on real llama-servers.

Oracles: the llama-servers' own counters (``/metrics``) and the store ``serve`` wrote.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from openai import OpenAI

from chatctx.backends.llama_server import LlamaServerBackend, LlamaServerProcess
from chatctx.backends.llama_server._slot_files import swap_filename
from chatctx.serve import Limits, ServeConfig, create_app
from chatctx.store import Store
from tests.llama_server.conftest import start_server
from tests.llama_server.test_router_servers import metrics
from tests.serve.conftest import ServerProcess

pytestmark = pytest.mark.slow


def _talk(
    serve: ServerProcess, conversation: str, turns: int, ask: str = "where is my parcel?"
) -> None:
    client = OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0, timeout=600)
    for turn in range(turns):
        reply = client.chat.completions.create(
            model="chatctx",
            messages=[{"role": "user", "content": f"question {turn}: {ask}"}],
            max_tokens=4,
            temperature=0,
            extra_body={"conversation": conversation},
        )
        assert reply.choices[0].message.content is not None


def test_serve_runs_turns_on_one_llama_server(
    server: LlamaServerProcess, smollm2_path: Path, tmp_path: Path
) -> None:
    before = metrics(server.url)
    serve = ServerProcess(tmp_path, smollm2_path, "--backend", server.url)
    try:
        _talk(serve, "via-server", 3)
    finally:
        assert serve.stop() == 0
    with serve.store() as store:
        turns = store.turns("via-server")
    assert len(turns) == 3 and {t.backend for t in turns} == {server.url}
    assert turns[-1].reused_tokens > 0  # the conversation stayed in its slot
    evaluated = metrics(server.url)["prompt_tokens_total"] - before["prompt_tokens_total"]
    assert evaluated == sum(t.evaluated_tokens for t in turns)


def test_serve_routes_over_several_llama_servers(
    llama_server_binary: Path, smollm2_path: Path, tmp_path: Path
) -> None:
    servers = [
        start_server(llama_server_binary, smollm2_path, tmp_path / name, slots=3, n_ctx=512)
        for name in ("a", "b")
    ]
    try:
        before = {s.url: metrics(s.url) for s in servers}
        urls = " ".join(s.url for s in servers)
        serve = ServerProcess(
            tmp_path, smollm2_path, env={"CHATCTX_BACKENDS": urls}
        )  # the URLs from the environment: a router over both
        try:
            for i in range(6):
                _talk(serve, f"cust-{i}", 2)
        finally:
            assert serve.stop() == 0
        with serve.store() as store:
            placed = {f"cust-{i}": store.get_placement(f"cust-{i}") for i in range(6)}
            turns = {cid: store.turns(cid) for cid in placed}
        assert {p.backend for p in placed.values() if p} == {s.url for s in servers}
        for cid, placement in placed.items():
            assert placement is not None
            assert {t.backend for t in turns[cid]} == {placement.backend}
        for s in servers:
            evaluated = metrics(s.url)["prompt_tokens_total"] - before[s.url]["prompt_tokens_total"]
            mine = [t for ts in turns.values() for t in ts if t.backend == s.url]
            assert evaluated == sum(t.evaluated_tokens for t in mine), s.url
    finally:
        for s in servers:
            s.stop()


@pytest.mark.parametrize("summary_slot", [False, True])
def test_every_server_slot_serves_customers_unless_a_summary_slot_is_asked_for(
    llama_server_binary: Path, smollm2_path: Path, tmp_path: Path, summary_slot: bool
) -> None:
    # Two slots, two customers, the default (extractive) summarizer. The oracle is the
    # server's own cache reuse (cache_n) on each customer's second turn: with both slots
    # serving, each keeps its cache; with one kept for summaries they share the other, and
    # each turn finds the other customer's prompt there (no swap path given).
    server = start_server(llama_server_binary, smollm2_path, tmp_path / "server", slots=2)
    try:
        flag = ["--summary-slot"] if summary_slot else []
        serve = ServerProcess(tmp_path, smollm2_path, "--backend", server.url, *flag)
        try:
            asks = {"left": "my parcel never came, order 4471", "right": "refund the blue lamp"}
            for _ in range(2):
                for customer, ask in asks.items():
                    _talk(serve, customer, 1, ask)
        finally:
            assert serve.stop() == 0
        with serve.store() as store:
            turns = {cid: store.turns(cid) for cid in ("left", "right")}
    finally:
        server.stop()
    slots = {t.slot for ts in turns.values() for t in ts}
    assert slots == ({0} if summary_slot else {0, 1})
    for cid, (first, second) in turns.items():
        kept = second.reused_tokens >= first.prompt_tokens
        assert kept is not summary_slot, (cid, first.prompt_tokens, second.reused_tokens)


def _serve_with_slot_files(
    server: LlamaServerProcess, model: Path, folder: Path, *extra: str
) -> ServerProcess:
    """``chatctx serve`` in front of ``server``, saving slots to its ``--slot-save-path``."""
    assert server.slot_save_path is not None
    return ServerProcess(
        folder,
        model,
        "--backend",
        server.url,
        "--slot-save-path",
        str(server.slot_save_path),
        *extra,
    )


def test_serve_swaps_a_slot_given_away_to_the_servers_slot_save_path(
    llama_server_binary: Path, smollm2_path: Path, tmp_path: Path
) -> None:
    # One slot: two customers take turns on it. With --slot-save-path each one's slot is
    # saved when the other takes it and restored when it comes back; the store's turn records
    # and the server's own files are the oracle. --swap-disk-mb 1 holds one file (about 2 MB
    # each): the one a returning customer is about to restore must not be the one deleted to
    # make room.
    server = start_server(llama_server_binary, smollm2_path, tmp_path / "server", slots=1)
    assert server.slot_save_path is not None
    try:
        serve = _serve_with_slot_files(server, smollm2_path, tmp_path, "--swap-disk-mb", "1")
        try:
            for _ in range(2):
                for customer in ("left", "right"):
                    _talk(serve, customer, 1)
        finally:
            assert serve.stop() == 0
        with serve.store() as store:
            turns = {cid: store.turns(cid) for cid in ("left", "right")}
    finally:
        server.stop()
    for cid, (first, second) in turns.items():
        assert second.swap_in == "disk" and second.reprefill_reason is None, cid
        assert second.reused_tokens >= first.prompt_tokens, cid  # the server's cache_n
        assert (server.slot_save_path / swap_filename(cid)).stat().st_size > 0


class _SlowCompletions:
    """A TCP proxy to a llama-server that holds each ``POST /completion`` back ``delay``
    seconds, as a long prefill on a busy GPU would; everything else passes at once."""

    def __init__(self, port: int, delay: float) -> None:
        self.port, self.delay = port, delay
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        first = client.recv(65536)
        if first.startswith(b"POST /completion"):
            time.sleep(self.delay)
        with client, socket.create_connection(("127.0.0.1", self.port)) as upstream:
            upstream.sendall(first)
            pair = {client: upstream, upstream: client}
            with contextlib.suppress(OSError):
                while data := (ready := select.select(list(pair), [], [])[0][0]).recv(65536):
                    pair[ready].sendall(data)


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_cut_in_its_prefill_on_llama_server_answers_504(
    server: LlamaServerProcess, smollm2_path: Path, tmp_path: Path, stream: bool
) -> None:
    proxy = _SlowCompletions(int(server.url.rsplit(":", 1)[1]), delay=4.0)
    backend = LlamaServerBackend(proxy.url, model=smollm2_path)
    store = Store(f"sqlite:///{tmp_path / 'serve.db'}")
    app = create_app(
        ServeConfig(limits=Limits(request_timeout_s=1.5)), backend=backend, store=store
    )
    sock = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on"))
    threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        while not _ready(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        body = {
            "conversation": "p1",
            "max_tokens": 8,
            "stream": stream,
            "messages": [{"role": "user", "content": "hi"}],
        }
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        # No token came before the request timeout: a 504 (as on the in-process engine), and
        # the user message, stored by the turn, must not be sent again.
        assert response.status_code == 504, response.text
        assert response.headers.get("x-should-retry") == "false"
        assert [(m.role, m.content) for m in store.messages("p1")] == [("user", "hi")]
        assert [t.stop_reason for t in store.turns("p1")] == ["interrupted"]
    finally:
        uv.should_exit = True
        time.sleep(0.3)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_fork_on_llama_server_starts_from_a_copy_of_its_cache(
    server: LlamaServerProcess, smollm2_path: Path, tmp_path: Path
) -> None:
    # A response continuing an earlier one forks the conversation: the source's slot is saved
    # to the server's --slot-save-path and restored into the branch's, so the prefix they share
    # is not evaluated again. The oracle: the prompt tokens llama-server counts (/metrics).
    serve = _serve_with_slot_files(server, smollm2_path, tmp_path)
    client = OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0, timeout=600)
    sampling: dict[str, Any] = {"model": "any", "max_output_tokens": 4, "temperature": 0}
    try:
        ids: list[str] = []
        for question in ("My parcel has not come.", "It was due on Monday.", "Who carries it?"):
            previous = ids[-1] if ids else None
            ids.append(
                client.responses.create(
                    input=question, previous_response_id=previous, **sampling
                ).id
            )
        before = metrics(server.url)["prompt_tokens_total"]
        fork = client.responses.create(
            input="Cancel it instead.", previous_response_id=ids[1], **sampling
        )
        evaluated = metrics(server.url)["prompt_tokens_total"] - before
    finally:
        assert serve.stop() == 0
    with serve.store() as store:
        source = store.get_response(ids[0])
        branch = store.get_response(fork.id)
        assert source is not None and branch is not None
        assert branch.conversation_id != source.conversation_id
        second = store.turns(source.conversation_id)[1]
        fork_turn = store.turns(branch.conversation_id)[-1]
    # The branch's prompt begins with the second turn's prompt: the server evaluated at most
    # what follows it (the second reply and the new question).
    assert fork_turn.prompt_tokens > second.prompt_tokens
    assert evaluated <= fork_turn.prompt_tokens - second.prompt_tokens
    assert fork_turn.reused_tokens >= second.prompt_tokens
