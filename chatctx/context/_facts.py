"""Facts a running summary must keep, found with no model.

Three kinds:

- **Identifiers** a support conversation must not lose: order and ticket numbers, product
  models, amounts, e-mail addresses, capitalized names people introduce themselves with.
- **Statements the user makes about themselves**, the way people say them in chat: lower case,
  contractions, typos ("im"), said in passing ("oh and I can't have gluten"). A sentence
  counts when it speaks in the first person and says something durable: health and diet,
  names of people and pets, family, home and origin, work and study, belongings and where they
  were left, plans and dates, preferences, open requests. Transient chat ("lol ok", "im tired")
  does not.
- **Minor facts**: any other user sentence that names something specific (a word outside
  everyday chat vocabulary: "propranolol", "Poughkeepsie", "bouldering"), or speaks about
  the speaker with content words, if its words are rare enough in everyday chat to tell
  something; the rarer, the more it is worth. A recognized statement with nothing specific
  in it, no number, date or name ("i really like tacos") scores lower, and may become minor.

Statements and minor facts are read in English only, from the word lists and patterns of
``chatctx/data/words/en.toml`` (general English, not tuned to a data set): a boost for text
that reads as English. Identifiers and values are read in any script. Every function is pure
and deterministic. Facts are compared as parsed sets (:func:`fact_set`), never by substring.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.resources import files

from chatctx.model.words import patterns
from chatctx.model.words import words as word_list
from chatctx.store.search import STOPWORDS, query_terms, unspaced

FACTS_PREFIX = "Facts: "

# Identifiers: order/ticket numbers and models (NH-48213, T-7781, AX3000, 4K55), #refs,
# long numbers and account names holding one (sz31884206, 1500mAh), amounts with their
# currency sign before or after ($49, 6,50 €), e-mail addresses.
# Bounded by anything but a Latin letter or digit: in Chinese, Japanese or Korean an identifier
# sits between letters of the sentence ("订单号是DM7720135946一共", "번호는A-4821이고").
# An e-mail address is tried first: "kim0815@..." is one address, not an account name.
_IDENTIFIER = re.compile(
    r"(?<![A-Za-z0-9À-ÿ._%+-])[A-Za-z0-9À-ÿ._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+(?![A-Za-z0-9-])"
    r"|(?<![A-Za-z0-9_])(?:[A-Z]{1,6}-?[A-Z]*\d[A-Za-z0-9_-]*|\d+[A-Z][A-Za-z0-9_-]*"
    r"|#\d[A-Za-z0-9_-]*|[A-Za-z]+\d{4,}[A-Za-z0-9_-]*|\d{4,})(?![A-Za-z0-9_])"
    r"|[$€£]\s?\d+(?:[,.]\d+)*|(?<![\w.,])\d+(?:[,.]\d+)*\s?[$€£¥₩](?!\w)"
)
# Values written the same way in any language: times, dates, phone numbers and grouped amounts
# (14:30, 3/14, 090-4418-2275, 38,000), sizes (10x10, 120×60), and a number joined to a
# letter of a script other than Latin, its unit ("38,000원", "10시", "3月14日", "5号"; one
# letter: the rest of the run is the sentence). The longer of overlapping matches counts
# (``identifiers``).
_VALUE = re.compile(
    r"(?<!\d)\d+(?:[-:/.,]\d+)+(?:(?![A-Za-z])[^\W\d_])?|(?<!\d)\d+(?![A-Za-z])[^\W\d_]"
    r"|(?<![\w.])\d+(?:[.,]\d+)?\s?[x\u00d7]\s?\d+(?:[.,]\d+)?(?![\w.])"  # sizes: 10x10, 2 × 1,5
)
# A name set off by quotation marks, in any script's ("el plan 'Óptimo'", 「らくらくパック」,
# “居民峰谷分时电价”, «Plan Óptimo», '완전자차 프리미엄'); an ASCII apostrophe only where no
# Latin letter touches it outside ("don't", "the kids' toys" hold none).
_QUOTED = re.compile(
    r"[「『“«]([^「」『』“”«»\n]{2,40})[」』”»]|\"([^\"\n]{2,40})\""
    r"|(?<![A-Za-z])'([^'\n]{2,40})'(?![A-Za-z])"
)
# Capitalized words after a sentence's first ("Ramiro Esquivel", "EpiPen", "Varberg"): names,
# in languages other than English (English has its own patterns).
_CAPITALIZED = re.compile(
    r"(?<=[^\s.!?¿¡]\s)[A-Z][A-Za-zÀ-ÿ]*[a-zà-ÿ](?:\s[A-Z][A-Za-zÀ-ÿ]*[a-zà-ÿ])*"
)
_DIGITS = re.compile(r"\d+")
# What ``replaced`` reads next to a value: terms on each side, characters where no spaces.
NEAR_TERMS, NEAR_CHARS = 2, 8
NEAR_SPAN = 80  # characters read on each side at most: the cost stays linear in a long text
_CLAUSE_MARK = re.compile(r"[,;:.!?\u3001\u3002\uff0c\uff1b\uff1a\uff01\uff1f\u061f\u060c]")
# English's statement patterns come from its data file (``chatctx/data/words/en.toml``): a
# boost for text that reads as English (``reads_as_english``). Text in other languages is kept
# for its values, identifiers and quoted or capitalized names, and recalled by meaning.
_EN = patterns("facts.patterns")
_I = re.IGNORECASE
# People introducing themselves with a capitalized name: "my name is Maria Lopez", "I'm Jonas".
_INTRODUCED = re.compile(_EN["introduced"])
# Sentence ends, not abbreviations ("St. Mary's", "Dr. Lee", "Apt. 4"); Chinese and Japanese
# end a sentence without a space.
_SENTENCE = re.compile(
    r"(?<=[.!?\u061f])"
    + "".join(
        rf"(?<!\b[{a[0].upper()}{a[0]}]{re.escape(a[1:])}\.)"
        for a in sorted(word_list("facts.sentences", "abbreviations"))
    )
    + r"\s+|(?<=[\u3002\uff01\uff1f])\s*|\n+"
)
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "`": "'"})

_ANCHOR = re.compile(_EN["anchor"])
_LEAD = re.compile(_EN["lead"], _I)
_TRAIL = re.compile(_EN["trail"], _I)
_QUESTION = re.compile(_EN["question"])
# How durable and useful each kind of fact is; a kind's pattern is its language's.
_WEIGHTS = {
    "health": 3.0,
    "name": 3.0,
    "whereabouts": 3.0,
    "home": 2.5,
    "work": 2.5,
    "family": 2.0,
    "pet": 2.0,
    "possession": 2.0,
    "event": 2.5,
    "plan": 2.0,
    "intent": 1.5,
    "preference": 2.0,
    "favourite": 2.5,
    "number": 2.5,
    "age": 2.5,
    "habit": 2.0,
    "request": 2.0,
}
_CUE_PATTERNS = patterns("facts.cues")
if set(_CUE_PATTERNS) != set(_WEIGHTS):
    raise RuntimeError(
        f"chatctx/data/words/en.toml [facts.cues] has kinds {sorted(_CUE_PATTERNS)}, "
        f"the code weighs {sorted(_WEIGHTS)}"
    )
# (kind, weight, pattern).
_CUES: tuple[tuple[str, float, re.Pattern[str]], ...] = tuple(
    (kind, weight, re.compile(_CUE_PATTERNS[kind])) for kind, weight in _WEIGHTS.items()
)
# Which kinds are about the speaker even without "I"/"my" (a fragment like "allergic to nuts").
_SELF_EVIDENT = frozenset({"health", "whereabouts", "name", "number", "event", "age"})
_SELF_EVIDENT_CUES = tuple(cue for cue in _CUES if cue[0] in _SELF_EVIDENT)
_IMPLIED_SPEAKER = re.compile(_EN["implied_speaker"])
_DATE = re.compile(_EN["date"])
_DROPPED_SUBJECT = re.compile(_EN["dropped_subject"])
_LEANS_BACK = re.compile(_EN["leans_back"], _I)
_ASKS_ITSELF = re.compile(_EN["asks_itself"], _I)
_CLAUSE_START = re.compile(_EN["clause_start"], _I)
_NUMBER = re.compile(_EN["number"])
_CLAUSE_BREAK = re.compile(_EN["clause_break"], _I)
_SOMEONE_ELSE = re.compile(_EN["someone_else"])
_PROPER = re.compile(r"(?<=[a-z,;:] )[A-Z][a-z]{2,}")
_WORD = re.compile(r"[\w'-]+")
MAX_WORDS = 24
SHORT_WORDS = 12
LENGTH_COST = 0.1  # score per word beyond SHORT_WORDS
THRESHOLD = 2.0
# A sentence no pattern recognizes can still hold a fact: "the pharmacy ran out of metformin
# again", "i swapped my civic for a used tacoma". It is kept as a *minor* fact when it names
# something specific (a word outside everyday chat vocabulary, see ``specific_words``) or
# speaks about the speaker with at least ``MINOR_WORDS`` content words, and its words are
# rare enough to tell something (``information``): everyday chat says many such sentences,
# and the summary's room is small. Its score grows with what it tells, so value per token
# prefers the dense ones. Minor facts score below ``THRESHOLD``, so below every recognized
# one, and a summary gives them only part of its room (see ``ExtractiveSummarizer``).
MINOR_WEIGHT = 0.5
MINOR_INFO = 0.5  # score per word's worth of ``information``
MINOR_CAP = 1.9  # below THRESHOLD: a minor fact never outranks a recognized one
# A minor fact must tell at least this much (a number, date or name counts 0.5): "i wonder
# when he went to bed" (0) is chat; "took up pottery over the winter" (1.0) and "left the
# bakery, working nights at the clinic now" (1.4) are not.
MIN_INFORMATION = 0.5
RARE_FROM = 0.45  # rarity above which a word tells something ("summer" 0.31, "therapy" 0.65)
MINOR_WORDS = 2
# Words that say nothing about the speaker, beyond the search's stopwords (English:
# ``chatctx/data/words/en.toml``): fillers, vague
# verbs and adjectives of chat, words typed without their apostrophe.
_VAGUE = word_list("facts", "vague")
# Words that say nothing: function words, fillers, vague chat words.
EMPTY_WORDS = STOPWORDS | _VAGUE


def _load_vocabulary() -> tuple[int, dict[str, int]]:
    """Everyday chat vocabulary: each word used in at least 5 of 6,890 short chats of a
    public chat corpus, with the number of chats it is in (bench/facts/build_common_words.py
    says how the list was made)."""
    text = files("chatctx").joinpath("data/common_words.txt").read_text(encoding="utf-8")
    head, _, body = text.partition("\n")
    pairs = (line.split() for line in body.splitlines() if line.strip())
    return int(head.split()[-1]), {word: int(count) for word, count in pairs}


_CHATS, _USED_IN = _load_vocabulary()
# A word's rarity, for every listed word; one outside the list has rarity 1.
_RARITY = {
    word: max(0.0, math.log(_CHATS / (used + 1)) / math.log(_CHATS))
    for word, used in _USED_IN.items()
}
_ALPHA = re.compile(r"[^\W\d_]+")


@dataclass(frozen=True, slots=True)
class Statement:
    """A first-person statement worth keeping: the clause as said and how much it matters."""

    text: str
    score: float
    kinds: tuple[str, ...]


def _spans(text: str) -> list[tuple[int, int, bool]]:
    """(start, end, is an identifier) of the identifiers and values in ``text``, in order; of
    overlapping ones the longest. A value of five digits or more (a phone number, a date
    with its year, 38,000원) is an identifier too; a smaller one ("3박", "11시") is a value."""
    found = sorted(
        (
            (m.start(), m.end(), pattern is _IDENTIFIER)
            for pattern in (_IDENTIFIER, _VALUE)
            for m in pattern.finditer(text)
        ),
        key=lambda span: (span[0], -span[1]),
    )
    spans: list[tuple[int, int, bool]] = []
    for start, end, named in found:
        if not spans or start >= spans[-1][1]:
            digits = sum(c.isdigit() for c in text[start:end])
            if not named and digits >= 5 and text[start : end - 1].isdigit():
                end -= 1  # a long number's next letter is the sentence ("15908632217了")
            spans.append((start, end, named or digits >= 5))
    return spans


def identifiers(text: str) -> list[str]:
    """Identifiers in ``text`` in order of appearance (duplicates kept), then introduced
    names and, in other languages than English, quoted and capitalized ones."""
    found = [text[a:b] for a, b, named in _spans(text) if named]
    names: list[str] = []
    if not reads_as_english(text):  # English chat quotes words in passing ("so 'busy' lol")
        names += [next(g for g in m.groups() if g) for m in _QUOTED.finditer(text)]
        names += [m.group() for m in _CAPITALIZED.finditer(text)]
    return found + _INTRODUCED.findall(text) + names


def values(text: str) -> list[str]:
    """The small values of ``text`` that are not identifiers: a time, a date without its
    year, a count with its unit ("14:30", "3/14", "3박", "11시"). They make a sentence worth
    keeping, not a fact on their own."""
    return [text[a:b] for a, b, named in _spans(text) if not named]


def value_shape(value: str) -> str:
    """What values of one kind share: the value with each run of digits as one ``0``
    ("7일" and "22일": "0일"; "8:30" and "7:45": "0:0"; "3月" and "11月": "0月")."""
    return _DIGITS.sub("0", value.casefold())


def _near(text: str, start: int, end: int) -> tuple[list[str], list[str]]:
    """The search terms right before and right after ``text[start:end]`` in its clause,
    nearest first: up to ``NEAR_TERMS`` on each side, within ``NEAR_CHARS`` characters where
    the script has no spaces between words; numbers left out (a neighbouring value's)."""
    left = _CLAUSE_MARK.split(text[max(0, start - NEAR_SPAN) : start])[-1]
    right = _CLAUSE_MARK.split(text[end : end + NEAR_SPAN])[0]
    if unspaced(left):
        left = left[-NEAR_CHARS:]
    if unspaced(right):
        right = right[:NEAR_CHARS]
    return _terms(reversed(left.split()), backwards=True), _terms(right.split())


def _terms(words: Iterable[str], *, backwards: bool = False) -> list[str]:
    """The first ``NEAR_TERMS`` search terms of ``words`` in their order (each word's terms
    last first where ``backwards``), numbers left out."""
    out: list[str] = []
    for word in words:
        terms = query_terms(word)
        for term in reversed(terms) if backwards else terms:
            if not term.isdigit() and term not in out:
                out.append(term)
        if len(out) >= NEAR_TERMS:
            break
    return out[:NEAR_TERMS]


@functools.lru_cache(maxsize=4096)
def _valued(text: str) -> tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...]:
    """(value, shape, terms right before it and after it, nearest first) of each small value
    in ``text`` (cached: recall asks again of the same messages at every turn)."""
    out = []
    for a, b, named in _spans(text):
        if not named:
            before, after = _near(text, a, b)
            out.append((text[a:b], value_shape(text[a:b]), tuple(before), tuple(after)))
    return tuple(out)


