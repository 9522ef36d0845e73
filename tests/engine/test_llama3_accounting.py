"""Exact Llama 3 token accounting with the real vocabulary and Meta's template."""

from chatctx.backends.engine import Engine
from chatctx.settings import GenerationSettings
from chatctx.testing import llama3_vocab_path

BOS, START_HEADER, END_HEADER, EOT = 128000, 128006, 128007, 128009
SYSTEM, USER, ASSISTANT, NEWLINES = 9125, 882, 78191, 271  # "system" "user" "assistant" "\n\n"

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "Order 1234?"},
]


def test_rendered_llama3_chat_has_the_expected_ids(llama3_engine: Engine) -> None:
    ids = llama3_engine.prompt_tokens(MESSAGES)
    body = {
        "Be brief.": [3513, 10015, 13],
        "Hello there": [9906, 1070],
        "Hi!": [13347, 0],
        "Order 1234?": [4531, 220, 4513, 19, 30],
    }
    expected = [BOS]
    for message in MESSAGES:
        role = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}[message["role"]]
        expected += [START_HEADER, role, END_HEADER, NEWLINES, *body[message["content"]], EOT]
    expected += [START_HEADER, ASSISTANT, END_HEADER, NEWLINES]
    assert ids == expected
    assert ids.count(BOS) == 1


def test_usage_reports_the_exact_prompt_token_count(llama3_engine: Engine) -> None:
    llama3_engine.clear()
    ids = llama3_engine.prompt_tokens(MESSAGES)
    result = llama3_engine.generate(ids, settings=GenerationSettings(max_tokens=4, seed=1)).wait()
    assert result.usage.prompt_tokens == len(ids) == 37
    assert result.usage.reused_tokens == 0
    assert result.usage.evaluated_tokens == len(ids)


def test_tokenizer_matches_llama_cpp_reference_vectors(llama3_engine: Engine) -> None:
    # llama.cpp's own test vectors for this vocabulary: texts and their token ids.
    base = llama3_vocab_path()
    texts = (
        base.with_name(base.name + ".inp")
        .read_text(encoding="utf-8")
        .split("\n__ggml_vocab_test__\n")
    )
    outs = base.with_name(base.name + ".out").read_text(encoding="utf-8").splitlines()
    assert len(texts) >= 30
    for text, out in zip(texts, outs, strict=False):
        expected = [int(t) for t in out.split()]
        assert llama3_engine.tokenize(text, special=False) == expected, repr(text)
