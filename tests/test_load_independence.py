"""A customer's reply does not depend on who else is being served (greedy, split KV cache).

Oracle: the same conversations served one customer at a time on the same engine settings.
12 customers x 6 turns on 4 slots, from 12 threads at once: conversations lose their slots
and come back from a swap, their prompts are evaluated beside other streams, evictions and
summaries happen at the smaller budgets. Before, 3-6 of 72 replies differed at budget 256:
a prompt went in one batch when alone and in 256-token pieces beside running streams, and
llama.cpp's logits depend on how a prompt is cut (bench/README.md, "A reply does not depend
on load"). With the unified cache, where the other conversations' cells lie changes the
attention sums too: see the same section for what that costs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from chatctx import Engine
from chatctx.testing import serve_customers, support_customers

SETTINGS = {"max_tokens": 24, "temperature": 0.0}


@pytest.mark.slow
@pytest.mark.parametrize("budget", [160, 256, 512])
def test_replies_do_not_depend_on_load(smollm2_path: Path, budget: int) -> None:
    customers = support_customers(12, 6)
    context = {"budget": budget}
    with Engine.load(smollm2_path, n_ctx=1024, slots=4, kv_unified=False) as engine:
        alone = serve_customers(
            engine, customers, together=False, settings=SETTINGS, context=context
        )
        together = serve_customers(
            engine, customers, together=True, settings=SETTINGS, context=context
        )
        swaps = engine.slot_table()["counters"]["swap_out"]
    assert len(alone) == 72 and swaps > 0
    differ = sorted(key for key in alone if alone[key] != together[key])
    assert differ == []
