"""plan_reuse: the pure planning of in-place KV reuse."""

from hypothesis import given, settings
from hypothesis import strategies as st

from chatctx.model.kv import plan_reuse

HEAD = list(range(1000, 1020))  # system prompt
A = list(range(2000, 2040))  # an evicted turn
B = list(range(3000, 3050))  # a kept turn
R = list(range(6000, 6030))  # a recall section, gone from the next prompt
C = list(range(3100, 3140))  # the last message and its reply, sent after the recall section
OLD_TAIL = [7, 8, 9]
NEW = list(range(4000, 4012))


def test_extension_reuses_the_common_prefix() -> None:
    plan = plan_reuse(HEAD + B, HEAD + B + NEW)
    assert plan.chunks == () and plan.prefix == len(HEAD + B)


def test_same_prompt_evaluates_only_the_last_token() -> None:
    plan = plan_reuse(HEAD + B, HEAD + B)
    assert plan.prefix == len(HEAD + B) - 1 and plan.chunks == ()


def test_evicted_turn_is_removed_and_kept_turn_shifted() -> None:
    plan = plan_reuse(HEAD + A + B + OLD_TAIL, HEAD + B + NEW)
    assert plan.prefix == len(HEAD)
    assert plan.chunks == ((len(HEAD + A), len(HEAD + A + B)),)
    assert plan.dest == len(HEAD) and plan.moves()[0][2] == -len(A)
    assert plan.inserted == 0 and plan.resume == len(HEAD + B)


def test_inserted_summary_needs_history_start() -> None:
    summary = list(range(5000, 5030))
    cached = HEAD + A + B + OLD_TAIL
    prompt = HEAD + summary + B + NEW
    assert plan_reuse(cached, prompt).chunks == ()
    plan = plan_reuse(cached, prompt, history_start=len(HEAD + summary))
    assert plan.chunks == ((len(HEAD + A), len(HEAD + A + B)),)
    assert plan.inserted == len(summary) and plan.moves()[0][2] == len(summary) - len(A)


def test_an_eviction_after_a_recall_moves_the_last_message_too() -> None:
    # The cache holds the evicted turn A, the kept turn B, then the recall section R the last
    # prompt sent before its message C. The new prompt has neither A nor R: both holes close
    # and C moves behind B, so only NEW is evaluated.
    cached = HEAD + A + B + R + C + OLD_TAIL
    plan = plan_reuse(cached, HEAD + B + C + NEW)
    b_at, c_at = len(HEAD + A), len(HEAD + A + B + R)
    assert plan.chunks == ((b_at, b_at + len(B)), (c_at, c_at + len(C)))
    assert plan.moves() == [(b_at, b_at + len(B), -len(A)), (c_at, c_at + len(C), -len(A + R))]
    assert plan.resume == len(HEAD + B + C)
    # Behind a new summary the runs move right or left, as the summary's length says.
    summary = list(range(5000, 5100))
    plan = plan_reuse(cached, HEAD + summary + B + C + NEW, history_start=len(HEAD + summary))
    assert plan.inserted == len(summary) and plan.resume == len(HEAD + summary + B + C)
    assert [delta for _, _, delta in plan.moves()] == [
        len(summary) - len(A),
        len(summary) - len(A + R),
    ]


def test_a_summary_put_in_front_of_the_first_turns_takes_back_their_first_token() -> None:
    # The first summary goes between the system prompt and the turns right after it. Both
    # begin with the same header token, so the common prefix reaches into the turns; the
    # turns are still moved, whole, and only that one token of the prefix is evaluated again.
    header = [128006]
    turns = header + B
    summary = header + list(range(5000, 5030))
    plan = plan_reuse(
        HEAD + turns + OLD_TAIL, HEAD + summary + turns + NEW, history_start=len(HEAD + summary)
    )
    assert plan.prefix == len(HEAD)
    assert plan.chunks == ((len(HEAD), len(HEAD + turns)),)
    assert plan.dest == len(HEAD + summary) and plan.inserted == len(summary)


def test_short_runs_are_not_worth_a_shift() -> None:
    short = list(range(3000, 3010))
    assert plan_reuse(HEAD + A + short, HEAD + short + NEW).chunks == ()


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
    at, last_end = plan.dest, plan.prefix
    for start, end in plan.chunks:  # in order in the cache, back to back in the prompt
        assert start >= last_end and end <= len(cached) and end - start >= 3
        assert cached[start:end] == prompt[at : at + end - start]
        at, last_end = at + end - start, end
    if plan.chunks:
        assert plan.dest >= plan.prefix and plan.resume == at
    else:
        assert plan.resume == plan.prefix


def best_by_search(
    cached: list[int], prompt: list[int], history_start: int | None, min_chunk: int
) -> int:
    """Most tokens any allowed plan reuses with one run, by trying every one: the common
    prefix (never the prompt's last token) plus at most one cached run of ``min_chunk`` or
    more tokens, moved to right after the prefix, or to ``history_start``; a run moved there
    may start inside the prefix, which then ends where the run starts."""
    limit = len(prompt) - 1
    prefix = 0
    while prefix < min(len(cached), limit) and cached[prefix] == prompt[prefix]:
        prefix += 1
    best = prefix
    for at in range(prefix + 1, len(cached)):
        for length in range(min_chunk, min(len(cached) - at, limit - prefix) + 1):
            if cached[at : at + length] == prompt[prefix : prefix + length]:
                best = max(best, prefix + length)
    if history_start and prefix < history_start < limit:
        for at in range(len(cached)):
            for length in range(min_chunk, min(len(cached) - at, limit - history_start) + 1):
                if cached[at : at + length] == prompt[history_start : history_start + length]:
                    best = max(best, min(prefix, at) + length)
    return best


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
    first = plan.chunks[0][1] - plan.chunks[0][0] if plan.chunks else 0
    best = best_by_search(cached, prompt, history_start, 3)
    assert plan.prefix + first == best  # the longest run is the one moved first
    assert plan.prefix + plan.chunk_len >= best
