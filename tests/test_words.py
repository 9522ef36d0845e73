"""A language's words and patterns come from its data file (chatctx/model/words.py)."""

from __future__ import annotations

import re
import tomllib

import pytest

from chatctx.model import words


def test_patterns_join_their_lines_and_expand_fragments(monkeypatch: pytest.MonkeyPatch) -> None:
    data = tomllib.loads(
        """
[facts.fragments]
pet = '(?:cat|dog)'
[facts.cues]
pet = '''
\\b(?:my|our) {pet}|
  \\ba {pet} named
'''
short = '\\bvegan\\b'
"""
    )
    monkeypatch.setattr(words, "_lists", lambda language: data)
    found = words.patterns("facts.cues", "xx")
    # Written by hand: the lines stripped and joined with nothing, the fragment in place.
    assert found == {
        "pet": r"\b(?:my|our) (?:cat|dog)|\ba (?:cat|dog) named",
        "short": r"\bvegan\b",
    }
    assert list(found) == ["pet", "short"]  # the file's order
    assert re.search(found["pet"], "we got a dog named rex")


def test_the_english_statement_rules_are_read_from_the_data_file() -> None:
    """Every kind of statement the extractive summary weighs has its English pattern in
    chatctx/data/words/en.toml, and a sentence of each kind written by hand is recognized
    by it."""
    cues = {kind: re.compile(p) for kind, p in words.patterns("facts.cues").items()}
    said = {
        "health": "i'm allergic to penicillin",
        "pet": "my two cats hate the vet",
        "work": "i work as a welder",
        "home": "we live in a condo near the river",
    }
    for kind, sentence in said.items():
        assert cues[kind].search(sentence), kind
    assert not cues["health"].search("i work as a welder")