def value_keys(text: str) -> set[tuple[str, str]]:
    """(shape, nearest word before it) of each small value in ``text``: another message
    gives one of them anew (``replaced``) only if it holds a value with the same key."""
    return {(shape, before[0]) for _, shape, before, _ in _valued(text) if before}


def replaced(earlier: str, later: str) -> list[tuple[str, str]]:
    """(old, new) for each small value (``values``) of ``earlier`` that ``later`` gives
    anew: a different value of the same shape (``value_shape``) whose nearest word before
    it is the same ("매달 7일" then "매달 22일"; "下午5点" then "下午4点"); each new value
    replaces the old one it shares most nearby words with. Found from how values are
    written and the words next to them, in any language; a value said again as it was
    replaces nothing. Identifiers are left out: a second order number or e-mail address is
    as often another one as a new one. It is a guess: two values of one kind named by the
    same word ("a las 9:00", "a las 18:00" for opening and closing) read as a change too, so
    callers use it to keep and order text, never to tell the model a value is void."""
    old = _valued(earlier)
    if not old:
        return []
    new = _valued(later)
    kept = {value for value, _, _, _ in new}
    # The old values that can be replaced, by (shape, nearest word before), each written
    # once: a text full of values is looked up, not scanned once per new value.
    by_key: dict[tuple[str, str], dict[tuple[str, frozenset[str], frozenset[str]], None]] = {}
    for value, shape, before, after in old:
        if before and value not in kept:
            entry = (value, frozenset(before), frozenset(after))
            by_key.setdefault((shape, before[0]), {})[entry] = None
    pairs: list[tuple[str, str]] = []
    taken: set[str] = set()
    for other, shape, before, after in new:
        if not before:
            continue
        near, next_to = set(before), set(after)
        shared, best = max(
            (
                (len(near & old_before) + len(next_to & old_after), value)
                for value, old_before, old_after in by_key.get((shape, before[0]), ())
                if value not in taken
            ),
            default=(0, ""),
        )
        if shared:
            taken.add(best)
            pairs.append((best, other))
    return pairs


