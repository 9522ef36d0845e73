"""Recall: evicted messages that match the new one, sent again right before it.

The builder asks a search (the store's full-text index) for the conversation's evicted
messages that share the new message's words, and fits the best of them into a small labelled
section placed after the cached history. Nothing before that section changes, so the cached
prefix stays valid and only the recalled tokens are new; the next turn drops the section again.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from chatctx.context._facts import EMPTY_WORDS
from chatctx.model.words import words as word_list
from chatctx.store import Message
from chatctx.store.search import query_terms, stem_prefix

RECALL_HEADER = "Recalled from earlier:\n"
SNIPPET_GAP = " … "
# Sentence ends: Latin ones before a space, the full-width ones of Chinese and Japanese (。！？)
# with or without one, and the Arabic question mark.
_SENTENCE = re.compile(r"(?<=[.!?\u061f])\s+|(?<=[\u3002\uff01\uff1f])\s*|\n+")
# Clause ends, in those scripts too; ":" ends a label ("User: ...").
_CLAUSE_END = re.compile(r"[.!?;:\u3002\uff01\uff1f\uff1b\uff1a\u061f]+(?:\s+|$)|\n+")
_WORD = re.compile(r"[^\W_]+")
# A question mark in any script: Latin, full width (CJK), Arabic, Armenian, Spanish's opening.
QUESTION_MARKS = frozenset("?\uff1f\u061f\u055e\u00bf")


class RecallSearch(Protocol):
    """Finds a conversation's messages before ``before_position`` that match ``query``.

    Returns (message, score) best first, higher scores better. A matched user message may be
    followed by the assistant message right after it (its reply) with the same score
    (``Store.search_messages(..., replies=True)``). A search whose scores are cosine
    similarities says so with ``by_meaning = True``.
    """

    def __call__(
        self, query: str, before_position: int, limit: int
    ) -> Sequence[tuple[Message, float]]: ...


@dataclass(frozen=True, slots=True)
class Hit:
    """One match: the matched message, its reply when there is one, and the score."""

    message: Message
    reply: Message | None
    score: float


# The English words these rules read (``chatctx/data/words/en.toml``, one list each).
# Words that make any message a question to ``is_question`` ("remind me later", "you told
# me"); "again" and "last" are not among them: "weird again today" asks nothing.
_CUES = word_list("recall", "cues")
# The speaker, typed the way people type it ("i'm" is "i" and "m"; "im", "ive" without the
# apostrophe). A question about the speaker is what an evicted message answers.
_SELF = word_list("recall", "self")
# A question without its question mark ("where did I park") starts with one of these, the
# way people type them too ("whats", "wheres"), after a filler or two ("ok so where did I").
_ASKING = word_list("recall", "asking")
_FILLERS = word_list("recall", "fillers")
# Words a sentence says nothing with, for ``said``: function words, vague chat words, the
# fillers a summary cuts ("oh and ... lol").
_SAYS_NOTHING = EMPTY_WORDS | _FILLERS | word_list("recall", "says_nothing")

# What ``asks_back`` reads a clause by.
_YOU = word_list("recall", "you")
_AUXILIARY = word_list("recall", "auxiliary")
_MODAL = word_list("recall", "modal")
_QUESTION_WORD = _ASKING - _AUXILIARY - _MODAL
# After a question word, these make a question ("where DID i park", "what'S my pin");
# a subject first makes a clause ("when I was little", "which I find odd").
_INVERTED = _AUXILIARY | _MODAL | {"s", "re", "d", "ll"}
_JOINED = word_list("recall", "joined")
_FORGETTING = word_list("recall", "forgetting")
_NOT = word_list("recall", "negation")  # "can't": "can", "t"
_RECALLING = word_list("recall", "recalling")
_TOLD = word_list("recall", "told")
# In a question, words that point back at something said ("which one did you recommended?",
# "do you remember where i parked?"); "again" and "earlier" too, unless to the listener.
_POINTING = _RECALLING | _TOLD
_AGAIN = word_list("recall", "again")
_ABOUT_YOU = word_list("recall", "about_you")
_PRONOUNS = word_list("recall", "pronouns")
# What an unmarked question opened by an auxiliary has next: its subject ("did i", "is my").
_SUBJECTS = _PRONOUNS | word_list("recall", "subjects")
_JOINING = word_list("recall", "joining")
_CLAUSE = re.compile(r"[,;:]+\s*|\s+-+\s+")
# Words: a longer clause is talk with a question in it ("yeah i know right? ..."), and a
# sentence up to _SHORT words is one question even across a comma ("if the train is late,
# who picks me up?").
_LONG, _SHORT = 16, 20


def marked(text: str) -> bool:
    """Whether ``text`` has a question mark, in any script."""
    return not QUESTION_MARKS.isdisjoint(text)


def _asking(text: str, words: Sequence[str]) -> bool:
    first = next((w for w in words[:4] if w not in _FILLERS), None)
    return marked(text) or first in _ASKING


def is_question(text: str) -> bool:
    """Whether a message asks something: a question mark (in any script), or a question word
    first (after fillers such as "ok so"), or a cue such as "remind me"."""
    words = _WORD.findall(text.casefold())
    return _asking(text, words) or any(w in _CUES for w in words)


def asks_only(text: str) -> bool:
    """Whether every sentence of ``text`` asks (a question mark, or a question word first):
    it states nothing that could answer anything."""
    parts = sentences(text)
    return bool(parts) and all(_asking(s, _WORD.findall(s.casefold())) for _, s in parts)


def says_nothing(text: str) -> bool:
    """Whether ``text`` has no word that says something ("what?", "really? why's that?"):
    nothing to find a match by meaning for."""
    return not _news(_normalized(text))


def _lead(words: Sequence[str]) -> Sequence[str]:
    """``words`` from the first that is not a filler ("ok so where ...": "where ...")."""
    start = 0
    while start < min(4, len(words)) and words[start] in _FILLERS:
        start += 1
    return words[start:]


def _not_knowing(words: Sequence[str]) -> bool:
    """Whether the speaker asks for something said without a question: "remind me ...",
    "i forgot / can't remember / am blanking on what ...", "remember which ...", "you told
    me ..."."""
    for i, word in enumerate(words):
        # "remind me ...", "can you remind me": not "thanks for reminding me", "to remind us".
        reminding = word in ("remind", "reminding") and words[i + 1 : i + 2] == ["me"]
        if reminding and (i == 0 or words[i - 1] != "for"):
            return True
        # "you told me about a game" asks back; "like you said" agrees and asks nothing.
        told = word in _TOLD and i and words[i - 1] in _YOU
        if told and (i < 2 or words[i - 2] not in ("like", "as")):
            return True
        forgetting = word in _FORGETTING or (
            word in _RECALLING and (i == 0 or not _NOT.isdisjoint(words[max(0, i - 3) : i]))
        )
        if forgetting and words[i + 1 : i + 2] == ["to"]:
            continue  # "i forgot to call": a thing not done, not a thing said
        if forgetting and any(w in _QUESTION_WORD or w == "name" for w in words[i + 1 : i + 4]):
            return True
    return False


