"""The HTTP API of one tiny-model server: shapes, errors, stop strings, stateless requests,
the conversations endpoints, metrics and the access log; the database is the oracle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from chatctx.model.embedder import EMBEDDER_FILE
from chatctx.settings import ContextSettings, ConversationSettings, GenerationSettings
from chatctx.store import parse_line
from tests.serve.conftest import ServerProcess


def chat(server: ServerProcess, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120, **kwargs)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assert_error(
    response: httpx.Response, status: int, code: str | None, param: str | None
) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    assert body["error"]["param"] == param
    assert "Traceback" not in response.text


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"messages": [user("hi")], "temprature": 1}, "unknown_parameter", "temprature"),
        (
            {"messages": [user("hi")], "tools": [{"type": "function"}]},
            "invalid_value",
            "tools[0].function",
        ),
        (
            {"messages": [user("hi")], "tools": [], "tool_choice": "required"},
            "invalid_value",
            "tool_choice",
        ),
        (
            {"messages": [user("hi"), {"role": "tool", "content": "42"}]},
            "invalid_value",
            "messages[1].tool_call_id",
        ),
        (
            {
                "messages": [
                    user("hi"),
                    {"role": "assistant", "content": "no calls"},
                    {"role": "tool", "tool_call_id": "call_1", "content": "42"},
                ]
            },
            "invalid_value",
            "messages[2].role",
        ),
        ({"messages": [user("hi")], "n": 2}, "unsupported_parameter", "n"),
        ({"messages": [user("hi")], "logprobs": True}, "unsupported_parameter", "logprobs"),
        ({"messages": []}, "too_short", "messages"),
        ({}, "missing", "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "literal_error", "messages[0].role"),
        ({"messages": [user("hi")], "temperature": 3}, "less_than_equal", "temperature"),
        ({"messages": [user("hi")], "seed": -1}, "greater_than_equal", "seed"),
        (
            {"messages": [user("hi")], "conversation": "a b"},
            "string_pattern_mismatch",
            "conversation",
        ),
        ({"messages": [user("hi")], "stop": ["a", "b", "c", "d", "e"]}, "invalid_stop", "stop"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "unsupported_content",
            "messages[0].content",
        ),
        (
            {"messages": [user("hi"), {"role": "assistant", "content": "x"}]},
            "invalid_value",
            "messages",
        ),
        (
            {"messages": [user("hi"), {"role": "system", "content": "late"}, user("again")]},
            "invalid_value",
            "messages[1].role",
        ),
        ({"messages": [user("   ")]}, None, "messages[0].content"),
        ({"messages": [user("x" * 32_001)]}, "string_above_max_length", "messages[0].content"),
        ({"messages": [user("hi")], "max_tokens": 600}, "invalid_value", None),
        (
            {"messages": [user("hi")], "max_tokens": 600, "conversation": "no-room"},
            "invalid_value",
            None,
        ),
        (
            {
                "messages": [user("hi")],
                "max_tokens": 600,
                "conversation": "no-room",
                "stream": True,
            },
            "invalid_value",
            None,
        ),
        (
            {"messages": [user("word " * 3000)], "conversation": "too-long"},
            "context_length_exceeded",
            "messages",
        ),
        (
            {
                "messages": [
                    user("earlier"),
                    {"role": "assistant", "content": "ok"},
                    user("word " * 3000),
                ],
                "conversation": "too-long-after",
            },
            "context_length_exceeded",
            "messages",
        ),
    ],
)
def test_bad_requests_get_openai_errors(
    tiny_server: ServerProcess, body: dict[str, Any], code: str | None, param: str | None
) -> None:
    response = chat(tiny_server, body)
    assert_error(response, 400, code, param)
    if body.get("conversation") in ("too-long", "too-long-after", "no-room"):
        with tiny_server.store() as store:  # nothing was stored for the refused turn
            assert store.messages(body["conversation"]) == []


def test_transport_errors(tiny_server: ServerProcess) -> None:
    bad_json = httpx.post(f"{tiny_server.url}/v1/chat/completions", content=b"{nope", timeout=30)
    assert_error(bad_json, 400, "invalid_json", None)
    not_object = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=[1, 2], timeout=30)
    assert not_object.status_code == 400
    huge = httpx.post(
        f"{tiny_server.url}/v1/chat/completions", content=b"x" * (1_048_576 + 1), timeout=30
    )
    assert_error(huge, 413, "request_too_large", None)
    assert_error(httpx.get(f"{tiny_server.url}/v2/nothing"), 404, "unknown_url", None)
    assert_error(httpx.put(f"{tiny_server.url}/v1/models"), 405, "method_not_allowed", None)
    assert_error(httpx.get(f"{tiny_server.url}/v1/models/gpt-4"), 404, "model_not_found", None)


def test_models_health_ready(tiny_server: ServerProcess) -> None:
    models = httpx.get(f"{tiny_server.url}/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["tiny-llama3.gguf"]
    assert httpx.get(f"{tiny_server.url}/v1/models/tiny-llama3.gguf").json()["object"] == "model"
    assert httpx.get(f"{tiny_server.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{tiny_server.url}/ready").json()
    assert ready["ready"] is True and ready["db_revision"] == ready["db_head"] is not None


def test_ready_only_once_the_first_turns_work_is_done(
    tiny_llama3_path: Path, start_server: Any, tmp_path: Path
) -> None:
    # Recall by meaning is on by default: the sentence embedder is converted into the home
    # (seconds) before /ready says 200, not in the first customer's turn.
    home = tmp_path / "fresh-home"
    server = start_server(tiny_llama3_path, env={"CHATCTX_HOME": str(home), "CHATCTX_EMBEDDER": ""})
    assert (home / "models" / EMBEDDER_FILE).is_file()
    reply = chat(server, {"messages": [user("hello")], "conversation": "c1", "max_tokens": 4})
    assert reply.status_code == 200, reply.text


def test_stop_strings_end_the_reply_and_the_stored_message(tiny_server: ServerProcess) -> None:
    stops = ["e", "a", "o"]
    plain = chat(
        tiny_server,
        {"messages": [user("Say something")], "conversation": "stops", "max_tokens": 60},
    ).json()
    response = chat(
        tiny_server,
        {
            "messages": [user("Say more")],
            "conversation": "stops",
            "max_tokens": 60,
            "stop": stops,
            "seed": 3,
        },
    ).json()
    text = response["choices"][0]["message"]["content"]
    assert response["choices"][0]["finish_reason"] == "stop"
    assert response["chatctx"]["stop_reason"] == "stop"
    assert response["chatctx"]["partial"] is False  # as the stored message: complete
    assert not any(s in text for s in stops)
    with httpx.stream(
        "POST",
        f"{tiny_server.url}/v1/chat/completions",
        json={
            "messages": [user("And again")],
            "conversation": "stops",
            "max_tokens": 60,
            "stop": "e",
            "stream": True,
        },
        timeout=120,
    ) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "e" not in streamed
    with tiny_server.store() as store:
        history = store.messages("stops")
    replies = [m for m in history if m.role == "assistant"]
    assert [m.content for m in replies] == [
        plain["choices"][0]["message"]["content"],
        text,
        streamed,
    ]
    assert all(m.status == "complete" for m in replies)


def test_a_request_stores_its_settings_over_the_conversations(tiny_server: ServerProcess) -> None:
    # A conversation the server never saw (another process made it): the request's system
    # prompt and sampling replace the stored ones, its context settings stay.
    old = ConversationSettings(
        generation=GenerationSettings(temperature=0.3), context=ContextSettings(budget=300)
    )
    with tiny_server.store() as store:
        store.create_conversation("made-elsewhere", system_prompt="old", settings=old.to_json())
    system = {"role": "system", "content": "new"}
    body = {"messages": [system, user("hi")], "temperature": 0.9, "max_tokens": 4}
    assert chat(tiny_server, {**body, "conversation": "made-elsewhere"}).status_code == 200
    # A new conversation with earlier messages: created with the request's settings.
    earlier = [user("a"), {"role": "assistant", "content": "b"}, user("c")]
    first = {"messages": [system, *earlier], "seed": 5, "max_tokens": 4, "conversation": "new-one"}
    assert chat(tiny_server, first).status_code == 200
    # Its next turn: no system message keeps the prompt; the sampling is the request's.
    again = {"messages": [user("d")], "seed": 6, "max_tokens": 3, "conversation": "new-one"}
    assert chat(tiny_server, again).status_code == 200
    with tiny_server.store() as store:
        elsewhere = store.get_conversation("made-elsewhere")
        new_one = store.get_conversation("new-one")
        contents = [m.content for m in store.messages("new-one")]
    settings = ConversationSettings.parse(elsewhere.settings)
    assert elsewhere.system_prompt == "new"
    assert settings.generation == GenerationSettings(temperature=0.9, max_tokens=4)
    assert settings.context == ContextSettings(budget=300)
    settings = ConversationSettings.parse(new_one.settings)
    assert new_one.system_prompt == "new"
    assert settings == ConversationSettings(generation=GenerationSettings(seed=6, max_tokens=3))
    assert contents[:3] == ["a", "b", "c"] and contents[4] == "d" and len(contents) == 6


def test_stateless_requests_are_trimmed_and_not_kept(tiny_server: ServerProcess) -> None:
    with tiny_server.store() as store:
        before = {c.id for c in store.list_conversations()}
    history = [
        {"role": "system", "content": "You are terse."},
        user("first question"),
        {"role": "assistant", "content": "first answer"},
        user("second question"),
    ]
    first = chat(tiny_server, {"messages": history, "max_tokens": 8}).json()
    assert first["chatctx"]["conversation"] is None
    reply = first["choices"][0]["message"]["content"]
    # The client resends the whole history: the chat's slot still holds its prefix.
    longer = [*history, {"role": "assistant", "content": reply}, user("third question")]
    second = chat(tiny_server, {"messages": longer, "max_tokens": 8}).json()
    assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # A history longer than the budget is trimmed to it (oldest turns dropped), not refused.
    long_history = [
        m
        for i in range(30)
        for m in (user(f"q{i} " * 8), {"role": "assistant", "content": f"a{i} " * 8})
    ]
    trimmed = chat(tiny_server, {"messages": [*long_history, user("last")], "max_tokens": 8})
    assert trimmed.status_code == 200, trimmed.text
    assert trimmed.json()["usage"]["prompt_tokens"] <= 512
    with tiny_server.store() as store:
        assert {c.id for c in store.list_conversations()} == before
    listed = httpx.get(f"{tiny_server.url}/v1/conversations", params={"limit": 100}).json()
    assert {c["id"] for c in listed["data"]} == before and not listed["has_more"]


def test_conversations_endpoints(tiny_server: ServerProcess) -> None:
    # A client may name a conversation anything, "stateless-" too: it is listed like any other
    # (stateless requests are kept in memory, never in the store).
    for name in ("page-a", "page-b", "page-c", "stateless-notes"):
        response = chat(
            tiny_server,
            {
                "messages": [{"role": "system", "content": f"sys {name}"}, user(f"hello {name}")],
                "conversation": name,
                "max_tokens": 4,
            },
        )
        assert response.status_code == 200, response.text
    first = httpx.get(f"{tiny_server.url}/v1/conversations", params={"limit": 2}).json()
    ids = [c["id"] for c in first["data"]]
    assert ids == sorted(ids) and len(ids) == 2 and first["has_more"] is True
    rest: list[str] = []
    after = first["last_id"]
    while True:
        page = httpx.get(
            f"{tiny_server.url}/v1/conversations", params={"limit": 2, "after": after}
        ).json()
        rest += [c["id"] for c in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    with tiny_server.store() as store:
        every = sorted(c.id for c in store.list_conversations())
        stored_messages = store.messages("page-b")
        turns = store.turns("page-b")
    assert ids + rest == every

    got = httpx.get(f"{tiny_server.url}/v1/conversations/page-b").json()
    assert got["system_prompt"] == "sys page-b"
    assert [(m["role"], m["content"]) for m in got["messages"]] == [
        (m.role, m.content) for m in stored_messages
    ]
    exported = httpx.get(f"{tiny_server.url}/v1/conversations/page-b/export")
    assert exported.headers["content-type"].startswith("application/x-ndjson")
    record = parse_line(exported.text, line=1)
    assert record.id == "page-b" and record.system_prompt == "sys page-b"
    assert [m["content"] for m in record.messages] == [m.content for m in stored_messages]
    inspected = httpx.get(f"{tiny_server.url}/v1/conversations/page-b/inspect").json()
    assert inspected["current_plan"]["prompt_tokens"] == turns[-1].prompt_tokens
    stats = httpx.get(f"{tiny_server.url}/v1/conversations/page-b/stats").json()
    assert [t["prompt_tokens"] for t in stats["turns"]] == [t.prompt_tokens for t in turns]
    assert stats["totals"]["turns"] == len(turns)

    deleted = httpx.delete(f"{tiny_server.url}/v1/conversations/page-b")
    assert deleted.json()["deleted"] is True
    assert httpx.get(f"{tiny_server.url}/v1/conversations/page-b").status_code == 404
    assert httpx.delete(f"{tiny_server.url}/v1/conversations/page-b").status_code == 404
    with tiny_server.store() as store:
        assert not store.has_conversation("page-b")


def test_metrics_and_access_log(tiny_server: ServerProcess) -> None:
    marker = "MARKER-6d1f2 my card number is 4111"
    response = chat(
        tiny_server, {"messages": [user(marker)], "conversation": "logged", "max_tokens": 4}
    )
    assert response.status_code == 200
    text = httpx.get(f"{tiny_server.url}/metrics").text
    assert (
        'chatctx_http_requests_total{method="POST",route="/v1/chat/completions",status="200"}'
        in text
    )
    assert (
        'chatctx_http_request_duration_seconds_bucket{method="POST",route="/v1/chat/completions",le="+Inf"}'
        in text
    )
    assert "chatctx_pool_slots 4" in text
    assert 'chatctx_turns_total{conversation="logged"} 1' in text  # no keys: per conversation
    assert "chatctx_serve_ttft_seconds_count" in text
    assert marker not in tiny_server.log()
    entries = [e for e in tiny_server.access_log() if e.get("conversation") == "logged"]
    assert entries and entries[-1]["status"] == 200
    entry = entries[-1]
    with tiny_server.store() as store:
        turn = store.turns("logged")[-1]
    assert entry["prompt_tokens"] == turn.prompt_tokens
    assert entry["route"] == "/v1/chat/completions" and entry["tenant"] == "-"


def test_a_stateless_history_of_any_length_is_fitted_to_the_budget(
    tiny_server: ServerProcess,
) -> None:
    # 200 messages (Open WebUI and LangChain send the whole history every turn): no count
    # limit, the body's size bounds a request; what does not fit is dropped whole turns
    # first, and the response says how much was sent.
    history: list[dict[str, str]] = []
    for n in range(100):
        history += [
            user(f"Question {n}: is order {n} shipped?"),
            {"role": "assistant", "content": f"Order {n} shipped."},
        ]
    body = {"messages": [*history[:-1], user("And the last one?")], "max_tokens": 8}
    response = chat(tiny_server, body)
    assert response.status_code == 200, response.text
    reply = response.json()
    extension = reply["chatctx"]
    assert extension["evicted_messages"] > 0 and extension["kept_messages"] > 0
    assert extension["evicted_messages"] + extension["kept_messages"] == len(history) - 1
    # Fitted: the prompt the model saw is within the 512-token slot.
    assert reply["usage"]["prompt_tokens"] < 512
    # A body over the size limit is the clear refusal instead.
    huge = {"messages": [user("x" * 30_000)] * 40}
    too_big = chat(tiny_server, huge)
    assert too_big.status_code == 413, too_big.text