def fact_set(summary: str) -> set[str]:
    """The facts a summary already holds, parsed: items of its ``Facts:`` lines plus every
    identifier written anywhere in it. Compared exactly, so ``NH-4821`` is not "already
    there" because ``NH-48213`` is."""
    found: set[str] = set()
    for line in summary.splitlines():
        if line.startswith(FACTS_PREFIX):
            found.update(f.strip() for f in line[len(FACTS_PREFIX) :].split("; ") if f.strip())
    found.update(identifiers(summary))
    return found


def line_key(text: str) -> str:
    """What two statements must share to be the same: their words, case-folded."""
    return " ".join(_WORD.findall(text.casefold()))


def specific_words(said: str) -> int:
    """How many different words of ``said`` are specific: outside everyday chat vocabulary
    (``chatctx/data/common_words.txt``) and not fillers, e.g. "propranolol", "Poughkeepsie",
    "bouldering", but not "class", "pizza" or "tired"."""
    words = {word.casefold() for word in _ALPHA.findall(said)}
    return sum(1 for w in words if len(w) > 2 and w not in EMPTY_WORDS and w not in _RARITY)


def reads_as_english(said: str) -> bool:
    """Whether most words of ``said`` are everyday English chat words (``_RARITY``'s, or
    function words): what the statement patterns and ``rarity`` can read. In another language
    every word is unknown, so would look rare and tell much; there a sentence is kept for the
    values it holds (``identifiers``) and found by meaning (recall), not by these."""
    words = [w.casefold() for w in _ALPHA.findall(said)]
    known = sum(1 for w in words if w in _RARITY or w in EMPTY_WORDS)
    return known * 2 >= len(words)


