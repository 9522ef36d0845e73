"""``ChatSession``: one conversation, its context, its turns and its backend.

::

    ChatSession   a conversation stored in a Store and answered by a Backend
    Reply         what one turn returned (text, usage, the turn record, tool calls)
    Ask           what a turn sends: a user message or tool results, with the tools offered
    ask_for       an Ask from a caller's arguments (checked)
    open_turn     the newest turn, when its calls wait for results (from Store.last_turn)
    check_results every waiting call answered once, or a ConfigError naming the field
"""

from __future__ import annotations

from chatctx.session._session import ChatSession
from chatctx.session._tools import Ask, OpenTurn, ask_for, check_results, open_turn
from chatctx.session._turn import Reply

__all__ = ["Ask", "ChatSession", "OpenTurn", "Reply", "ask_for", "check_results", "open_turn"]
