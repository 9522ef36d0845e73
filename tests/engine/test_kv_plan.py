"""plan_reuse: the pure planning of in-place KV reuse."""

from hypothesis import given, settings
from hypothesis import strategies as st

from chatctx.engine import plan_reuse

HEAD = list(range(1000, 1020))  # system prompt
A = list(range(2000, 2040))  # an evicted turn
B = list(range(3000, 3050))  # a kept turn
OLD_TAIL = [7, 8, 9]
NEW = list(range(4000, 4012))


def test_extension_reuses_the_common_prefix() -> None:
    plan = plan_reuse(HEAD + B, HEAD + B + NEW)
    assert plan.chunk is None and plan.prefix == len(HEAD + B)


def test_same_prompt_evaluates_only_the_last_token() -> None:
    plan = plan_reuse(HEAD + B, HEAD + B)
    assert plan.prefix == len(HEAD + B) - 1 and plan.chunk is None


def test_evicted_turn_is_removed_and_kept_turn_shifted() -> None:
    plan = plan_reuse(HEAD + A + B + OLD_TAIL, HEAD + B + NEW)
    assert plan.prefix == len(HEAD)
    assert plan.chunk == (len(HEAD + A), len(HEAD + A + B))
    assert plan.dest == len(HEAD) and plan.delta == -len(A)
    assert plan.inserted == 0 and plan.resume == len(HEAD + B)


def test_inserted_summary_needs_history_start() -> None:
    summary = list(range(5000, 5030))
    cached = HEAD + A + B + OLD_TAIL
    prompt = HEAD + summary + B + NEW
    assert plan_reuse(cached, prompt).chunk is None
    plan = plan_reuse(cached, prompt, history_start=len(HEAD + summary))
    assert plan.chunk == (len(HEAD + A), len(HEAD + A + B))
    assert plan.inserted == len(summary) and plan.delta == len(summary) - len(A)


def test_short_runs_are_not_worth_a_shift() -> None:
    short = list(range(3000, 3010))
    assert plan_reuse(HEAD + A + short, HEAD + short + NEW).chunk is None


@settings(max_examples=300, deadline=None)
@given(
    cached=st.lists(st.integers(0, 6), max_size=60),
    prompt=st.lists(st.integers(0, 6), min_size=1, max_size=60),
    history_start=st.none() | st.integers(0, 60),
)
def test_plans_are_consistent(
    cached: list[int], prompt: list[int], history_start: int | None
) -> None:
    plan = plan_reuse(cached, prompt, history_start=history_start, min_chunk=3)
    assert cached[: plan.prefix] == prompt[: plan.prefix]
    assert plan.resume <= len(prompt) - 1  # the last token is always evaluated
    if plan.chunk is not None:
        start, end = plan.chunk
        assert start >= plan.prefix and end <= len(cached)
        assert cached[start:end] == prompt[plan.dest : plan.dest + plan.chunk_len]
        assert plan.dest >= plan.prefix


def best_by_search(
    cached: list[int], prompt: list[int], history_start: int | None, min_chunk: int
) -> int:
    """Most tokens any allowed plan reuses, by trying every one: the common prefix (never the
    prompt's last token) plus at most one cached run of ``min_chunk`` or more tokens, moved
    to right after the prefix or to ``history_start``."""
    limit = len(prompt) - 1
    prefix = 0
    while prefix < min(len(cached), limit) and cached[prefix] == prompt[prefix]:
        prefix += 1
    dests = {prefix} | ({history_start} if history_start and prefix < history_start else set())
    best = 0
    for dest in dests:
        for at in range(prefix, len(cached)):
            for length in range(min_chunk, min(len(cached) - at, limit - dest) + 1):
                if cached[at : at + length] == prompt[dest : dest + length]:
                    best = max(best, length)
    return prefix + best


@settings(max_examples=400, deadline=None)
@given(
    cached=st.lists(st.integers(0, 3), max_size=24),
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=24),
    history_start=st.none() | st.integers(0, 24),
)
def test_plans_reuse_as_much_as_an_exhaustive_search(
    cached: list[int], prompt: list[int], history_start: int | None
) -> None:
    plan = plan_reuse(cached, prompt, history_start=history_start, min_chunk=3)
    assert plan.prefix + plan.chunk_len == best_by_search(cached, prompt, history_start, 3)
