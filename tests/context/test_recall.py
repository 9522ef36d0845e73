"""Recall: evicted messages that match the new one, placed right before it.

Oracles: hand-built conversations whose best match is known, the previous build's own tokens
(nothing before the recall section may change), and prompts rendered independently with the
codec from the expected messages.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import pytest

from chatctx.context import RECALL_HEADER, BuildResult, ContextBuilder, ContextState
from chatctx.context._recall import Hit, asks_back, fit_recall, is_question, render_section
from chatctx.model.codec import TiktokenCodec
from chatctx.settings import ContextSettings
from chatctx.store import Message, Store

SYSTEM = "You are a friendly assistant."
FILLER = [
    "The weather was lovely today, we walked by the river for an hour.",
    "I watched a documentary about volcanoes last night, quite fascinating.",
    "Work has been busy, lots of meetings about the quarterly plan.",
    "We are thinking about repainting the kitchen in a light green.",
    "My brother visited and we played board games until midnight.",
    "The bakery on the corner has a new sourdough that is really good.",
]


@pytest.fixture
def store() -> Iterator[Store]:
    with Store("sqlite://") as store:
        store.create_conversation("c")
        yield store


def search(store: Store):  # the callable ChatSession passes to its builder
    return lambda query, before, limit: store.search_messages(
        "c", query, before_position=before, limit=limit, replies=True
    )


def builder(codec: TiktokenCodec, store: Store, **settings: object) -> ContextBuilder:
    config = ContextSettings(summarizer="none", **settings)  # type: ignore[arg-type]
    return ContextBuilder(codec, config, recall=search(store))


def add_turn(store: Store, user: str, reply: str) -> list[Message]:
    return store.add_messages(
        "c", [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    )


def render(codec: TiktokenCodec, messages: Sequence[dict[str, str]]) -> list[int]:
    return codec.prompt_tokens(list(messages))


def ask_after(
    codec: TiktokenCodec, store: Store, kept: Message, question: str, summary: str | None
) -> BuildResult:
    """A prompt for ``question`` with the history from ``kept`` on and ``summary``."""
    return builder(codec, store).build(
        system_prompt=SYSTEM,
        history=store.messages("c", from_position=kept.position),
        new_message=question,
        budget=2000,
        state=ContextState(window_start=kept.position, summary=summary),
    )


def section_lines(built: BuildResult) -> list[str]:
    """The recall section's lines, without its header."""
    section = str(built.messages[-2]["content"])
    assert section.startswith(RECALL_HEADER)
    return section.removeprefix(RECALL_HEADER).splitlines()


def test_best_matching_evicted_message_is_recalled_first(
    llama3_codec: TiktokenCodec, store: Store
) -> None:
    add_turn(store, FILLER[0], "That sounds nice.")
    fact = add_turn(store, "Oh and I'm allergic to shellfish, by the way.", "Noted, no shellfish.")
    add_turn(store, FILLER[1], "Volcanoes are amazing.")
    sister = add_turn(store, "My sister is allergic to cats, poor thing.", "That must be hard.")
    kept = add_turn(store, FILLER[2], "Sounds tiring.")
    state = ContextState(window_start=kept[0].position)  # everything before was evicted
    built = builder(llama3_codec, store).build(
        system_prompt=SYSTEM,
        history=store.messages("c", from_position=state.window_start),
        new_message="Remind me, which shellfish thing was I allergic to again?",
        budget=2000,
        state=state,
    )
    plan = built.plan
    # Hand-computed: the shellfish message shares "shellfish" and "allergic"; the sister's
    # shares only "allergic". The matches come first, best first; then, in the room left,
    # their replies, in the same order.
    assert plan.recalled_ids == [fact[0].id, sister[0].id, fact[1].id, sister[1].id]
    assert plan.recall_scores[0] > plan.recall_scores[1] > 0
    assert not set(plan.recalled_ids) & set(plan.kept_ids)
    section = built.messages[-2]
    assert section["role"] == "system" and section["content"].startswith(RECALL_HEADER)
    assert "user: Oh and I'm allergic to shellfish, by the way." in section["content"]
    assert "assistant: Noted, no shellfish." in section["content"]
    # The prompt is exactly: system, kept history, recall, new message (rendered apart).
    expected = [
        {"role": "system", "content": SYSTEM},
        *[m.to_openai() for m in kept],
        section,
        built.messages[-1],
    ]
    assert built.tokens == render(llama3_codec, expected)
    sections = plan.sections
    assert sum(v for k, v in sections.items() if k != "reserve") == plan.prompt_tokens
    without = render(llama3_codec, [m for m in expected if m is not section])
    assert sections["recall"] == len(built.tokens) - len(without)
    assert 0 < sections["recall"] <= ContextSettings().recall_budget
    assert plan.history_start == sections["system"]  # recall comes after the history


