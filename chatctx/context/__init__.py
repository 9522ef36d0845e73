"""Context building: exact budgets, whole-turn eviction, running summaries, plans."""

from chatctx.context._builder import (
    SUMMARY_HEADER,
    BuildResult,
    Codec,
    ContextBuilder,
    ContextPlan,
    ContextState,
    TokenCache,
)
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
    "SUMMARY_HEADER",
    "BuildResult",
    "Codec",
    "ContextBuilder",
    "ContextPlan",
    "ContextState",
    "ExtractiveSummarizer",
    "LLMSummarizer",
    "Summarizer",
    "SummaryError",
    "TokenCache",
    "group_turns",
    "id_ranges",
    "summarizer_for",
    "summary_limit",
]