def rarity(word: str) -> float:
    """How rare a case-folded word is in everyday chat, from 0 (in every chat) to 1 (in none
    of the counted ones): the share of the chats' log-count it takes to find it,
    ``log(N / (chats with it + 1)) / log(N)``. "went" 0.27, "summer" 0.31, "therapy" 0.65,
    "propranolol" 1."""
    return _RARITY.get(word, 1.0)


def information(low: str) -> float:
    """What a case-folded sentence tells, in words' worth: each different content word
    counts for how much rarer it is than everyday chat (``rarity`` above ``RARE_FROM``,
    scaled to 0..1). "i wonder when he went to bed" 0, "took up pottery over the
    winter, hooked now" 1.4."""
    words = {w for w in _ALPHA.findall(low) if len(w) > 2 and w not in EMPTY_WORDS}
    return sum(max(0.0, rarity(w) - RARE_FROM) / (1.0 - RARE_FROM) for w in words)


def _content_words(low: str) -> int:
    """How many different words of ``low`` say something: not function words, fillers or
    numbers."""
    return len({w for w in _ALPHA.findall(low) if len(w) > 2 and w not in EMPTY_WORDS})


def _tidy(sentence: str) -> str:
    text = _TRAIL.sub("", _LEAD.sub("", sentence))
    return text.strip(" ,;:-")


