"""Context building: exact budgets, whole-turn eviction, running summaries, plans."""

from chatctx.backends.base import Codec
from chatctx.context._abridge import Cut
from chatctx.context._background import BackgroundSummarizer
from chatctx.context._builder import (
    BuildResult,
    ContextBuilder,
    ContextPlan,
    ContextState,
    TokenCache,
)
from chatctx.context._layout import SUMMARY_HEADER, SUMMARY_MORE
from chatctx.context._meaning import MeaningSearch
from chatctx.context._recall import RECALL_HEADER, RecallSearch
from chatctx.context._turns import group_turns, id_ranges
from chatctx.context.summarizers import (
    ExtractiveSummarizer,
    LLMSummarizer,
    Summarizer,
    SummaryError,
    summarizer_for,
    summary_limit,
)

__all__ = [
    "RECALL_HEADER",
    "SUMMARY_HEADER",
    "SUMMARY_MORE",
    "BackgroundSummarizer",
    "BuildResult",
    "Codec",
    "ContextBuilder",
    "ContextPlan",
    "ContextState",
    "Cut",
    "ExtractiveSummarizer",
    "LLMSummarizer",
    "MeaningSearch",
    "RecallSearch",
    "Summarizer",
    "SummaryError",
    "TokenCache",
    "group_turns",
    "id_ranges",
    "summarizer_for",
    "summary_limit",
]