def test_nothing_is_recalled_without_evicted_history_or_when_off(
    llama3_codec: TiktokenCodec, store: Store
) -> None:
    add_turn(store, "I'm allergic to shellfish.", "Noted.")
    question = "What am I allergic to?"
    history = store.messages("c")
    in_window = builder(llama3_codec, store).build(
        system_prompt=SYSTEM, history=history, new_message=question, budget=2000
    )
    assert in_window.plan.recalled_ids == []  # already in the context: never recalled
    evicted = ContextState(window_start=2)
    off = builder(llama3_codec, store, recall=False).build(
        system_prompt=SYSTEM, history=[], new_message=question, budget=2000, state=evicted
    )
    statement = builder(llama3_codec, store).build(
        system_prompt=SYSTEM,
        history=[],
        new_message="I ate shellfish and felt fine",  # not a question: not worth the tokens
        budget=2000,
        state=evicted,
    )
    always = builder(llama3_codec, store, recall_trigger="always").build(
        system_prompt=SYSTEM,
        history=[],
        new_message="I ate shellfish and felt fine",
        budget=2000,
        state=evicted,
    )
    for built in (off, statement):
        assert built.plan.recalled_ids == [] and built.plan.sections["recall"] == 0
        assert len(built.messages) == 2
    assert always.plan.recalled_ids == [history[0].id, history[1].id]


def test_recall_fits_its_budget_and_the_room_left(
    llama3_codec: TiktokenCodec, store: Store
) -> None:
    long_fact = "I'm allergic to shellfish. " + " ".join(FILLER) + " That is all about allergies."
    add_turn(store, long_fact, "Noted, no shellfish for you. " + " ".join(FILLER))
    state = ContextState(window_start=2)
    question = "Which food am I allergic to?"
    roomy = builder(llama3_codec, store, recall_budget=40).build(
        system_prompt=SYSTEM, history=[], new_message=question, budget=2000, state=state
    )
    # The whole message does not fit 40 tokens: its matching sentences are sent instead.
    assert 0 < roomy.plan.sections["recall"] <= 40
    assert "allergic to shellfish" in roomy.messages[-2]["content"]
    assert "volcanoes" not in roomy.messages[-2]["content"]
    alone = len(render(llama3_codec, [{"role": "system", "content": SYSTEM}, roomy.messages[-1]]))
    tight = builder(llama3_codec, store, recall_budget=40).build(
        system_prompt=SYSTEM, history=[], new_message=question, budget=alone + 5, state=state
    )
    # Recall never pushes the prompt over the budget; it gives way and says so.
    assert tight.plan.prompt_tokens == alone and tight.plan.recalled_ids == []
    assert tight.plan.yielded == ["recall"]


def test_failing_search_never_fails_the_turn(llama3_codec: TiktokenCodec) -> None:
    def broken(query: str, before: int, limit: int) -> list[tuple[Message, float]]:
        raise RuntimeError("index is gone")

    built = ContextBuilder(llama3_codec, ContextSettings(summarizer="none"), recall=broken).build(
        system_prompt=SYSTEM,
        history=[],
        new_message="what was it again?",
        budget=500,
        state=ContextState(window_start=4),
    )
    assert built.plan.recall_error == "RuntimeError: index is gone"
    assert built.plan.recalled_ids == [] and len(built.messages) == 2