def statement(sentence: str) -> Statement | None:
    """``sentence`` as a statement worth keeping, or None (questions, chit-chat, no first
    person, nothing durable). Long sentences should come through :func:`sentences` first."""
    said = " ".join(sentence.translate(_APOSTROPHES).split()[:MAX_WORDS])
    if not reads_as_english(said):
        return None  # the patterns and word counts below are English's
    text = _tidy(said)
    low = text.lower()  # the patterns are lower case: matching without IGNORECASE is 2x faster
    words = low.split()
    if len(text) < 6 or _QUESTION.search(low) or len(set(words)) * 2 < len(words):
        return None  # a question, too short, or the same words over and over
    said_low = said.lower()
    # Chat drops the subject ("just bought a prius", "born and raised in X"): it is "I".
    probe = f"i {low} / {said_low}" if _DROPPED_SUBJECT.match(low) else said_low
    # Without a first-person speaker only the kinds that are about the speaker anyway count;
    # checking that first skips most patterns on most chat lines.
    speaker = _ANCHOR.search(probe) is not None or _IMPLIED_SPEAKER.search(probe) is not None
    cues = _CUES if speaker else _SELF_EVIDENT_CUES
    kinds = [(weight, kind) for kind, weight, pattern in cues if pattern.search(probe)]
    specific = specific_words(said)
    score = 0.0
    detail = 1.5 if _DATE.search(said_low) else 1.0 if _NUMBER.search(said_low) else 0.0
    proper = 0.5 if _PROPER.search(said) else 0.0
    if kinds:
        kinds.sort(key=lambda k: -k[0])
        score = kinds[0][0] + min(1.0, 0.5 * (len(kinds) - 1)) + detail + proper
        # What is specific is what a later question needs; a pattern match with nothing
        # specific, no number, date or name ("i like learning") is worth less.
        score += 0.5 * min(2, specific) if specific else (0.0 if detail or proper else -0.5)
        if score < THRESHOLD:
            kinds = []  # kept as a minor fact below
    recognized = score > 0
    if not kinds:
        # Chat drops the "I": a line about nobody else ("new job at the bakery, starts
        # monday") is the speaker's own.
        about_speaker = speaker or _SOMEONE_ELSE.search(low) is None
        content = about_speaker and _content_words(low) >= MINOR_WORDS
        if not (specific or content or recognized or proper):  # a name is specific too
            return None
        told = information(low) + (0.5 if detail or proper else 0.0)
        if told < MIN_INFORMATION and not recognized:
            return None
        score = min(MINOR_CAP, MINOR_WEIGHT + MINOR_INFO * told + (0.25 if speaker else 0.0))
        kinds = [(score, "minor")]
    if len(text.split()) > SHORT_WORDS:  # keep the clause that says it, not the whole ramble
        for piece in _CLAUSE_BREAK.split(text):
            if len(piece.split()) >= 2 and any(p.search(piece.lower()) for _, _, p in _CUES):
                text = piece.strip(" ,;:-")
                break
    if len(text.split()) < 2:
        return None
    # A summary holds few tokens: at equal worth, the shorter statement is the better buy.
    score = max(0.5, score - LENGTH_COST * max(0, len(text.split()) - SHORT_WORDS))
    return Statement(text=text, score=score, kinds=tuple(k[1] for k in kinds))


