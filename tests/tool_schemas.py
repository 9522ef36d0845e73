"""Function tools the agent tests offer: schemas that bound what a random-weight model can
write under a grammar (a string of at most 8 characters, a small enum)."""

from __future__ import annotations

from typing import Any

LOOKUP: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup_order",
        "description": "Find a customer's order",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string", "maxLength": 8}},
            "required": ["order_id"],
        },
    },
}
TICKET: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "open_ticket",
        "parameters": {
            "type": "object",
            "properties": {"priority": {"enum": [1, 2, 3]}},
            "required": ["priority"],
        },
    },
}