def simulate(codec: TiktokenCodec, store: Store, turns: int, budget: int) -> Iterator[BuildResult]:
    """A long chat through builder and store, as ChatSession drives them."""
    b = builder(codec, store)
    state = ContextState()
    for i in range(turns):
        if i % 5 == 4:  # every fifth message asks back about an earlier one
            user = f"Wait, what did I say about the {FILLER[(i - 4) % 6].split()[3]} again?"
        else:
            user = f"{FILLER[i % 6]} Also note item {i}: code {1000 + i}."
        built = b.build(
            system_prompt=SYSTEM,
            history=store.messages("c", from_position=state.window_start),
            new_message=user,
            budget=budget,
            state=state,
        )
        yield built
        state = built.state
        add_turn(store, user, f"Understood, item {i} noted.")


def test_recall_never_changes_tokens_before_its_section(
    llama3_codec: TiktokenCodec, store: Store
) -> None:
    builds = list(simulate(llama3_codec, store, 60, budget=400))
    recalled = [b for b in builds if b.plan.recalled_ids]
    assert len(recalled) >= 5 and any(b.plan.evicted for b in builds)
    assert_prefix_stable(llama3_codec, store, builds, budget=400)


def assert_prefix_stable(
    codec: TiktokenCodec, store: Store, builds: Sequence[BuildResult], *, budget: int
) -> None:
    """Each build against two oracles: nothing before its recall section changes."""
    for before, after in itertools.pairwise(builds):
        p = after.plan
        assert p.prompt_tokens <= budget
        history_end = p.sections["system"] + p.sections["summary"] + p.sections["history"]
        # Oracle 1: this prompt without its recall section, rendered apart.
        plain = [m for m in after.messages if not m["content"].startswith(RECALL_HEADER)]
        assert after.tokens[:history_end] == render(codec, plain)[:history_end]
        if not p.evicted:
            # Oracle 2: the previous build's tokens. Up to where its recall section began,
            # the prompt is unchanged: the cached prefix survives a recall.
            b = before.plan
            prev_end = b.sections["system"] + b.sections["summary"] + b.sections["history"]
            assert after.tokens[:prev_end] == before.tokens[:prev_end]
        positions = {m.id: m.position for m in store.messages("c")}
        assert all(positions[i] < p.window_start for i in p.recalled_ids)


def _words(text: str) -> int:  # a cost that can be counted by hand
    return len(text.split())


def test_a_long_match_sends_its_closest_sentence_so_the_next_match_fits() -> None:
    long = Message(
        id=1,
        conversation_id="c",
        position=0,
        role="user",
        content="We drove all day and the kids slept most of the way. "
        "The dog is called Pepper. We stopped twice for gas and snacks.",
    )
    reply = Message(id=2, conversation_id="c", position=1, role="assistant", content="Fun trip!")
    short = Message(id=3, conversation_id="c", position=4, role="user", content="Pepper, beagle")
    hits = [Hit(long, reply, 0.6), Hit(short, None, 0.5)]

    def pick(text: str, query: str) -> list[tuple[int, str]]:  # the dog sentence ranks first
        return [(1, "The dog is called Pepper.")]

    # By hand: the header is 3 words, each line adds "user:" (1 word). The long message
    # whole (24 words) and the short one (2) need 3 + 25 + 3 = 31; with its sentence (5)
    # instead, 3 + 6 + 3 = 12; the reply ("assistant: Fun trip!") adds 3. Whole with its
    # reply, the long one alone takes the 31, as the reply-first order did.
    assert _words(render_section([(long, long.content), (short, short.content)])) == 31
    chosen = fit_recall(hits, "what is my dog called?", 17, _words, pick)
    assert [(m.id, t) for m, t, _ in chosen] == [
        (1, "The dog is called Pepper."),
        (3, "Pepper, beagle"),
    ]
    # Room for the whole long message too: it replaces its sentence; the reply only after.
    chosen = fit_recall(hits, "what is my dog called?", 31, _words, pick)
    assert [(m.id, t) for m, t, _ in chosen] == [(1, long.content), (3, short.content)]
    chosen = fit_recall(hits, "what is my dog called?", 34, _words, pick)
    assert [m.id for m, _, _ in chosen] == [1, 3, 2]


