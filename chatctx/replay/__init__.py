"""Replaying logged conversations and tuning budgets and policies."""

from chatctx.backends.dry import DryBackend
from chatctx.replay._input import LoggedConversation, Probe, parse_logged, read_logs
from chatctx.replay._run import (
    ConversationReport,
    Replayer,
    TurnReport,
    replay_all,
    summarize,
    turn_rows,
)
from chatctx.settings import REPLAY_CONTEXT, ReplayConfig

__all__ = [
    "REPLAY_CONTEXT",
    "ConversationReport",
    "DryBackend",
    "LoggedConversation",
    "Probe",
    "ReplayConfig",
    "Replayer",
    "TurnReport",
    "parse_logged",
    "read_logs",
    "replay_all",
    "summarize",
    "turn_rows",
]
