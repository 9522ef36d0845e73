"""Agent turns in the library: a reply that calls tools, the results sent back, the turn
going on; on the tiny random-weight Llama 3 with a Llama 3.1-style template (its calls held
valid by a grammar) and with a template that has no tool support (the generic format).

Oracles: the tools offered and their schemas (a random model writes noise unless the
grammar holds it), the database rows, and the codec's own rendering of the stored messages.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from chatctx import ChatSession, ConfigError, Engine
from chatctx.model.tools import GENERIC_INSTRUCTIONS
from chatctx.testing import LLAMA31_TOOLS_TEMPLATE, write_tiny_llama3
from tests.tool_schemas import LOOKUP, TICKET

TOOLS = [LOOKUP, TICKET]
SAMPLING = {"max_tokens": 48, "seed": 5}


@pytest.fixture(scope="module")
def llama31_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path = write_tiny_llama3(
        tmp_path_factory.mktemp("models") / "tiny-llama31.gguf",
        chat_template=LLAMA31_TOOLS_TEMPLATE,
    )
    with Engine.load(path, n_ctx=2048, n_seq_max=2) as engine:
        yield engine


def _valid(call: Any) -> None:
    """A call the offered schemas allow (the oracle: the schemas, not the parser)."""
    arguments = json.loads(call.arguments)
    if call.name == "lookup_order":
        assert set(arguments) == {"order_id"} and len(arguments["order_id"]) <= 8
    else:
        assert call.name == "open_ticket" and arguments["priority"] in (1, 2, 3)


def test_a_required_call_then_its_result_continues_the_turn(
    db_url: str, llama31_engine: Engine
) -> None:
    with ChatSession.open(db_url, model=llama31_engine, settings=SAMPLING) as chat:
        codec = llama31_engine.codec()
        reply = chat.send("Where is my order?", tools=TOOLS, tool_choice="required")
        assert reply.tool_calls and reply.warning is None
        for call in reply.tool_calls:
            _valid(call)
        assert reply.turn is not None and reply.turn.tool_calls == len(reply.tool_calls)
        waiting = chat.waiting_tool_calls()
        assert [c["id"] for c in waiting] == [c.id for c in reply.tool_calls]

        results = {c.id: {"status": "shipped", "eta": "2 days"} for c in reply.tool_calls}
        final = chat.submit_tool_results(results)
        assert chat.waiting_tool_calls() == [] or final.tool_calls
        history = chat.history()
        roles = [m.role for m in history]
        assert roles[:2] == ["user", "assistant"] and roles[2 : 2 + len(results)] == ["tool"] * len(
            results
        )
        assert history[1].tool_calls == [c.to_openai() for c in reply.tool_calls]
        assert {m.tool_call_id: m.content for m in history if m.role == "tool"} == {
            k: json.dumps(v) for k, v in results.items()
        }
        # The continuation's prompt is the stored turn rendered with the tools (a recompute
        # by the codec, outside the builder), and its figures are the record's.
        sent = [m.to_openai() for m in history[: 2 + len(results)]]
        expected = codec.encode_prompt(codec.render(sent, tools=TOOLS))
        assert chat.last_build is not None and chat.last_build.tokens == expected
        turns = chat.store.turns(chat.conversation_id)
        assert len(turns) == 2 and turns[1].prompt_tokens == len(expected)
        assert turns[1].user_message_id == history[0].id
        assert final.usage.prompt_tokens == turns[1].prompt_tokens
        # The tool results' tokens: the codec's own count of what each result message adds
        # to a prompt (rendered after a system message, less that message alone).
        anchor = [{"role": "system", "content": "."}]
        alone = len(codec.prompt_tokens(anchor, add_generation_prompt=False))
        expected = sum(
            len(codec.prompt_tokens([*anchor, m.to_openai()], add_generation_prompt=False)) - alone
            for m in history
            if m.role == "tool"
        )
        assert expected > 0 and turns[1].tool_result_tokens == expected
        # Its prefix (system with tools, the user message) came from the cache.
        assert turns[1].reused_tokens >= turns[0].prompt_tokens


def test_a_named_function_is_the_one_called_and_a_stream_shows_no_call(
    db_url: str, llama31_engine: Engine
) -> None:
    with ChatSession.open(db_url, model=llama31_engine, settings=SAMPLING) as chat:
        choice = {"type": "function", "function": {"name": "open_ticket"}}
        chunks = list(chat.stream("I want a refund", tools=TOOLS, tool_choice=choice))
        reply = chat.last_reply
        assert reply is not None and reply.tool_calls
        assert all(c.name == "open_ticket" for c in reply.tool_calls)
        for call in reply.tool_calls:
            _valid(call)
        assert "".join(chunks) == reply.text == ""  # the call never reached the reader as text


def test_results_are_checked_against_the_waiting_calls_and_nothing_is_stored(
    db_url: str, llama31_engine: Engine
) -> None:
    with ChatSession.open(db_url, model=llama31_engine, settings=SAMPLING) as chat:
        with pytest.raises(ConfigError, match="no tool calls are waiting"):
            chat.submit_tool_results({"call_x": "42"}, tools=TOOLS)
        with pytest.raises(ConfigError, match=r"tools\[0\]\.type"):
            chat.send("hello", tools=[{"type": "code"}])
        refund = {"type": "function", "function": {"name": "refund"}}
        with pytest.raises(ConfigError, match=r"tool_choice\.function\.name 'refund'"):
            chat.send("hello", tools=TOOLS, tool_choice=refund)
        assert chat.history() == []
        reply = chat.send("Where is A-1?", tools=TOOLS, tool_choice="required")
        stored = len(chat.history())
        with pytest.raises(ConfigError, match="'call_unknown' is not a call waiting"):
            chat.submit_tool_results({"call_unknown": "x", **{c.id: "x" for c in reply.tool_calls}})
        if len(reply.tool_calls) > 1:
            with pytest.raises(ConfigError, match="no result for tool call"):
                chat.submit_tool_results({reply.tool_calls[0].id: "x"})
        with pytest.raises(ConfigError, match="non-empty mapping"):
            chat.submit_tool_results({})
        assert len(chat.history()) == stored
        assert len(chat.store.turns(chat.conversation_id)) == 1


def test_a_session_closed_between_calls_and_results_loses_nothing(
    db_url: str, llama31_engine: Engine
) -> None:
    with ChatSession.open(
        db_url, conversation_id="agent-1", model=llama31_engine, settings=SAMPLING
    ) as chat:
        reply = chat.send("Check order B-7", tools=TOOLS, tool_choice="required")
    assert reply.tool_calls
    with ChatSession.open(db_url, conversation_id="agent-1", model=llama31_engine) as again:
        assert [c["id"] for c in again.waiting_tool_calls()] == [c.id for c in reply.tool_calls]
        final = again.submit_tool_results(
            {c.id: "not found" for c in reply.tool_calls}, tools=TOOLS, tool_choice="none"
        )
        assert final.tool_calls == () and final.message_id is not None
        history = again.history()
        assert history[-1].id == final.message_id and history[-1].role == "assistant"
        assert again.waiting_tool_calls() == []


def test_parallel_calls_in_the_generic_format(db_url: str, llama3_engine: Engine) -> None:
    # The plain Llama 3 template has no tool support: the generic JSON answer, calls in a list.
    assert llama3_engine.codec().tool_format == "generic"
    with ChatSession.open(
        db_url, model=llama3_engine, settings={"max_tokens": 1500, "seed": 1}
    ) as chat:
        reply = chat.send("Two things", tools=TOOLS, tool_choice="required")
        assert reply.tool_calls and reply.warning is None
        ids = [c.id for c in reply.tool_calls]
        assert len(set(ids)) == len(ids)
        for call in reply.tool_calls:
            _valid(call)
        chat.submit_tool_results({i: f"result of {i}" for i in ids})
        assert [m.tool_call_id for m in chat.history() if m.role == "tool"] == ids
        # The prompt tells the model how to call: the generic instructions and the schemas.
        assert chat.last_build is not None
        prompt = llama3_engine.detokenize(chat.last_build.tokens, special=True)
        assert GENERIC_INSTRUCTIONS in prompt and '"name": "open_ticket"' in prompt


def test_auto_in_the_generic_format_answers_in_json_the_parser_reads(
    db_url: str, llama3_engine: Engine
) -> None:
    # A template without tool support: auto holds the reply to the generic JSON answer, so
    # even a random-weight model writes calls or a response the parser reads (the oracle:
    # the format's documentation, as the parser tests read it), unless cut by max_tokens.
    ended = 0
    for seed in range(4):
        with ChatSession.open(
            db_url, model=llama3_engine, settings={"max_tokens": 300, "seed": seed}
        ) as chat:
            reply = chat.send("hello, where is my order?", tools=TOOLS)
            if reply.stop_reason != "eog":
                continue
            ended += 1
            assert reply.warning is None, reply.text
            for call in reply.tool_calls:
                _valid(call)
            stored = chat.history()[-1]
            assert stored.content == reply.text and (stored.tool_calls or None) == (
                [c.to_openai() for c in reply.tool_calls] or None
            )
    assert ended  # the grammar lets a reply end


def test_tool_choice_none_reads_no_calls(db_url: str, llama31_engine: Engine) -> None:
    with ChatSession.open(db_url, model=llama31_engine, settings=SAMPLING) as chat:
        reply = chat.send("hi", tools=TOOLS, tool_choice="none")
        assert reply.tool_calls == () and reply.turn is not None and reply.turn.tool_calls is None
        assert chat.history()[-1].content == reply.text


def test_the_llama31_style_template_is_read_as_the_llama3_format() -> None:
    # The Llama 3.1-style template is read as the llama3 call format, the plain one not.
    from chatctx.model.template import LLAMA3_TEMPLATE
    from chatctx.model.tools import tool_format

    assert tool_format(LLAMA31_TOOLS_TEMPLATE) == "llama3"
    assert tool_format(LLAMA3_TEMPLATE) == "generic"


# -- old tool results cleared before whole turns are evicted ----------------------------------


def _result(n: int) -> str:
    """A bulky tool result whose one fact (its parcel code) no other result has."""
    lines = [f"line {k}: scanned at depot {k * 7 + n}, status in transit" for k in range(10)]
    return json.dumps({"order": f"A-{n}", "parcel_code": f"PX{n}Q{n * 37}Z", "events": lines})


def test_old_tool_results_are_cleared_in_place_and_recalled(
    db_url: str, llama31_engine: Engine
) -> None:
    from tests.llama_counters import counted, prime_counters

    prime_counters(llama31_engine, 0)
    counts = [counted(llama31_engine)]
    context = {
        "budget": 1100,
        "tool_results_keep": 1,
        "recall_search": "words",
        "recall_trigger": "always",
    }
    with ChatSession.open(
        db_url,
        model=llama31_engine,
        settings=SAMPLING,
        context=context,
        seq_id=0,
        on_turn=lambda _turn: counts.append(counted(llama31_engine)),
    ) as chat:
        replies = []
        for n in range(1, 9):
            call = chat.send(f"Where is order A-{n}?", tools=TOOLS, tool_choice="required")
            assert call.tool_calls
            replies.append(call)
            results = {c.id: _result(n) for c in call.tool_calls}
            replies.append(chat.submit_tool_results(results, tool_choice="none"))
            if any(r.plan and r.plan.cleared_ids for r in replies):
                break
        clearing = next(r for r in replies if r.plan and r.plan.cleared_ids)
        assert clearing.plan is not None and not clearing.plan.evicted  # cleared, not evicted
        first_cleared = clearing.plan.cleared_ids[0]
        stored = {m.id: m for m in chat.history()}
        assert stored[first_cleared].role == "tool"  # the store keeps the result whole
        assert "parcel_code" in stored[first_cleared].content
        # llama.cpp's own counter: what the clearing turn evaluated is what it reports, and
        # far less than what follows the cleared result (the rest was moved, not prefilled).
        index = replies.index(clearing)
        evaluated = counts[index + 1] - counts[index] - (clearing.usage.generated_tokens - 1)
        assert clearing.usage.evaluated_tokens == evaluated
        turn = clearing.turn
        assert turn is not None and turn.tool_cleared_tokens and turn.tool_cleared_tokens > 0
        assert evaluated < turn.tool_cleared_tokens
        # A cleared fact asked back is recalled from the store.
        code = json.loads(stored[first_cleared].content)["parcel_code"]
        chat.send(
            f"What was the parcel code {code[:3]} of that first order?",
            tools=TOOLS,
            tool_choice="none",
        )
        assert chat.last_build is not None
        assert first_cleared in chat.last_build.plan.recalled_ids
        prompt = llama31_engine.detokenize(chat.last_build.tokens, special=True)
        assert code in prompt and "cleared to save room" in prompt
        assert stored[first_cleared].content not in prompt  # the line that matched, only
        conversation = chat.conversation_id
        records = chat.store.turns(conversation)
    # The monitor: tool calls per turn, result tokens whole and cleared, as recorded.
    from click.testing import CliRunner

    from chatctx.cli import cli

    shown = CliRunner().invoke(cli, ["inspect", conversation, "--db", db_url, "--json"])
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.output)
    assert report["cleared_ids"] and first_cleared in report["cleared_ids"]
    by_turn = {row["turn"]: row for row in report["tool_turns"]}
    for number, record in enumerate(records, start=1):
        if record.tool_calls is not None or record.tool_cleared_tokens:
            assert by_turn[number]["tool_calls"] == record.tool_calls
            assert by_turn[number]["tool_cleared_tokens"] == record.tool_cleared_tokens
    assert sum(row["tool_calls"] or 0 for row in report["tool_turns"]) == sum(
        len(r.tool_calls) for r in replies
    )
    text = CliRunner().invoke(cli, ["inspect", conversation, "--db", db_url]).output
    assert "tool calls" in text and "cleared to stubs" in text
    stats = CliRunner().invoke(cli, ["stats", conversation, "--db", db_url]).output
    assert f"{sum(len(r.tool_calls) for r in replies)} tool calls" in stats
