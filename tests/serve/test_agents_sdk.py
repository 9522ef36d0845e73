"""The OpenAI Agents SDK's default model (the Responses API) against ``chatctx serve``.

An agent with a function tool runs three turns: the SDK's own way (the whole history as
items each time) and chained by ``previous_response_id``. The tool is forced on each turn
(a grammar holds a random model to a valid call) and the run stops at its result, so the
test does not depend on what a random model would say. The oracle is the store: the
questions, the calls the SDK executed (by their ids) and the results it sent back.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.items import ToolCallItem
from openai import AsyncOpenAI

from tests.serve.conftest import ServerProcess

set_tracing_disabled(True)  # traces would go to OpenAI's servers


def _calls(result: Any) -> list[str]:
    return [item.raw_item.call_id for item in result.new_items if isinstance(item, ToolCallItem)]


def test_an_agent_with_a_function_tool_keeps_its_history_in_the_store(
    tiny_server: ServerProcess,
) -> None:
    looked_up: list[str] = []

    @function_tool
    def lookup_order(order: Literal["77", "78"]) -> str:
        """Look an order up by its number."""
        looked_up.append(order)
        return json.dumps({"order": order, "status": "shipped"})

    async def run() -> list[Any]:
        client = AsyncOpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)
        agent = Agent(
            name="support",
            instructions="You are a parcel support agent.",
            model=OpenAIResponsesModel(model="chatctx", openai_client=client),
            tools=[lookup_order],
            model_settings=ModelSettings(
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=120,
                temperature=0,
                truncation="auto",
            ),
            tool_use_behavior="stop_on_first_tool",
        )
        first = await Runner.run(agent, "Where is order 77?")
        # The SDK's default: the whole history as items, every turn.
        second = await Runner.run(
            agent, [*first.to_input_list(), {"role": "user", "content": "And order 78?"}]
        )
        # Chained on the server: only the new message goes.
        third = await Runner.run(
            agent, "Thanks, anything else?", previous_response_id=second.last_response_id
        )
        await client.close()
        return [first, second, third]

    first, second, third = asyncio.run(run())
    assert len(looked_up) == 3  # each turn ran the tool once
    for result, order in zip((first, second, third), looked_up, strict=True):
        assert json.loads(result.final_output) == {"order": order, "status": "shipped"}
    with tiny_server.store() as store:
        stored = store.get_response(third.last_response_id)
        assert stored is not None
        conversation = store.get_conversation(stored.conversation_id)
        messages = store.messages(stored.conversation_id)
    assert conversation.system_prompt == "You are a parcel support agent."
    users = [m.content for m in messages if m.role == "user"]
    assert users == ["Where is order 77?", "And order 78?", "Thanks, anything else?"]
    made = [c["id"] for m in messages if m.role == "assistant" for c in m.tool_calls or []]
    assert made == _calls(first) + _calls(second) + _calls(third)
    # The results the SDK sent back: the first turn's, with the second turn's history.
    results = [(m.tool_call_id, json.loads(m.content)) for m in messages if m.role == "tool"]
    assert results == [(_calls(first)[0], {"order": looked_up[0], "status": "shipped"})]