@pytest.mark.parametrize(
    ("text", "asks"),
    [
        ("where did I park?", True),
        ("ok so where did i park", True),  # fillers before the question word
        ("wait what was the name of my dog", True),
        ("whats my locker combo", True),  # typed without the apostrophe
        ("i forget what i take for my back", True),  # a cue
        ("you told me about a place once", True),
        ("lol anyway the movie was good", False),
        ("I did it in the end", False),  # an auxiliary, but not where a question starts
        ("so tired today, long shift", False),
        # A question asks back when it is about the speaker or points back.
        ("what do you do for fun?", False),
        ("who's your teacher?", False),
        ("Does it snow a lot there. I always pictured it warm", False),  # "I" not in the ask
        ("what was it called again?", True),
        ("did we book the 7pm or the 8pm", True),
        ("which one did you recommended?", True),
        ("im new here. whats my ticket number", True),
        # Clause by clause: the question after a comma, about the speaker named before it.
        ("my cat, what breed is she?", True),
        ("if I'm locked out, where's the spare key?", True),
        ("which bus gets me to my office", True),  # a question word and a noun first
        ("blanking on what my sister is called", True),
        ("can't remember where i parked lol", True),
        ("remember which band I mentioned", True),
        ("do you remember what i said about the trip?", True),
        # Talk with a question mark, a question word or a cue in it does not ask back.
        ("yeah I know right? I've been carrying my mouse pad around too", False),
        ("Even if I write my name on it?", False),
        ("can I tell you about my trip?", False),  # asks to tell, not to be told
        ("when we got to the car we drove home", False),  # a clause, not a question
        ("I remember when I was little I climbed trees all day", False),
        ("I forget that most people don't have summer birthdays.", False),
        ("like you said, it's a good feeling to have a clean space", False),
        (
            "so when I was in high school I got sick of playing video games so much and I "
            "felt it was a waste, do you know what I mean?",
            False,  # "do you ...": a question to the listener
        ),
        # About the listener, though the speaker is named in it.
        ("hmm\nhow do you say I love you", False),
        ("So what do you think about my last comment?", False),
        ("Are you in the library again?", False),  # "again" after an auxiliary
        ("wait where are you moving again?", True),  # after a question word: said before
        ("what drink should u pick up for me in the morning", True),  # a request
        ("where did you say I should park?", True),
        # Fragments and tags are no questions: an auxiliary without a subject after it, ", which
        # ..." after a clause, "..., does it?", "i forgot to ...", "thanks for reminding me".
        ("Did them last semester for my music test", False),
        ("Have to tone it down when I play games with friends", False),
        ("was not in my element.", False),
        ("did i pay the deposit", True),
        ("it matters to me, does it?", False),
        ("there is a theory, which states that we will grow", False),
        ("Oh, wait, I forgot to clarify which class you are.", False),
        ("thank you for reminding me about that.", False),
        ("small stuff to remind us of each other", False),
        ("can you remind me what i ordered", True),
        # After a clause it is joined to, a question is read alone: the "I" of "I know" is
        # not what it asks about; a question that names the speaker itself still asks back.
        ("I know, but why waste time on it?", False),
        ("I know it's a lot of credits, but how many classes is that?", False),
        ("I got a new car, but where did I park it?", True),
        ("ok, but what was my dog called?", True),
    ],
)
def test_asks_back(text: str, asks: bool) -> None:
    assert asks_back(text) is asks


@pytest.mark.parametrize(
    ("text", "question"),
    [
        ("what do you do for fun?", True),
        ("ok so how was the trip", True),
        ("remind me later", True),  # a cue
        ("lol anyway the movie was good", False),
    ],
)
def test_is_question(text: str, question: bool) -> None:
    assert is_question(text) is question


