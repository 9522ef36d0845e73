"""Full-text search over stored messages: what recall asks the store for.

SQLite: an FTS5 index (``messages_fts``, porter stemming, BM25 ranking) kept in step with
``messages`` by the triggers migration 0005 installs. PostgreSQL: the generated ``tsvector``
column ``messages.content_tsv`` (the ``english`` configuration: Snowball stemming, as porter)
with a GIN index, from migration 0007; a match is any term, ranked by a BM25-like sum of each
matched term's rarity in the conversation times its ``ts_rank_cd``. Other databases: a
portable ``LIKE`` query scored here by the matched terms.

User text is never passed to ``MATCH`` as is: it is cut into word terms, stopwords go, and each
term is quoted, so FTS syntax or punctuation in a message can never raise.

Text in scripts without word spaces (Chinese, Japanese, Thai ...) or with endings joined to
their words (Korean) is searched by the character pairs of its runs, as substrings, on every
database (the portable query): a word index would hold a whole run as one word.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, NamedTuple

from sqlalchemy import Connection, Float, Row, column, func, or_, select, text
from sqlalchemy.sql.selectable import TextualSelect

from chatctx.model.words import words as word_list
from chatctx.store._models import MessageRow

FTS_TABLE = "messages_fts"
TSV_COLUMN = "content_tsv"  # PostgreSQL (migration 0007)
TSV_INDEX = "ix_messages_content_tsv"
TS_CONFIG = "english"
NO_LIMIT = 2**31 - 1  # positions are 32-bit integers
MAX_TERMS = 32
FALLBACK_ROWS = 5000  # the portable search scores at most this many recent candidates

_WORD = re.compile(r"[^\W_]+")
# Function words and chat filler carry no topic (English: ``chatctx/data/words/en.toml``).
STOPWORDS = word_list("search", "stopwords")


# Scripts written without spaces between words (Han, kana, Thai, Lao, Khmer, Myanmar) or
# whose words take their endings joined on (Hangul: 환불은, 환불이): a word split by spaces is
# no unit to search for there. Their runs are searched as overlapping character pairs, the
# way CJK search engines index them, matched as substrings and weighed by their rarity in the
# conversation (a pair in every message, an ending, weighs nothing): no word list.
_UNSPACED = re.compile(
    "["
    "\u0e00-\u0eff\u1000-\u109f\u1100-\u11ff\u1780-\u17ff\u3040-\u30ff\u3130-\u318f"
    "\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7a3\uf900-\ufaff\uff66-\uff9f"
    "\U00020000-\U0002ffff"
    "]+"
)


def _pairs(run: str) -> list[str]:
    return [run] if len(run) < 3 else [run[i : i + 2] for i in range(len(run) - 1)]


def query_terms(text_: str) -> list[str]:
    """The searchable terms of ``text_``, casefolded: its words, stopwords and 1-letter words
    dropped; in unspaced scripts (``_UNSPACED``) the character pairs of each run instead."""
    terms: dict[str, None] = {}
    for word in _WORD.findall(text_.casefold()):
        runs = _UNSPACED.findall(word)
        if runs:
            rest = _UNSPACED.sub(" ", word).split()
            found = [pair for run in runs for pair in _pairs(run)] + rest
        elif word in STOPWORDS or (len(word) < 2 and not word.isdigit()):
            continue
        else:
            found = [word]
        for term in found:
            terms[term] = None
        if len(terms) >= MAX_TERMS:
            break
    return list(terms)[:MAX_TERMS]


def unspaced(terms: Sequence[str]) -> bool:
    """Whether any term is a run (or pair) of an unspaced script: matched as a substring."""
    return any(_UNSPACED.search(term) for term in terms)


def stem_prefix(term: str) -> str | None:
    """A prefix that also matches other forms of a long word ("allergic" and "allergy")."""
    if len(term) < 7 or not term.isalpha():
        return None
    return term[: max(5, len(term) - 3)]


def fts_query(terms: Sequence[str]) -> str:
    """An FTS5 query matching any term: each one quoted (no operators reach FTS5)."""
    parts: list[str] = []
    for term in terms:
        parts.append(f'"{term}"')
        prefix = stem_prefix(term)
        if prefix is not None:
            parts.append(f'"{prefix}"*')
    return " OR ".join(parts)


def has_fts(connection: Connection) -> bool:
    """Whether this database has the FTS5 index (SQLite at revision 0005 or later)."""
    if connection.dialect.name != "sqlite":
        return False
    found = connection.execute(
        text("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = :name"),
        {"name": FTS_TABLE},
    ).first()
    return found is not None


def has_tsvector(connection: Connection) -> bool:
    """Whether this database has the ``tsvector`` column (PostgreSQL at 0007 or later)."""
    if connection.dialect.name != "postgresql":
        return False
    found = connection.execute(
        text(
            "SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema() "
            "AND table_name = 'messages' AND column_name = :name"
        ),
        {"name": TSV_COLUMN},
    ).first()
    return found is not None


def ts_term(term: str) -> str:
    """A ``to_tsquery`` text for one term (and its prefix form): only word characters reach
    it (``query_terms``), so it holds no tsquery operators but these."""
    prefix = stem_prefix(term)
    return term if prefix is None else f"{term} | {prefix}:*"


class Match(NamedTuple):
    """A matched message row, its score (higher is better), and the reply row after it."""

    row: Any  # a message row: its columns as attributes
    score: float
    reply: Any | None


def _message_columns(replies: bool) -> tuple[str, list[Any], str]:
    """The message columns to select (``m.``), their typed columns, and, with ``replies``,
    the reply that follows each user message (``r.``, as ``reply_<name>``) and its join."""
    names = [c.name for c in MessageRow.__table__.c]
    typed = [column(c.name, c.type) for c in MessageRow.__table__.c]
    select_ = ", ".join(f"m.{n}" for n in names)
    join = ""
    if replies:
        select_ += ", " + ", ".join(f"r.{n} AS reply_{n}" for n in names)
        typed += [column(f"reply_{c.name}", c.type) for c in MessageRow.__table__.c]
        join = (
            " LEFT JOIN messages AS r ON m.role = 'user' "
            "AND r.conversation_id = m.conversation_id AND r.position = m.position + 1 "
            "AND r.role = 'assistant' AND r.position < :before"
        )
    return select_, typed, join


def _statement(replies: bool) -> TextualSelect:
    # Built once: composing the query with SQLAlchemy's expression API each turn cost more
    # than running it. Typed columns keep the result processing (UTC datetimes, JSON).
    select_, typed, join = _message_columns(replies)
    select_ += ", -bm25(messages_fts) AS score"  # last, as in ``typed``
    sql = (
        f"SELECT {select_} FROM messages_fts JOIN messages AS m ON m.id = messages_fts.rowid"
        f"{join} WHERE messages_fts MATCH :query AND m.conversation_id = :cid "
        "AND m.position < :before "
        # Ties go to the later message: what was said last is more likely still true.
        "ORDER BY score DESC, m.position DESC LIMIT :limit"
    )
    return text(sql).columns(*typed, column("score", Float()))


_STATEMENTS = {replies: _statement(replies) for replies in (False, True)}


def search(
    connection: Connection,
    conversation_id: str,
    query: str,
    *,
    before_position: int | None,
    exclude_ids: Sequence[int],
    limit: int,
    replies: bool,
) -> list[Match]:
    """The best matches, best first; with ``replies``, each user message's reply too.

    A reply is the assistant message right after a matched user message, when it is before
    ``before_position`` and not excluded.
    """
    terms = query_terms(query)
    if not terms or limit <= 0:
        return []
    excluded = set(exclude_ids)
    before = before_position if before_position is not None else NO_LIMIT
    if unspaced(terms):
        # Substrings: a word index holds whole space-separated words, no pairs.
        found = _portable(connection, conversation_id, terms, before, replies)
    elif has_fts(connection):
        found = _fts(connection, conversation_id, terms, before, limit + len(excluded), replies)
    elif has_tsvector(connection):
        found = _tsv(connection, conversation_id, terms, before, limit + len(excluded), replies)
    else:
        found = _portable(connection, conversation_id, terms, before, replies)
    out: list[Match] = []
    for match in found:
        if match.row.id in excluded:
            continue
        if match.reply is not None and match.reply.id in excluded:
            match = match._replace(reply=None)
        out.append(match)
    return out[:limit]


def _fts(
    connection: Connection,
    conversation_id: str,
    terms: Sequence[str],
    before: int,
    limit: int,
    replies: bool,
) -> list[Match]:
    # One statement: the matches and, joined, the replies after them.
    rows = connection.execute(
        _STATEMENTS[replies],
        {"query": fts_query(terms), "cid": conversation_id, "before": before, "limit": limit},
    )
    names = [c.name for c in MessageRow.__table__.c]
    out: list[Match] = []
    for row in rows:
        reply = None
        if replies and row.reply_id is not None:
            # The reply's columns under their own names, as a message row has them.
            reply = SimpleNamespace(**{n: getattr(row, f"reply_{n}") for n in names})
        out.append(Match(row, float(row.score), reply))
    return out


def _tsv_statement(n_terms: int, replies: bool) -> TextualSelect:
    # Per term: its tsquery, how many of the searched messages match it (df), and its BM25
    # rarity ln(1 + (n - df + 0.5) / (df + 0.5)); a message scores the sum, over the terms it
    # matches, of rarity times ts_rank_cd (occurrences, normalized by the message's length).
    select_, typed, join = _message_columns(replies)
    terms = range(n_terms)
    queries = ", ".join(f"to_tsquery('{TS_CONFIG}', :t{i}) AS q{i}" for i in terms)
    counts = ", ".join(f"count(*) FILTER (WHERE s.{TSV_COLUMN} @@ q.q{i}) AS d{i}" for i in terms)
    score = " + ".join(
        f"ln(1 + (st.n - st.d{i} + 0.5)::float8 / (st.d{i} + 0.5)) "
        f"* ts_rank_cd(m.{TSV_COLUMN}, q.q{i}, 1)"
        for i in terms
    )
    any_term = " || ".join(f"q.q{i}" for i in terms)
    sql = (
        f"WITH q AS (SELECT {queries}), "
        f"st AS (SELECT count(*) AS n, {counts} FROM messages AS s, q "
        "WHERE s.conversation_id = :cid AND s.position < :before) "
        f"SELECT {select_}, ({score}) AS score FROM q, st, messages AS m{join} "
        f"WHERE m.conversation_id = :cid AND m.position < :before "
        f"AND m.{TSV_COLUMN} @@ ({any_term}) "
        "ORDER BY score DESC, m.position DESC LIMIT :limit"
    )
    return text(sql).columns(*typed, column("score", Float()))


_TSV_STATEMENTS: dict[tuple[int, bool], TextualSelect] = {}


def _tsv(
    connection: Connection,
    conversation_id: str,
    terms: Sequence[str],
    before: int,
    limit: int,
    replies: bool,
) -> list[Match]:
    key = (len(terms), replies)
    statement = _TSV_STATEMENTS.get(key)
    if statement is None:
        statement = _TSV_STATEMENTS[key] = _tsv_statement(*key)
    params: dict[str, Any] = {f"t{i}": ts_term(term) for i, term in enumerate(terms)}
    params.update(cid=conversation_id, before=before, limit=limit)
    rows = connection.execute(statement, params)
    names = [c.name for c in MessageRow.__table__.c]
    out: list[Match] = []
    for row in rows:
        reply = None
        if replies and row.reply_id is not None:
            reply = SimpleNamespace(**{n: getattr(row, f"reply_{n}") for n in names})
        out.append(Match(row, float(row.score), reply))
    return out


def _portable(
    connection: Connection,
    conversation_id: str,
    terms: Sequence[str],
    before: int,
    replies: bool,
) -> list[Match]:
    # Any SQL database (and unspaced scripts on all): candidates by LIKE, scored by the
    # matched terms weighted by their rarity among the conversation's messages (BM25's IDF),
    # so one rare shared term beats two common ones and a term in most messages weighs
    # next to nothing.
    table_ = MessageRow.__table__
    content = table_.c.content
    searched = (table_.c.conversation_id == conversation_id, table_.c.position < before)
    query = (
        select(table_)
        .where(*searched, or_(*[content.icontains(term, autoescape=True) for term in terms]))
        .order_by(table_.c.position.desc())
        .limit(FALLBACK_ROWS)
    )
    rows = list(connection.execute(query))
    found = [{t for t in terms if t in str(row.content).casefold()} for row in rows]
    df = {t: sum(t in f for f in found) for t in terms}
    n = connection.execute(select(func.count()).where(*searched)).scalar() or len(rows)
    scored = [
        (row, sum(math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5)) for t in matched))
        for row, matched in zip(rows, found, strict=True)
        if matched
    ]
    scored.sort(key=lambda item: (-item[1], -item[0].position))
    after: dict[int, Row[Any]] = {}
    wanted = [row.position + 1 for row, _ in scored if row.role == "user"]
    if replies and wanted:
        after = {
            r.position: r
            for r in connection.execute(
                select(table_).where(
                    table_.c.conversation_id == conversation_id,
                    table_.c.position.in_(wanted),
                    table_.c.position < before,
                    table_.c.role == "assistant",
                )
            )
        }
    return [
        Match(row, score, after.get(row.position + 1) if row.role == "user" else None)
        for row, score in scored
    ]


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    """Alembic ``include_name`` filter: the FTS table and its shadow tables (migration 0005)
    and PostgreSQL's ``tsvector`` column and its index (0007) are not in the ORM, so
    autogenerate must not propose dropping them."""
    if name is None:
        return True
    if type_ == "table" and name.startswith(FTS_TABLE):
        return False
    return not (
        (type_ == "column" and name == TSV_COLUMN) or (type_ == "index" and name == TSV_INDEX)
    )
