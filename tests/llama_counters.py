"""llama.cpp's own count of evaluated tokens: the oracle for chatctx's accounting."""

from __future__ import annotations

from chatctx import Engine


def counted(engine: Engine) -> int:
    """Tokens llama.cpp itself has evaluated in this context (its perf counters)."""
    n_p_eval, n_eval = engine.context.perf_counts()
    return n_p_eval + n_eval


def prime_counters(engine: Engine, seq_id: int = 0) -> None:
    """Make both of llama.cpp's counters non-zero (each reads as at least 1), so later
    differences are exact; leaves ``seq_id`` empty."""
    engine.clear(seq_id)
    ctx = engine.context
    bos = engine.model.bos
    ctx.decode(seq_id, [bos, bos], 0, want_last_logits=False)
    ctx.perf_counts()  # synchronizes: two tokens count in n_p_eval
    ctx.decode(seq_id, [bos], 2, want_last_logits=False)
    ctx.perf_counts()  # one token counts in n_eval
    engine.clear(seq_id)
    n_p_eval, n_eval = ctx.perf_counts()
    assert n_p_eval >= 2 and n_eval >= 1
