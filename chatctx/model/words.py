"""Word lists of a language, one data file each: ``chatctx/data/words/<language>.toml``.

The rules that read words of a language (what asks back, what says nothing, the word index's
stopwords) take them from here, not from the code. Only English has a file: its rules are a
boost for English text, and text in other languages is read by mechanisms that need no word
list (values and identifiers, question marks in any script, meaning, the word index's
character pairs).
"""

from __future__ import annotations

import functools
import tomllib
from importlib.resources import files


@functools.cache
def _lists(language: str) -> dict[str, dict[str, str]]:
    path = files("chatctx").joinpath(f"data/words/{language}.toml")
    return tomllib.loads(path.read_text(encoding="utf-8"))


def words(section: str, name: str, language: str = "en") -> frozenset[str]:
    """The words of list ``name`` in ``section`` of ``language``'s file."""
    return frozenset(_lists(language)[section][name].split())
