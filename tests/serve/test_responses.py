"""``/v1/responses`` and the Conversations API through the official ``openai`` client.

The oracles: the database (what is stored, turn by turn, and where), the turn records
(``usage`` against the tokens the turn sent), and a stateless chat completion sent the same
history whole (what a branch's prompt must equal).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from chatctx.store import Store
from tests.serve.conftest import ServerProcess

QUESTIONS = [
    "Hello, my order has not arrived.",
    "It was supposed to come on Monday.",
    "The parcel number is in my mail.",
    "Can you check the depot?",
    "What does the tracking page say?",
    "How long will it take now?",
    "Can I get a refund instead?",
    "Please send it to my card.",
    "What was the delivery day again?",
    "Goodbye!",
]
SAMPLING: dict[str, Any] = {"max_output_tokens": 8, "temperature": 0, "truncation": "auto"}


@pytest.fixture(scope="module")
def server(
    tiny_llama3_path: Path, embedder_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("responses-server")
    server = ServerProcess(
        folder,
        tiny_llama3_path,
        "--n-ctx",
        "1024",
        "--slots",
        "2",
        env={"CHATCTX_HOME": str(folder / "home"), "CHATCTX_EMBEDDER": str(embedder_path)},
    )
    yield server
    server.stop()


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _stored(server: ServerProcess, response_id: str) -> Any:
    with server.store() as store:
        found = store.get_response(response_id)
    assert found is not None
    return found


def _pairs(store: Store, conversation: str) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in store.messages(conversation)]


def test_a_chain_of_ten_responses_is_one_conversation_and_a_fork_leaves_it_whole(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    ids: list[str] = []
    replies: list[str] = []
    usages = []
    previous = None
    for question in QUESTIONS:
        response = client.responses.create(
            model="any", input=question, previous_response_id=previous, **SAMPLING
        )
        assert response.status in ("completed", "incomplete")
        assert response.previous_response_id == previous
        ids.append(response.id)
        replies.append(response.output_text)
        usages.append(response.usage)
        previous = response.id
    first = _stored(server, ids[0])
    with server.store() as store:
        # One conversation: what was sent and answered, in order, nothing sent twice.
        expected = [
            pair
            for q, r in zip(QUESTIONS, replies, strict=True)
            for pair in (("user", q), ("assistant", r))
        ]
        assert _pairs(store, first.conversation_id) == expected
        turns = store.turns(first.conversation_id)
    assert all(_stored(server, i).conversation_id == first.conversation_id for i in ids)
    for usage, turn in zip(usages, turns, strict=True):
        assert usage is not None
        assert usage.input_tokens == turn.prompt_tokens
        assert usage.output_tokens == turn.generated_tokens
        assert usage.input_tokens_details.cached_tokens == turn.reused_tokens
    assert all(t.reused_tokens > 0 for t in turns[1:])  # the chain's cache stays warm

    # A fork from the fifth response: a branch with turns 1-5 and its own question.
    fork = client.responses.create(
        model="any", input="Actually, cancel the order.", previous_response_id=ids[4], **SAMPLING
    )
    branch = _stored(server, fork.id)
    assert branch.conversation_id != first.conversation_id
    with server.store() as store:
        assert _pairs(store, branch.conversation_id) == [
            *expected[:10],
            ("user", "Actually, cancel the order."),
            ("assistant", fork.output_text),
        ]
        assert _pairs(store, first.conversation_id) == expected  # the first branch is whole
        fork_turn = store.turns(branch.conversation_id)[-1]
    # Its prompt is the branch's history alone: what a stateless request sending that
    # history whole is sent (another path to the same prompt).
    history = [{"role": r, "content": c} for r, c in expected[:10]]
    solo = client.chat.completions.create(
        model="any",
        messages=[*history, {"role": "user", "content": "Actually, cancel the order."}],  # type: ignore[list-item]
        max_tokens=8,
        temperature=0,
    )
    assert solo.usage is not None
    assert fork_turn.prompt_tokens == solo.usage.prompt_tokens
    assert usages[-1] is not None and fork_turn.prompt_tokens < usages[-1].input_tokens
    # The branch started from a copy of the first branch's cache: the prefix they share
    # (turns 1-5) was not evaluated again.
    assert fork_turn.reused_tokens >= turns[4].prompt_tokens

    # The first branch goes on from its last response, in place.
    more = client.responses.create(
        model="any", input="One more thing.", previous_response_id=ids[-1], **SAMPLING
    )
    assert _stored(server, more.id).conversation_id == first.conversation_id


def test_a_streamed_response_is_the_response_stored(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    first = client.responses.create(model="any", input=QUESTIONS[0], **SAMPLING)
    kinds: list[str] = []
    deltas: list[str] = []
    with client.responses.stream(
        model="any", input=QUESTIONS[1], previous_response_id=first.id, **SAMPLING
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    # The last event says how it ended: a reply cut at max_output_tokens is incomplete.
    assert kinds[-1] == f"response.{final.status}"
    assert (final.status == "incomplete") == (final.usage.output_tokens == 8)  # type: ignore[union-attr]
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.done")
    assert final.output_text == "".join(deltas)
    got = client.responses.retrieve(final.id)
    assert got.output_text == final.output_text
    assert [item.id for item in got.output] == [item.id for item in final.output]
    with server.store() as store:
        stored = store.get_response(final.id)
        assert stored is not None
        last = store.messages(stored.conversation_id)[-1]
    assert (last.role, last.content) == ("assistant", final.output_text)
    assert stored.body["usage"]["input_tokens"] == final.usage.input_tokens  # type: ignore[union-attr]


def test_input_items_delete_and_store_false(server: ServerProcess, client: openai.OpenAI) -> None:
    items: Any = [
        {"role": "user", "content": "My name is Dana."},
        {"role": "assistant", "content": "Hello Dana."},
        {"role": "user", "content": [{"type": "input_text", "text": "Where is my parcel?"}]},
    ]
    response = client.responses.create(
        model="any", input=items, instructions="Be brief.", **SAMPLING
    )
    listed = client.responses.input_items.list(response.id, order="asc")
    texts = [(i.role, i.content[0].text) for i in listed.data]  # type: ignore[union-attr]
    assert texts == [
        ("user", "My name is Dana."),
        ("assistant", "Hello Dana."),
        ("user", "Where is my parcel?"),
    ]
    with server.store() as store:
        stored = store.get_response(response.id)
        assert stored is not None
        assert store.get_conversation(stored.conversation_id).system_prompt == "Be brief."
    # The next response without instructions has none: they are not carried over.
    after = client.responses.create(
        model="any", input="Thanks.", previous_response_id=response.id, **SAMPLING
    )
    with server.store() as store:
        assert store.get_conversation(stored.conversation_id).system_prompt is None
    deleted = client.responses.delete(after.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(after.id)

    with server.store() as store:
        before = len(store.list_conversations())
    kept = client.responses.create(
        model="any",
        input="Just a quick one.",
        previous_response_id=response.id,
        store=False,
        **SAMPLING,
    )
    with server.store() as store:
        assert len(store.list_conversations()) == before
        assert _pairs(store, stored.conversation_id)[-1][0] == "assistant"
        assert store.get_response(kept.id) is None
        assert store.turns(stored.conversation_id)[-1].prompt_tokens != kept.usage.input_tokens  # type: ignore[union-attr]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_conversations_api_items_paginated_and_responses_in_it(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    conversation = client.conversations.create(
        items=[
            {"type": "message", "role": "system", "content": "You help with parcels."},
            {"type": "message", "role": "user", "content": "Hi, I am Lee."},
        ],
        metadata={"customer": "lee"},
    )
    assert conversation.id.startswith("conv_") and conversation.metadata == {"customer": "lee"}
    replies = []
    for question in QUESTIONS[:3]:
        response = client.responses.create(
            model="any", input=question, conversation=conversation.id, **SAMPLING
        )
        assert response.conversation is not None and response.conversation.id == conversation.id
        replies.append(response.output_text)
    pages = client.conversations.items.list(conversation.id, limit=2, order="asc")
    seen = [item for item in pages]  # the client pages on with after=last_id
    texts = [(i.role, i.content[0].text) for i in seen]  # type: ignore[union-attr]
    expected = [("user", "Hi, I am Lee.")] + [
        pair
        for q, r in zip(QUESTIONS[:3], replies, strict=True)
        for pair in (("user", q), ("assistant", r))
    ]
    assert texts == expected
    newest = client.conversations.items.list(conversation.id, limit=1)
    assert newest.data[0].id == seen[-1].id and newest.has_more
    one = client.conversations.items.retrieve(seen[1].id, conversation_id=conversation.id)
    assert one.id == seen[1].id
    client.conversations.items.create(
        conversation.id, items=[{"type": "message", "role": "user", "content": "Added by hand."}]
    )
    updated = client.conversations.update(
        conversation.id, metadata={"customer": "lee", "tier": "gold"}
    )
    assert updated.metadata == {"customer": "lee", "tier": "gold"}
    got = client.conversations.retrieve(conversation.id)
    assert got.metadata == {"customer": "lee", "tier": "gold"}
    with server.store() as store:
        assert store.get_conversation(conversation.id).system_prompt == "You help with parcels."
        assert _pairs(store, conversation.id)[-1] == ("user", "Added by hand.")
    client.conversations.delete(conversation.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)


def test_function_calls_and_their_outputs(server: ServerProcess, client: openai.OpenAI) -> None:
    tools: Any = [
        {
            "type": "function",
            "name": "lookup_order",
            "description": "Look an order up.",
            "parameters": {
                "type": "object",
                "properties": {"order": {"type": "string", "enum": ["77", "78"]}},
                "required": ["order"],
            },
        }
    ]
    called = client.responses.create(
        model="any",
        input="Where is order 77?",
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,  # one call: a random model would go on calling
        max_output_tokens=60,
        temperature=0,
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "lookup_order"
    json.loads(calls[0].arguments)  # a grammar held the call: valid JSON
    answered = client.responses.create(
        model="any",
        previous_response_id=called.id,
        input=[
            {
                "type": "function_call_output",
                "call_id": c.call_id,
                "output": '{"status": "shipped"}',
            }
            for c in calls
        ],
        tools=tools,
        max_output_tokens=8,
        temperature=0,
    )
    assert answered.status in ("completed", "incomplete")
    with server.store() as store:
        stored = store.get_response(answered.id)
        assert stored is not None
        messages = store.messages(stored.conversation_id)
    assert messages[1].tool_calls and messages[1].tool_calls[0]["id"] == calls[0].call_id
    assert [(m.role, m.tool_call_id) for m in messages[2 : 2 + len(calls)]] == [
        ("tool", c.call_id) for c in calls
    ]
    listed = client.responses.input_items.list(answered.id, order="asc")
    assert [i.type for i in listed.data] == ["function_call_output"] * len(calls)
    # Results for calls no one made: 400, nothing stored.
    with pytest.raises(openai.BadRequestError):
        client.responses.create(
            model="any",
            previous_response_id=answered.id,
            input=[{"type": "function_call_output", "call_id": "call_nope", "output": "x"}],
        )


def test_truncation_disabled_refuses_what_auto_fits_and_input_tokens_match(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    long_history: Any = []
    for n in range(40):
        long_history += [
            {"role": "user", "content": f"Message {n}: the parcel went to the depot again."},
            {"role": "assistant", "content": f"Reply {n}: noted, I will check the depot."},
        ]
    long_history.append({"role": "user", "content": "So where is it now?"})
    with server.store() as store:
        before = len(store.list_conversations())
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="any", input=long_history, max_output_tokens=8)
    assert refused.value.code == "context_length_exceeded"
    with server.store() as store:
        assert len(store.list_conversations()) == before  # nothing stored
    # The reply's reserve decides how much history fits: chatctx takes max_output_tokens here.
    reserve = {"max_output_tokens": 8}
    counted = client.responses.input_tokens.count(
        model="any", input=long_history, truncation="auto", extra_body=reserve
    )
    fitted = client.responses.create(model="any", input=long_history, **SAMPLING)
    assert fitted.usage is not None and counted.input_tokens == fitted.usage.input_tokens
    assert fitted.usage.input_tokens < 1024
    # A continuation of the chain: counted as the turn sends it.
    counted = client.responses.input_tokens.count(
        model="any",
        input="And when?",
        previous_response_id=fitted.id,
        truncation="auto",
        extra_body=reserve,
    )
    more = client.responses.create(
        model="any", input="And when?", previous_response_id=fitted.id, **SAMPLING
    )
    assert more.usage is not None and counted.input_tokens == more.usage.input_tokens


def test_bad_requests_name_their_field(server: ServerProcess) -> None:
    url = f"{server.url}/v1/responses"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input": "hi", "previous_response_id": "resp_x", "conversation": "c"}, "conversation"),
        ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text"),
        ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input[0].role"),
    ]
    for body, param in cases:
        answer = httpx.post(url, json=body, timeout=30)
        assert answer.status_code == 400, (body, answer.text)
        assert answer.json()["error"]["param"] == param, (body, answer.text)
    missing = httpx.post(url, json={"input": "hi", "previous_response_id": "resp_" + "0" * 32})
    assert missing.status_code == 404
    assert httpx.get(f"{server.url}/v1/responses/resp_{'0' * 32}").status_code == 404


def test_a_response_from_before_a_restart_is_continued(
    tiny_llama3_path: Path, embedder_path: Path, tmp_path: Path
) -> None:
    env = {"CHATCTX_HOME": str(tmp_path / "home"), "CHATCTX_EMBEDDER": str(embedder_path)}
    args = ("--n-ctx", "512", "--slots", "1")
    before = ServerProcess(tmp_path, tiny_llama3_path, *args, env=env)
    try:
        client = openai.OpenAI(base_url=f"{before.url}/v1", api_key="unused", max_retries=0)
        first = client.responses.create(model="any", input=QUESTIONS[0], **SAMPLING)
    finally:
        assert before.stop() == 0
    after = ServerProcess(tmp_path, tiny_llama3_path, *args, env=env)  # the same database
    try:
        client = openai.OpenAI(base_url=f"{after.url}/v1", api_key="unused", max_retries=0)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        more = client.responses.create(
            model="any", input=QUESTIONS[1], previous_response_id=first.id, **SAMPLING
        )
        with after.store() as store:
            stored = store.get_response(more.id)
            assert stored is not None
            assert _pairs(store, stored.conversation_id) == [
                ("user", QUESTIONS[0]),
                ("assistant", first.output_text),
                ("user", QUESTIONS[1]),
                ("assistant", more.output_text),
            ]
    finally:
        after.stop()