def _inverted(words: Sequence[str]) -> bool:
    """Whether a clause that starts with a question word reads as a question."""
    if words[0] in _JOINED:
        return True
    if words[0] in ("what", "which", "whose") and words[1:2] and words[1] not in _SELF | _YOU:
        return True  # "which bus gets me home", "what day did we pick"
    for word in words[1:5]:
        if word in _INVERTED:
            return True
        if word in _SELF or word in _YOU:
            return False
    return False


def _to_listener(words: Sequence[str]) -> bool:
    """Whether a question asks about the listener: "how do you say ...", "are you ...",
    "what do you think about my ...". Not a request ("what should u grab for me",
    "did you book my table"): a modal or "did" before "you" may ask for the speaker."""
    for i, word in enumerate(words[:5]):
        if word in _INVERTED:
            return word in _ABOUT_YOU and words[i + 1 : i + 2] != [] and words[i + 1] in _YOU
    return False


def _tag(words: Sequence[str]) -> bool:
    """Whether a clause is a question tag asking for agreement: "..., does it?", "..., didn't
    I?", "..., right?"."""
    if words in (["right"], ["ok"], ["okay"], ["eh"], ["huh"]):
        return True
    verb, *rest = words
    verb = verb.removesuffix("n")  # "didn't" reads as "didn", "t"
    return (
        verb in _AUXILIARY | _MODAL | {"wo", "ca"}  # "won't", "can't"
        and 1 <= len(rest) <= 2
        and all(w in _PRONOUNS or w in ("t", "not") for w in rest)
    )


