"""A ``CallGrammar`` as a llama.cpp GBNF grammar (llama-cpp-python's JSON-schema converter)."""

from __future__ import annotations

import json
import re

from chatctx.errors import ConfigError
from chatctx.model.tools import CallGrammar

__all__ = ["gbnf"]

_ROOT = re.compile(r"^root ::=", re.MULTILINE)
_SPACE = re.compile(r"^space ::= .*$", re.MULTILINE)
# The converter's separators, as literals between rule elements (never inside a string's).
_SEPARATOR = re.compile(r'(?<=[\s(])"([,:])"(?=[\s)])')
_CALL_RULE = "chatctx-call"  # the converter names rules after properties: no clash with it


def gbnf(grammar: CallGrammar) -> str:
    """The GBNF (root rule ``root``) of a reply ``grammar`` allows."""
    # Imported here: the converter is pure Python, but importing llama_cpp loads the library.
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        rules: str = json_schema_to_gbnf(json.dumps(grammar.schema))
    except Exception as exc:  # the converter raises plain exceptions for what it cannot do
        raise ConfigError(f"a tool's parameters cannot be made a grammar: {exc}") from exc
    # JSON written as the templates write it back (``json.dumps``: ", " and ": ", no other
    # space): a call the grammar held is then the prompt's text, and the cache holds on.
    rules = _SPACE.sub('space ::= ""', rules, count=1)
    rules = _SEPARATOR.sub(lambda m: f'"{m.group(1)} "', rules)
    if not grammar.open and not grammar.close and not grammar.repeat:
        return rules
    rules = _ROOT.sub(f"{_CALL_RULE} ::=", rules, count=1)
    one = f"{json.dumps(grammar.open)} {_CALL_RULE} {json.dumps(grammar.close)}"
    root = f"({one} [\\n]?)+" if grammar.repeat else one
    return f"root ::= {root}\n{rules}"
