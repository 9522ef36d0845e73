"""The official ``openai`` client runs a tool loop against ``chatctx serve``: stateful and
stateless, streaming and not, on the tiny Llama 3 with a Llama 3.1-style template and
grammar-held calls. Oracles: the database rows, the offered schemas, and the same request
answered without streaming."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from chatctx.testing import LLAMA31_TOOLS_TEMPLATE, write_tiny_llama3
from tests.serve.conftest import ServerProcess
from tests.tool_schemas import LOOKUP

TOOLS: Any = [LOOKUP]
SYSTEM = "You are a support agent."


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, embedder_path: Path
) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("tool-server")
    model = write_tiny_llama3(folder / "tiny-llama31.gguf", chat_template=LLAMA31_TOOLS_TEMPLATE)
    started = ServerProcess(
        folder,
        model,
        "--n-ctx",
        "1024",
        "--slots",
        "2",
        env={"CHATCTX_HOME": str(folder / "home"), "CHATCTX_EMBEDDER": str(embedder_path)},
    )
    yield started
    started.stop()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _valid(name: str, arguments: str) -> None:
    assert name == "lookup_order"
    parsed = json.loads(arguments)
    assert set(parsed) == {"order_id"} and len(parsed["order_id"]) <= 8


def _required_call(client: openai.OpenAI, asked: Any, stream: bool, options: Any) -> Any:
    """The reply to ``asked`` held to a call: streamed and assembled by the client's helper
    (with usage), or whole."""
    if not stream:
        return client.chat.completions.create(messages=asked, tool_choice="required", **options)
    with client.chat.completions.stream(
        messages=asked, tool_choice="required", stream_options={"include_usage": True}, **options
    ) as events:
        return events.get_final_completion()


def _calls(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


@pytest.mark.parametrize("stream", [False, True])
def test_stateful_tool_loop_sending_only_the_results(server: ServerProcess, stream: bool) -> None:
    client = _client(server)
    conversation = f"agent-stateful-{stream}"
    asked: Any = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Where is my order?"},
    ]
    options: Any = {
        "model": "chatctx",
        "tools": TOOLS,
        "max_tokens": 60,
        "seed": 11,
        "extra_body": {"conversation": conversation},
    }
    first = _required_call(client, asked, stream, options)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls
    for name, arguments in _calls(choice.message):
        _valid(name, arguments)
    results: Any = [
        {"role": "tool", "tool_call_id": c.id, "content": '{"status": "shipped"}'} for c in calls
    ]
    second = client.chat.completions.create(messages=results, tool_choice="none", **options)
    assert second.choices[0].message.tool_calls is None
    text = second.choices[0].message.content
    assert second.choices[0].finish_reason in ("stop", "length")
    with server.store() as store:
        history = store.messages(conversation)  # no API keys: stored under the client's id
        turns = store.turns(conversation)
    assert [m.role for m in history] == ["user", "assistant", *["tool"] * len(calls), "assistant"]
    assert history[1].tool_calls is not None
    stored = [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in history[1].tool_calls
    ]
    assert stored == [(c.id, c.function.name, c.function.arguments) for c in calls]
    assert [m.tool_call_id for m in history if m.role == "tool"] == [c.id for c in calls]
    assert history[-1].content == text
    assert len(turns) == 2 and turns[0].tool_calls == len(calls)
    for response, turn in zip((first, second), turns, strict=True):
        assert response.usage is not None
        assert response.usage.prompt_tokens == turn.prompt_tokens
        assert response.usage.completion_tokens == turn.generated_tokens
    assert turns[1].reused_tokens >= turns[0].prompt_tokens  # the turn went on in its cache


def test_streamed_calls_equal_the_same_request_answered_whole(server: ServerProcess) -> None:
    client = _client(server)
    asked: Any = [{"role": "user", "content": "Order A-7 please"}]
    options: Any = {"model": "chatctx", "tools": TOOLS, "tool_choice": "required", "seed": 3}
    whole = client.chat.completions.create(messages=asked, max_tokens=60, **options)
    with client.chat.completions.stream(messages=asked, max_tokens=60, **options) as events:
        streamed = events.get_final_completion()
    assert _calls(streamed.choices[0].message) == _calls(whole.choices[0].message)
    assert _calls(whole.choices[0].message)


@pytest.mark.parametrize("stream", [False, True])
def test_stateless_tool_loop_with_the_whole_history(server: ServerProcess, stream: bool) -> None:
    client = _client(server)
    asked: Any = [{"role": "user", "content": "Where is B-2?"}]
    options: Any = {"model": "chatctx", "tools": TOOLS, "max_tokens": 60, "seed": 5}
    first = _required_call(client, asked, stream, options)
    message = first.choices[0].message
    assert message.tool_calls and first.choices[0].finish_reason == "tool_calls"
    history: Any = [
        *asked,
        {
            "role": "assistant",
            "content": message.content,
            "tool_calls": [c.model_dump(exclude_none=True) for c in message.tool_calls],
        },
        *[
            {"role": "tool", "tool_call_id": c.id, "content": "in the depot"}
            for c in message.tool_calls
        ],
    ]
    second = client.chat.completions.create(messages=history, tool_choice="none", **options)
    assert second.choices[0].message.tool_calls is None
    assert second.usage is not None and first.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    # Stateless: nothing of either request stays in the database.
    with server.store() as store:
        assert not [c for c in store.list_conversations() if c.id.startswith("stateless-")]


def test_bad_tool_requests_get_400_naming_the_field_and_store_nothing(
    server: ServerProcess,
) -> None:
    client = _client(server)
    conversation = "agent-bad"
    base: Any = {"model": "chatctx", "max_tokens": 60, "extra_body": {"conversation": conversation}}
    bad_tool: Any = [{"type": "function", "function": {"name": "no spaces allowed"}}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            messages=[{"role": "user", "content": "hi"}], tools=bad_tool, **base
        )
    assert refused.value.body["param"] == "tools[0].function.name"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            messages=[{"role": "tool", "tool_call_id": "call_nothing", "content": "x"}],
            tools=TOOLS,
            **base,
        )
    assert refused.value.body["param"] == "messages[0]"  # type: ignore[index]
    first = client.chat.completions.create(
        messages=[{"role": "user", "content": "Where is C-3?"}],
        tools=TOOLS,
        tool_choice="required",
        **base,
    )
    calls = first.choices[0].message.tool_calls
    assert calls
    with server.store() as store:
        before = len(store.messages(conversation))
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            messages=[
                {"role": "tool", "tool_call_id": "call_unknown", "content": "x"},
                *[{"role": "tool", "tool_call_id": c.id, "content": "x"} for c in calls],
            ],
            tools=TOOLS,
            **base,
        )
    assert refused.value.body["param"] == "messages[0].tool_call_id"  # type: ignore[index]
    with server.store() as store:
        assert len(store.messages(conversation)) == before


def test_sigterm_between_the_calls_and_their_results_loses_nothing(
    tmp_path: Path, embedder_path: Path
) -> None:
    # The server is stopped (SIGTERM: it drains) after the reply that calls, and a new one on
    # the same database takes the results: the calls were stored with their turn.
    model = write_tiny_llama3(tmp_path / "tiny-llama31.gguf", chat_template=LLAMA31_TOOLS_TEMPLATE)
    env = {"CHATCTX_HOME": str(tmp_path / "home"), "CHATCTX_EMBEDDER": str(embedder_path)}
    folder = tmp_path / "serve"
    folder.mkdir()
    options: Any = {
        "model": "chatctx",
        "tools": TOOLS,
        "max_tokens": 60,
        "seed": 2,
        "extra_body": {"conversation": "agent-restart"},
    }
    first_server = ServerProcess(folder, model, "--n-ctx", "1024", "--slots", "2", env=env)
    try:
        first = _client(first_server).chat.completions.create(
            messages=[{"role": "user", "content": "Where is E-5?"}],
            tool_choice="required",
            **options,
        )
    finally:
        assert first_server.stop() == 0
    calls = first.choices[0].message.tool_calls
    assert calls
    second_server = ServerProcess(folder, model, "--n-ctx", "1024", "--slots", "2", env=env)
    try:
        results: Any = [{"role": "tool", "tool_call_id": c.id, "content": "lost"} for c in calls]
        second = _client(second_server).chat.completions.create(
            messages=results, tool_choice="none", **options
        )
        assert second.choices[0].message.tool_calls is None
        with second_server.store() as store:
            history = store.messages("agent-restart")
        assert [m.role for m in history] == [
            "user",
            "assistant",
            *["tool"] * len(calls),
            "assistant",
        ]
        assert [c["id"] for c in history[1].tool_calls or []] == [c.id for c in calls]
    finally:
        second_server.stop()
