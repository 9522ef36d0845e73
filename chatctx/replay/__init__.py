"""Replaying logged conversations and tuning budgets and policies."""

from chatctx.backends.dry import DryBackend
from chatctx.replay._input import LoggedConversation, Probe, parse_logged, read_logs
from chatctx.replay._run import (
    ConversationReport,
    ReplayConfig,
    Replayer,
    TurnReport,
    replay_all,
    summarize,
    turn_rows,
)

__all__ = [
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