def _pieces(sentence: str) -> list[str]:
    """A run-on chat line cut into clauses where the speaker starts a new one ("... now we
    just moved to ..."), pieces of at most ``MAX_WORDS`` words."""
    words = sentence.split()
    if len(words) <= MAX_WORDS:
        return [sentence]
    out: list[list[str]] = [[]]
    for word in words:
        new_clause = _CLAUSE_START.match(word) is not None and len(out[-1]) >= 4
        if new_clause or len(out[-1]) >= MAX_WORDS:
            out.append([])
        out[-1].append(word)
    return [" ".join(piece) for piece in out if piece]


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence or chat line of ``text`` as ``sentences`` splits it
    (abbreviations such as "Dr." end none), with the whitespace that follows it."""
    spans, start = [], 0
    for m in _SENTENCE.finditer(text):
        if m.end() > start:
            spans.append((start, m.end()))
            start = m.end()
    if start < len(text):
        spans.append((start, len(text)))
    return spans


def sentences(text: str) -> list[str]:
    """Sentences and chat lines of ``text``, whitespace collapsed, run-ons cut in clauses."""
    out: list[str] = []
    for part in _SENTENCE.split(text.translate(_APOSTROPHES)):
        part = " ".join(part.split())
        if part:
            out += _pieces(part)
    return out


def statements(text: str) -> list[Statement]:
    """The first-person statements of one user message worth keeping, in order.

    A sentence that leans on the one before ("Rosa says hi. she's my aunt") is judged
    together with it, and so is a short question answered right after ("my job? welder.").
    """
    out: list[Statement] = []
    parts = sentences(text)
    for i, sentence in enumerate(parts):
        if (
            i > 0
            and _LEANS_BACK.match(sentence)
            and len(f"{parts[i - 1]} {sentence}".split()) <= MAX_WORDS
        ):
            sentence = f"{parts[i - 1]} {sentence}"
        elif _ASKS_ITSELF.match(sentence) and i + 1 < len(parts):
            continue  # judged with its answer, next
        if i > 0 and _ASKS_ITSELF.match(parts[i - 1]):
            sentence = f"{parts[i - 1]} {sentence}"
        found = statement(sentence.replace("? ", ": ", 1) if "? " in sentence else sentence)
        if found is not None and not (out and out[-1].text.endswith(found.text)):
            out.append(found)
    return out


def statement_score(text: str) -> float:
    """The score a kept line's text gets again when the summary is compacted (0 if none)."""
    found = statement(text)
    return found.score if found is not None else 0.0