def _asks_back_in(
    words: Sequence[str], marked: bool, sentence: Sequence[str], later: bool, joined: bool
) -> bool:
    """Whether one clause (its words after fillers; ``marked``: it has a question mark) of
    ``sentence`` (its words) asks about the speaker or points back; ``later``: a clause with
    something in it came before, in the same sentence; ``joined``: this clause opens with a
    conjunction ("..., but why ...")."""
    if not words or len(words) > _LONG or words[0] in _YOU:
        return False
    first = words[0]
    if later and (_tag(words) or (first == "which" and not marked)):
        return False  # a question tag, or ", which ..." saying more about what came before
    if not (marked or first in _ASKING):
        return False
    listener = _to_listener(words)
    told = not _POINTING.isdisjoint(words) or (
        listener and "say" in words and "did" in words  # "where did you say i should park"
    )
    # Put to the listener, "again" points back after a question word ("where are you moving
    # again?"), not after an auxiliary ("are you in the library again?").
    again = not _AGAIN.isdisjoint(words)
    pointing = told or (again and (not listener or first in _QUESTION_WORD))
    if not marked and first in _QUESTION_WORD and not (pointing or _inverted(words)):
        return False
    # A short question is one across a comma ("if the train is late, who picks me up?"),
    # not after a clause it is joined to ("I know, but why ...").
    whole = marked and len(sentence) <= _SHORT and not joined
    about = sentence if whole else words
    speaker = not _SELF.isdisjoint(about)
    if pointing and (speaker or "again" in words or first in _QUESTION_WORD):
        return True
    if not speaker or listener:
        return False  # about the speaker, put to the listener: "how do you say I love you"
    if first in _QUESTION_WORD:
        return True
    # An auxiliary first, unmarked, asks only with a subject after it ("did i pay"), not in
    # a fragment ("did them last semester", "have to tone it down", "was not in my element").
    return first in _AUXILIARY and words[1:2] != [] and (marked or words[1] in _SUBJECTS)


def asks_back(text: str) -> bool:
    """Whether a message asks about something said earlier: a question about the speaker
    ("when is my niece's birthday?", "where did i park", "my cat, what breed is she?"), one that
    points back ("what was that place called again?", "do you remember what i said?"), or a
    request without a question ("remind me ...", "i forgot what ...", "you told me ...").

    Read clause by clause: a question starts there (after fillers such as "ok so") with a
    question word or an auxiliary that is not followed by "you" ("did I", not "did you"),
    or ends with a question mark. Talk that has a question mark or a question word in it
    ("yeah I know right? ...", "when I was little ...", "can I tell you ...") does not ask
    back. Other questions ("what do you do for fun?") are mostly about what is being said
    now: recall for them only on a near match (``ContextSettings.recall_near_similarity``).
    """
    for _, sentence in sentences(text):
        words = _WORD.findall(sentence.casefold())
        if _not_knowing(_lead(words)):
            return True
        later = False
        for clause in _CLAUSE.split(sentence):
            raw = _WORD.findall(clause.casefold())
            clause_words = _lead(raw)
            joined = later and bool(raw) and raw[0] in _JOINING
            if _asks_back_in(clause_words, "?" in clause, words, later, joined):
                return True
            later = later or bool(clause_words)
    return False


def _normalized(text: str) -> list[str]:
    return _WORD.findall(text.casefold())


def repeats(message: Message, query: str) -> bool:
    """Whether ``message`` says word for word what the new message says: nothing to add."""
    return _normalized(message.content) == _normalized(query)


@dataclass(frozen=True, slots=True)
class Known:
    """What a prompt already says, for ``said``."""

    text: str  # its words, normalized, space-delimited
    clauses: frozenset[frozenset[str]]  # what each clause says (``_news``), cut at . ! ? ; :


def known_text(texts: Sequence[str], asked: str = "") -> Known:
    """What a prompt already says: its words in order, and what each clause of ``texts``
    says. The question (``asked``) counts word for word only: its clauses name what it asks
    about, which is what an answer says too."""
    clauses = frozenset(
        frozenset(news)
        for text in texts
        for clause in _CLAUSE_END.split(text)
        if (news := _news(_normalized(clause)))
    )
    words = " ".join(" ".join(_normalized(t)) for t in [*texts, asked])
    return Known(f" {words} ", clauses)


