"""The abridge layout: evicted messages stay in place, cut down to the sentences that say
the summary's items.

Oracles: cuts written out by hand, llama-server's walk written apart from chatctx's
(``tests.walk``), and the same conversation built by a session that was never reopened.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from click.testing import CliRunner

from chatctx import ChatSession
from chatctx.cli import cli
from chatctx.context import ContextBuilder
from chatctx.context._abridge import Cut, Cutter, abridge
from chatctx.model.codec import TiktokenCodec
from chatctx.replay import DryBackend
from chatctx.store import Message
from tests.walk import cut_of, server_walk

CHUNK = 4


def _message(mid: int, role: str, content: str) -> Message:
    return Message(id=mid, conversation_id="c", position=mid, role=role, content=content)


def _cutter(codec: TiktokenCodec) -> Cutter:
    builder = ContextBuilder(codec, layout="append")
    return Cutter(builder._message_tokens, CHUNK)


def _cut_one(
    codec: TiktokenCodec, summary: str, message: Message, previous: Sequence[Cut] = ()
) -> Cut:
    """The one cut of ``message`` under ``summary`` (each cut costs 1, the limit is 99)."""
    (cut,) = abridge(
        summary, [message], _cutter(codec), previous=previous, cost=lambda m, t: 1, limit=99
    )
    return cut


def test_a_message_keeps_its_start_and_the_sentences_the_summary_keeps(
    llama3_codec: TiktokenCodec,
) -> None:
    first = _message(
        1,
        "user",
        "I'm allergic to shellfish, so no prawns for me. The weather is grim today, rain "
        "all week. Anyway, my order NH-48213 never came. Thanks a lot for looking!",
    )
    second = _message(2, "assistant", "Sorry to hear that! Let me check on it for you.")
    summary = "Facts: NH-48213\nUser: I'm allergic to shellfish"
    cuts = abridge(
        summary, [first, second], _cutter(llama3_codec), cost=lambda m, t: 1, limit=10_000
    )
    # By hand: the sentence with the item, the one naming the order; the reply says
    # nothing the summary keeps and goes.
    assert [c.message_id for c in cuts] == [1]
    assert cuts[0].text(first.content) == (
        "I'm allergic to shellfish, so no prawns for me. Anyway, my order NH-48213 never came."
    )
    assert cuts[0].value == 2
    # An item said later in a message than its start keeps the start: a cut that began at
    # the item would leave a header the walk cannot find once the run before it took the
    # header's first tokens.
    late = _message(3, "user", "Good morning! By the way, my cat is called Felix.")
    cut = _cut_one(llama3_codec, "User: my cat is called Felix", late)
    assert cut.text(late.content) == late.content


def test_a_cut_keeps_what_the_walk_can_find(llama3_codec: TiktokenCodec) -> None:
    message = _message(
        1,
        "user",
        "My dog is called Rex. We walked by the river for an hour and it was lovely. "
        "Work has been busy with meetings about the plan. My sister Anna lives in Lyon.",
    )
    summary = "User: My dog is called Rex; My sister Anna lives in Lyon"
    cut = _cut_one(llama3_codec, summary, message)
    assert cut.text(message.content) == "My dog is called Rex. My sister Anna lives in Lyon."
    # A cache that held the whole message (after a system prompt) keeps every token of the
    # cut message: the walk written apart from chatctx's finds all of it.
    system = {"role": "system", "content": "You are the support assistant."}
    after = {"role": "user", "content": "And what about the weekend?"}
    cached = llama3_codec.prompt_tokens([system, message.to_openai(), after])
    cut_message = {"role": "user", "content": cut.text(message.content)}
    prompt = llama3_codec.prompt_tokens([system, cut_message, after])
    new = len(llama3_codec.prompt_tokens([after], add_generation_prompt=True)) - len(
        llama3_codec.prompt_tokens([], add_generation_prompt=True)
    )
    assert server_walk(cached, prompt, CHUNK) >= len(prompt) - new - 1
    # Once cut, it only loses text: with its second item gone from the summary, the second
    # sentence goes and the start stays.
    again = _cut_one(llama3_codec, "User: My dog is called Rex", message, previous=[cut])
    assert again.text(message.content) == "My dog is called Rex."
    assert Cut.from_row(again.to_row()) == again


def test_a_late_item_keeps_only_the_first_words_of_its_message(
    llama3_codec: TiktokenCodec,
) -> None:
    message = _message(
        3,
        "user",
        "Oh no, that is a sad face, what are you packing for? Are you going home for the "
        "holidays this year or staying put?\ngoing to Nashville next month with my cousins",
    )
    cut = _cut_one(llama3_codec, "User: going to Nashville next month with my cousins", message)
    text = cut.text(message.content)
    # By hand: a few of the message's first words (what the walk finds its header with),
    # then the sentence, not the two questions in between.
    assert text.endswith("\ngoing to Nashville next month with my cousins")
    assert "packing" not in text and "holidays" not in text
    assert cut_of(text, message.content) and len(text) < len(message.content) // 2
    # Whatever came before the message in the cache and comes before it in the prompt, the
    # walk written apart from chatctx keeps every token of the cut message.
    system = {"role": "system", "content": "You are the support assistant."}
    before = {"role": "user", "content": "Hi! I need a hand with a parcel."}
    reply = {"role": "assistant", "content": "Of course, happy to help."}
    after = {"role": "user", "content": "So what do you think?"}
    cut_message = {"role": "user", "content": text}
    cached = llama3_codec.prompt_tokens([system, before, reply, message.to_openai(), after])
    new = len(llama3_codec.prompt_tokens([after], add_generation_prompt=True)) - len(
        llama3_codec.prompt_tokens([], add_generation_prompt=True)
    )
    for kept in ([system, before, reply], [system, before], [system, reply], [system]):
        prompt = llama3_codec.prompt_tokens([*kept, cut_message, after])
        assert server_walk(cached, prompt, CHUNK) >= len(prompt) - new - 1, kept


def test_an_abbreviation_does_not_end_a_sentence(llama3_codec: TiktokenCodec) -> None:
    message = _message(
        1,
        "user",
        "ugh Dr. Patel forgot my refill again. The weather is grim and the bus was late.",
    )
    cut = _cut_one(llama3_codec, "User: ugh Dr. Patel forgot my refill again", message)
    assert cut.text(message.content) == "ugh Dr. Patel forgot my refill again."


def test_cuts_past_the_summary_limit_go_least_value_first(llama3_codec: TiktokenCodec) -> None:
    messages = [
        _message(1, "user", "My dog is called Rex."),
        _message(2, "user", "My sister Anna lives in Lyon and my brother Paul in Nantes."),
    ]
    summary = "User: My dog is called Rex; My sister Anna lives in Lyon"
    costs = {1: 8, 2: 20}
    cuts = abridge(
        summary,
        messages,
        _cutter(llama3_codec),
        cost=lambda m, t: costs[m.id],
        limit=10,
    )
    # One item each: 1/8 beats 1/20 per token, and 8 fits the limit where 28 does not.
    assert [c.message_id for c in cuts] == [1]


def test_a_reopened_session_builds_the_same_prompts(
    tmp_path: Path, llama3_codec: TiktokenCodec
) -> None:
    backend = DryBackend(llama3_codec, n_ctx=512)
    context = {"budget": 220, "layout": "abridge", "recall": False}
    said = [
        f"My order NH-{4000 + i} is late. The weather is grim and the bus was slow again "
        f"today. My dog Rex{i} barked at the courier for ages."
        for i in range(14)
    ]

    def run(conversation: str, reopen: int) -> list[list[int]]:
        prompts: list[list[int]] = []
        chat = None
        for i, text in enumerate(said):
            if chat is None or (reopen and i % reopen == 0):
                if chat is not None:
                    chat.close()
                chat = ChatSession.open(
                    f"sqlite:///{tmp_path / 'abridge.db'}",
                    conversation_id=conversation,
                    backend=backend,
                    context=context,
                )
            chat.send(text)
            assert chat.last_build is not None
            prompts.append(list(chat.last_build.tokens))
        assert chat is not None
        plans = chat.last_build
        chat.close()
        assert plans is not None and plans.plan.layout == "abridge"
        return prompts

    kept = run("kept", 0)
    reopened = run("reopened", 3)
    assert reopened == kept
    with ChatSession.open(
        f"sqlite:///{tmp_path / 'abridge.db'}", conversation_id="kept", backend=backend
    ) as chat:
        state = chat.store.context_state("kept")
    assert state.summary is not None and state.summary.abridged  # cuts were stored
    shown = CliRunner().invoke(
        cli, ["inspect", "kept", "--db", f"sqlite:///{tmp_path / 'abridge.db'}"]
    )
    assert shown.exit_code == 0, shown.output
    assert f"sent as {len(state.summary.abridged)} evicted messages cut down" in shown.output


def test_items_in_any_script_keep_their_own_sentences(llama3_codec: TiktokenCodec) -> None:
    """Items are matched to sentences by their words in any script: a Korean item is kept
    with its own sentence, not with another that shares its digits, and one with no Latin
    letter or digit at all is kept too."""
    message = _message(
        1,
        "assistant",
        "네 고객님, 확인해 드렸어요. 설치는 보통 1시간에서 5시간 정도 걸려요. "
        "기사님은 오후 1시에서 5시 사이에 도착합니다. 택배는 롯데택배로 보내 드립니다. "
        "다른 문의 있으시면 말씀해 주세요.",
    )
    summary = (
        "Assistant: 기사님은 오후 1시에서 5시 사이에 도착합니다; 택배는 롯데택배로 보내 드립니다"
    )
    cut = _cut_one(llama3_codec, summary, message)
    text = cut.text(message.content)
    # By hand: the two sentences of the items; not the one on how long installing takes,
    # which shares the digits 1 and 5 only, nor the closing line.
    assert "기사님은 오후 1시에서 5시 사이에 도착합니다." in text
    assert "택배는 롯데택배로 보내 드립니다." in text
    assert "설치는" not in text and "다른 문의" not in text
    assert cut.value == 2
