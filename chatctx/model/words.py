"""Word lists and patterns of a language, one data file each:
``chatctx/data/words/<language>.toml``.

The rules that read words of a language (what asks back, what says nothing, the word index's
stopwords, the statements the extractive summary keeps) take them from here, not from the
code. Only English has a file: its rules are a boost for English text, and text in other
languages is read by mechanisms that need no word list (values and identifiers, question marks
in any script, meaning, the word index's character pairs).
"""

from __future__ import annotations

import functools
import re
import tomllib
from importlib.resources import files
from typing import Any

_FRAGMENT = re.compile(r"\{([a-z_]+)\}")


@functools.cache
def _lists(language: str) -> dict[str, Any]:
    path = files("chatctx").joinpath(f"data/words/{language}.toml")
    return tomllib.loads(path.read_text(encoding="utf-8"))


def words(section: str, name: str, language: str = "en") -> frozenset[str]:
    """The words of list ``name`` in ``section`` of ``language``'s file (a dotted section
    names a table inside one: ``"facts.sentences"``)."""
    return frozenset(_table(language, section)[name].split())


def patterns(section: str, language: str = "en") -> dict[str, str]:
    """The regular expressions of table ``section`` (dotted: ``"facts.cues"``) in
    ``language``'s file, by name, in the file's order: each written over lines, stripped and
    joined with nothing, with ``{name}`` standing for the fragment ``name`` of the section
    above it (``"facts.fragments"``)."""
    parent = section.rpartition(".")[0]
    fragments = {
        name: _joined(text) for name, text in _table(language, parent).get("fragments", {}).items()
    }

    def expand(text: str) -> str:
        return _FRAGMENT.sub(lambda m: fragments[m[1]], _joined(text))

    return {name: expand(text) for name, text in _table(language, section).items()}


def _table(language: str, section: str) -> dict[str, Any]:
    table = _lists(language)
    for key in section.split(".") if section else ():
        table = table[key]
    return table


def _joined(text: str) -> str:
    return "".join(line.strip() for line in text.splitlines())