def _news(words: Sequence[str]) -> set[str]:
    """The words of a sentence that say something: not function words or chat fillers
    ("NY" and "2" do)."""
    return {w for w in words if w not in _SAYS_NOTHING and (len(w) > 1 or w.isdigit())}


def said(sentence: str, known: Known) -> bool:
    """Whether the prompt already says ``sentence``: word for word, or in a clause that says
    the same and only that, fillers aside (an extractive summary keeps "left my keys at
    the gym" of "oh and left my keys at the gym lol"). A sentence with
    nothing to say ("how do you feel?") is said."""
    words = _normalized(sentence)
    if f" {' '.join(words)} " in known.text:
        return True
    news = _news(words)
    return not news or frozenset(news) in known.clauses


def unsaid(message: Message, known: Known) -> Message | None:
    """``message`` less the sentences the prompt already says (``said``), or None when
    nothing is left. Recalling them again would cost tokens and add nothing."""
    parts = sentences(message.content)
    kept = [s for _, s in parts if not said(s, known)]
    if not kept:
        return None
    if len(kept) == len(parts):
        return message
    return replace(message, content="\n".join(kept))


def drop_said(hits: Sequence[Hit], known: Known) -> list[Hit]:
    """``hits`` with what the prompt already says taken out (``unsaid``); a hit whose message
    is all said keeps its reply's news, as a hit of its own."""
    out: list[Hit] = []
    for hit in hits:
        message = unsaid(hit.message, known)
        reply = unsaid(hit.reply, known) if hit.reply is not None else None
        if message is not None:
            out.append(Hit(message, reply, hit.score))
        elif reply is not None:
            out.append(Hit(reply, None, hit.score))
    return out


def answers(hits: Sequence[Hit]) -> list[Hit]:
    """``hits`` with each message that only asks ("면접은 어디서 봐요?", "where do I park?")
    replaced by its reply, which holds the answer; one with no reply listed is left out."""
    out: list[Hit] = []
    for hit in hits:
        if not asks_only(hit.message.content):
            out.append(hit)
        elif hit.reply is not None:
            out.append(Hit(hit.reply, None, hit.score))
    return out


def group_hits(found: Sequence[tuple[Message, float]]) -> list[Hit]:
    """Pair each user message with the reply listed right after it."""
    hits: list[Hit] = []
    for message, score in found:
        last = hits[-1] if hits else None
        if (
            last is not None
            and last.reply is None
            and last.message.role == "user"
            and message.role == "assistant"
            and message.position == last.message.position + 1
        ):
            hits[-1] = Hit(last.message, message, last.score)
        else:
            hits.append(Hit(message, None, score))
    return hits


def _matches(word: str, terms: set[str], prefixes: set[str]) -> bool:
    return word in terms or any(word.startswith(p) for p in prefixes)


def sentences(text: str) -> list[tuple[int, str]]:
    """``text`` cut into sentences and lines, whitespace collapsed: (order, sentence). JSON
    (a tool's result) is cut into its values, each with its path: ``order.status: shipped``."""
    items = _json_items(text)
    if items is not None:
        return list(enumerate(items))
    out: list[tuple[int, str]] = []
    for order, sentence in enumerate(_SENTENCE.split(text)):
        sentence = " ".join(sentence.split())
        if sentence:
            out.append((order, sentence))
    return out


MAX_JSON_ITEMS = 2000  # values of one JSON text cut into items (the rest are left out)
JSON_LINES = 4  # most values of one JSON result recalled together


@functools.lru_cache(maxsize=256)
def _json_items(text: str) -> tuple[str, ...] | None:
    """The values of a JSON object or array as ``path: value`` lines; None for other text.
    Cached: a recalled result is cut by the search, the pick and the fit alike."""
    body = text.strip()
    if not body.startswith(("{", "[")):
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict | list):
        return None
    out: list[str] = []

    def walk(node: Any, path: str) -> None:
        if len(out) >= MAX_JSON_ITEMS:
            return
        if isinstance(node, dict):
            for key, child in node.items():
                walk(child, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list):
            for i, child in enumerate(node):
                walk(child, f"{path}[{i}]")
        elif isinstance(node, str):  # prose (an article's body) goes sentence by sentence
            for sentence in _SENTENCE.split(node):
                if sentence.strip():
                    out.append(" ".join(f"{path}: {sentence}".split()))
        else:
            out.append(" ".join(f"{path}: {json.dumps(node)}".split()))

    walk(value, "")
    return tuple(out) or None