def test_a_question_gets_its_recall_room_from_the_oldest_kept_turns(
    llama3_codec: TiktokenCodec, store: Store
) -> None:
    fact = add_turn(store, "Oh and I'm allergic to shellfish, by the way.", "Noted, no shellfish.")
    kept = [add_turn(store, f, "I see, tell me more.") for f in FILLER]
    state = ContextState(window_start=kept[0][0].position)
    history = store.messages("c", from_position=state.window_start)
    question = "Remind me, what am I allergic to?"
    statement = "I'm allergic to long meetings, honestly, haha."  # as long, asks nothing
    b = builder(llama3_codec, store)
    first = b.build(
        system_prompt=SYSTEM, history=history, new_message=question, budget=4000, state=state
    )
    # A budget the prompt fits with fewer tokens to spare than recall_budget (96), half.
    budget = first.plan.prompt_tokens - first.plan.sections["recall"]
    budget += ContextSettings().recall_budget // 2

    def build(message: str) -> BuildResult:
        return b.build(
            system_prompt=SYSTEM, history=history, new_message=message, budget=budget, state=state
        )

    plain = build(statement)
    assert not plain.plan.evicted and plain.plan.prompt_tokens <= budget
    asked = build(question)
    p = asked.plan
    assert p.evicted and "recall_budget" in p.reason
    # Whole turns go, oldest first, down to the low watermark (60% of the budget).
    gone = [m.id for turn in kept[: len(kept) - len(p.kept_ids) // 2] for m in turn]
    assert p.evicted_ids == gone and gone
    assert p.sections["recall"] > 0 and fact[0].id in p.recalled_ids
    assert p.prompt_tokens <= budget
    # The kept turns are unchanged, in place: this prompt, recall left out, is the same
    # history rendered apart.
    rest = [m for turn in kept for m in turn if m.id not in gone]
    expected = [{"role": "system", "content": SYSTEM}, *[m.to_openai() for m in rest]]
    end = p.sections["system"] + p.sections["history"]
    assert asked.tokens[:end] == render(llama3_codec, expected)[:end]


def test_what_the_prompt_already_says_is_not_recalled_again(
    llama3_codec: TiktokenCodec, store: Store
) -> None:
    # An extractive summary holds the allergy sentence word for word (case and punctuation
    # aside); the locker code and the reply about the parking spot are news.
    both = add_turn(
        store,
        "I'm allergic to shellfish. My locker code is 4411.",
        "Noted, no shellfish and code 4411.",
    )
    said = add_turn(store, "I parked on level 3.", "Got it: level three, spot 12.")
    kept = add_turn(store, FILLER[2], "Sounds tiring.")
    summary = "Earlier: i'm ALLERGIC to shellfish! I parked on level 3"

    def ask(summary: str) -> BuildResult:
        question = "Remind me: my shellfish thing, locker code, and where I parked?"
        return ask_after(llama3_codec, store, kept[0], question, summary)

    built = ask(summary)
    # Hand-computed: the user message less its first sentence; its reply whole; the parking
    # message is all said, so its reply comes alone.
    assert section_lines(built) == [
        "user: My locker code is 4411.",
        "assistant: Noted, no shellfish and code 4411.",
        "assistant: Got it: level three, spot 12.",
    ]
    # Chosen in this order: the matches (the parking reply standing in for its message), then
    # the replies of matches sent whole.
    assert built.plan.recalled_ids == [both[0].id, said[1].id, both[1].id]
    # When the prompt says all of it, nothing is recalled.
    everything = summary + " My locker code is 4411. Noted, no shellfish and code 4411. "
    built = ask(everything + said[1].content)
    assert built.plan.recalled_ids == []
    assert RECALL_HEADER not in str(built.messages[-2]["content"])


def test_a_clause_that_says_the_same_is_said(llama3_codec: TiktokenCodec, store: Store) -> None:
    # The extractive summary keeps the clause of a sentence that says something, fillers cut
    # ("oh and", "lol"), behind a "User:" label: that sentence is not sent again. A sentence
    # whose words that say something only partly match a clause is news, and so is one that
    # shares them with a clause saying more (the gym one: "right" and "work" are in the
    # station clause, which also says "station").
    meds = add_turn(
        store,
        "oh and forgot to take zoloft this morning and im def feeling it lol. "
        "i go right after work now.",
        "Hope the day gets better!",
    )
    kept = add_turn(store, FILLER[2], "Sounds tiring.")
    summary = (
        "User: forgot to take zoloft this morning and im def feeling it; "
        "I work right by the station"
    )
    question = "what did i tell you about zoloft and going after work?"
    built = ask_after(llama3_codec, store, kept[0], question, summary)
    assert section_lines(built) == [
        "user: i go right after work now.",
        "assistant: Hope the day gets better!",
    ]
    assert built.plan.recalled_ids == [meds[0].id, meds[1].id]


# A message that shares "garage" with the parking questions below, one sentence of it.
GARAGE = (
    "The garage closes at 9 tonight. My sister borrowed the car yesterday and returned it dirty.",
    "Annoying!",
)


def test_when_a_kept_message_is_the_best_match_the_evicted_send_their_closest_sentence(
    llama3_codec: TiktokenCodec, store: Store
) -> None:
    other = add_turn(store, *GARAGE)
    kept = add_turn(store, FILLER[2], "Sounds tiring.")
    parked = add_turn(store, "I parked on level 3 of the garage.", "Got it.")
    question = "Remind me where I parked in the garage?"
    # The oracle for "best": the search itself ranks the kept message first.
    ranked = search(store)(question, parked[1].position + 1, 5)
    assert ranked[0][0].id == parked[0].id and other[0].id in {m.id for m, _ in ranked}
    built = ask_after(llama3_codec, store, kept[0], question, None)
    # Hand-computed: the kept parking message answers; the evicted match sends the one
    # sentence that shares a word with the question, no reply (before: whole, with it).
    assert section_lines(built) == ["user: The garage closes at 9 tonight."]
    assert built.plan.recall_answered == parked[0].id


def test_when_the_prompt_says_the_best_match_the_others_send_their_closest_sentence(
    llama3_codec: TiktokenCodec, store: Store
) -> None:
    parked = add_turn(store, "I parked on level 3 of the garage.", "Got it.")
    other = add_turn(store, *GARAGE)
    kept = add_turn(store, FILLER[2], "Sounds tiring.")

    def ask(summary: str | None) -> BuildResult:
        return ask_after(
            llama3_codec, store, kept[0], "Remind me where I parked in the garage?", summary
        )

    # Hand-computed: the best match (two of the question's words) is in the summary, so the
    # other match sends the one sentence that shares a word with the question, no reply.
    built = ask("User: I parked on level 3 of the garage")
    assert section_lines(built) == ["user: The garage closes at 9 tonight."]
    assert built.plan.recall_answered == parked[0].id
    # With the best match evicted and unsaid, both are sent whole, with the reply that says
    # something ("Got it." says nothing).
    built = ask(None)
    assert built.plan.recall_answered is None
    assert section_lines(built) == [
        f"user: {parked[0].content}",
        f"user: {' '.join(other[0].content.split())}",
        "assistant: Annoying!",
    ]


def test_questions_and_sentences_are_read_in_any_script() -> None:
    from chatctx.context._facts import reads_as_english
    from chatctx.context._recall import marked, sentences

    # Hand-read: a question mark in each script, and none in a statement.
    for asked in ("환불은 언제 되나요?", "注文番号は何ですか？", "¿Cuál era mi pedido?", "متى؟"):
        assert marked(asked) and is_question(asked)
    assert not marked("배송은 금요일입니다.") and not is_question("注文番号はA-4821です。")
    # The English cue words read English only: another language is left to marks and meaning.
    assert reads_as_english("where did i park") and not reads_as_english("제 주문 번호가 뭐였죠")
    assert not asks_back("제 주문 번호가 뭐였죠?")  # what the builder's mark rule is for
    # Chinese and Japanese end sentences with full-width marks and no space after them.
    assert [s for _, s in sentences("注文番号はA-4821です。配送は金曜日ですか？はい。")] == [
        "注文番号はA-4821です。",
        "配送は金曜日ですか？",
        "はい。",
    ]


def test_an_earlier_question_gives_way_to_its_reply() -> None:
    from chatctx.context._recall import answers

    def message(i: int, role: str, text: str) -> Message:
        return Message(id=i, conversation_id="c", position=i, role=role, content=text)

    asked, reply = (
        message(1, "user", "면접은 어디서 봐요?"),
        message(2, "assistant", "공학관 115호입니다."),
    )
    told = message(3, "user", "제 번호는 A-4821이에요.")
    lone = message(5, "user", "어디서 봐요?")
    hits = [Hit(asked, reply, 0.6), Hit(told, None, 0.5), Hit(lone, None, 0.4)]
    # The question is replaced by its answer; a statement stays; a lone question goes.
    assert answers(hits) == [Hit(reply, None, 0.6), Hit(told, None, 0.5)]
