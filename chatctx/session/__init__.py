"""``ChatSession``: one conversation, its context, its turns and its backend.

::

    ChatSession   a conversation stored in a Store and answered by a Backend
    Reply         what one turn returned (text, usage, the turn record)
"""

from __future__ import annotations

from chatctx.session._session import ChatSession
from chatctx.session._turn import Reply

__all__ = ["ChatSession", "Reply"]