def snippet(text: str, query: str) -> list[tuple[int, str]]:
    """The sentences of ``text`` that share a word with ``query``, best first.

    Used when a whole message does not fit: the part that matched is what is worth sending.
    """
    terms = set(query_terms(query))
    prefixes = {p for p in (stem_prefix(t) for t in terms) if p is not None}
    scored: list[tuple[int, int, str]] = []
    for order, sentence in sentences(text):
        words = {w for w in _WORD.findall(sentence.casefold())}
        shared = sum(_matches(w, terms, prefixes) for w in words)
        if shared:
            scored.append((shared, order, sentence))
    return [(order, s) for _, order, s in sorted(scored, key=lambda item: (-item[0], item[1]))]


def render_section(items: Sequence[tuple[Message, str]]) -> str:
    """The recall section's text: the recalled lines in conversation order."""
    ordered = sorted(items, key=lambda item: item[0].position)
    return RECALL_HEADER + "\n".join(
        f"{message.role}: {' '.join(text.split())}" for message, text in ordered
    )


def fit_recall(
    hits: Sequence[Hit],
    query: str,
    room: int,
    cost: Callable[[str], int],
    pick: Callable[[str, str], list[tuple[int, str]]] = snippet,
    *,
    whole: bool = True,
) -> list[tuple[Message, str, float]]:
    """Choose what to recall within ``room`` tokens: (message, text sent, score), best first.

    ``cost`` gives the tokens the whole section would take. Room goes where an answer is most
    likely, in three rounds: first each match's closest sentence, best match first (the one
    ``pick`` ranks first among those that fit, by default sharing the most of the query's
    words; a message of one sentence, or with none picked, goes whole); then, in the room
    left, whole messages in place of their sentence; then the replies. A long message that
    matched costs no more than the sentence that matched, so the next match still fits.
    ``whole`` False stops after the first round: the closest sentences only.
    """
    sent: dict[int, tuple[Message, str, float]] = {}  # by hit, in the order chosen

    def fits(index: int, message: Message, text: str) -> bool:
        items = [(m, t) for i, (m, t, _) in sent.items() if i != index] + [(message, text)]
        return cost(render_section(items)) <= room

    for index, hit in enumerate(hits):
        message = hit.message
        parts = sentences(message.content)
        ranked = pick(message.content, query) if len(parts) > 1 else []
        # A tool's result (JSON cut into its values, or lines) is a record: its values that
        # share the query's words first (an id asked for by name), then the rest as ``pick``
        # ranks them, and several of them together.
        record = ranked and (message.role == "tool" or _json_items(message.content) is not None)
        if record:
            matched = snippet(message.content, query)
            ranked = matched + [part for part in ranked if part not in matched]
        picked = [t for _, t in ranked]
        if record:
            # A record's values go together: the one asked for and the one that names the
            # record ("ticket_id: ..." with "subject: damaged pan"), in the record's order.
            picked = [
                "; ".join(t for _, t in sorted(ranked[:n])) for n in range(JSON_LINES, 1, -1)
            ] + picked
        for text in [*picked, message.content] if picked else [message.content]:
            if fits(index, message, text):
                sent[index] = (message, text, hit.score)
                break
    if not whole:
        return list(sent.values())
    for index, (message, text, score) in list(sent.items()):
        if text != message.content and fits(index, message, message.content):
            sent[index] = (message, message.content, score)
    chosen = list(sent.values())
    for index, hit in enumerate(hits):
        reply = hit.reply
        if index in sent and sent[index][1] == hit.message.content and reply is not None:
            items = [(m, t) for m, t, _ in chosen] + [(reply, reply.content)]
            if reply.content.strip() and cost(render_section(items)) <= room:
                chosen.append((reply, reply.content, hit.score))
    return chosen
