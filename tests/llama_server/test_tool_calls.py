"""Agent turns on the llama-server backend: chatctx renders the tools and parses the calls
(the server gets token arrays), the grammar goes to the server's sampler, and a call made
on one backend is answered on another after the first is lost.

Oracles: the offered schema (a random model writes noise unless the server's sampler holds
it to the grammar), llama-server's own ``cache_n`` for the continued turn, and the rows."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from chatctx import ChatSession, Engine
from chatctx.backends.llama_server import LlamaServerBackend, LlamaServerProcess
from chatctx.testing import LLAMA31_TOOLS_TEMPLATE, write_tiny_llama3
from tests.llama_server.conftest import start_server
from tests.tool_schemas import LOOKUP

TOOLS = [LOOKUP]
SAMPLING = {"max_tokens": 60, "seed": 9}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tool-model")
    return write_tiny_llama3(folder / "tiny-llama31.gguf", chat_template=LLAMA31_TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def tool_server(
    llama_server_binary: Path, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServerProcess]:
    process = start_server(llama_server_binary, model, tmp_path_factory.mktemp("tool-server"))
    try:
        yield process
    finally:
        process.stop()


def test_a_required_call_is_held_by_the_servers_sampler_and_the_turn_goes_on(
    tool_server: LlamaServerProcess, model: Path, db_url: str
) -> None:
    with (
        LlamaServerBackend(tool_server.url, model=model) as backend,
        ChatSession.open(db_url, backend=backend, settings=SAMPLING) as chat,
    ):
        assert backend.codec().tool_format == "llama3"
        reply = chat.send("Where is my order?", tools=TOOLS, tool_choice="required")
        assert reply.tool_calls and reply.warning is None, reply.text
        for call in reply.tool_calls:
            assert call.name == "lookup_order"
            arguments = json.loads(call.arguments)
            assert set(arguments) == {"order_id"} and len(arguments["order_id"]) <= 8
        final = chat.submit_tool_results({c.id: "shipped" for c in reply.tool_calls})
        turns = chat.store.turns(chat.conversation_id)
        assert len(turns) == 2 and turns[0].tool_calls == len(reply.tool_calls)
        # llama-server's own counter: the continued turn found its prompt's start cached.
        assert turns[1].reused_tokens >= turns[0].prompt_tokens
        assert final.usage.prompt_tokens == turns[1].prompt_tokens
        roles = [m.role for m in chat.history()]
        assert roles == ["user", "assistant", *["tool"] * len(reply.tool_calls), "assistant"]


def test_calls_made_on_a_backend_that_is_lost_are_answered_on_another(
    tool_server: LlamaServerProcess, model: Path, db_url: str
) -> None:
    # The open turn lives in the store: the calls made through llama-server are answered
    # through the in-process engine (another backend, another process's cache).
    with (
        LlamaServerBackend(tool_server.url, model=model) as backend,
        ChatSession.open(
            db_url, conversation_id="moved", backend=backend, settings=SAMPLING
        ) as chat,
    ):
        reply = chat.send("Check order D-4", tools=TOOLS, tool_choice="required")
    assert reply.tool_calls
    with (
        Engine.load(model, n_ctx=1024) as engine,
        ChatSession.open(db_url, conversation_id="moved", backend=engine) as again,
    ):
        assert [c["id"] for c in again.waiting_tool_calls()] == [c.id for c in reply.tool_calls]
        final = again.submit_tool_results(
            {c.id: "delivered" for c in reply.tool_calls}, tools=TOOLS, tool_choice="none"
        )
        assert final.message_id is not None and again.waiting_tool_calls() == []
        turns = again.store.turns("moved")
        assert turns[-1].reused_tokens == 0  # a new cache: all of it prefilled again
