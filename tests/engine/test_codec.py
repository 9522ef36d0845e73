"""tiktoken mirrors of the GGUF vocabularies give llama.cpp's exact token ids."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatctx.backends.engine import Engine
from chatctx.errors import ModelError
from chatctx.model.codec import LlamaCodec, TiktokenCodec, open_codec
from chatctx.testing import write_tiny_llama3

ROOT = Path(__file__).resolve().parents[2]

CORPUS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog. THE END... isn't it? We'll see; they'd go.",
    "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text]  # noqa\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\n\treturn sum;\r\n",
    "     five leading spaces, two trailing  ",
    "tabs\t\tand\t newlines\n\n\n\nmany\n \n \n",
    " " * 40 + "deep indent",
    "\n\n\n",
    "1 12 123 1234 12345 123456 3.14159 -42 1e10 0x1F 1,000,000 2026-11-29",
    "Order #A-1234, ticket NH-48213, model AX3000, price $199.99 (€184,50)",
    "안녕하세요, 주문 번호가 무엇인가요? 한국어 텍스트입니다.",
    "日本語のテキストと中文文本，还有 Ελληνικά και русский текст.",
    "Emoji: 🎉👍🏽👩‍👩‍👧‍👦 ❤️ 🇫🇷 and ✓ ✗ → ← ∑ ∫",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhey<|im_end|>",
    "mixed<|eot_id|>special<|im_end|>tokens <|reserved_special_token_5|> inside",
    "ümlaut café naïve résumé façade coöperate",
    "URLs: https://example.com/a/b?c=d&e=f#g and emails a.b+c@d-e.org",
    'JSON: {"key": [1, 2, {"nested": null}], "ok": true}',
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE I'M YOU'RE",
    "",
    "a",
    "\u00a0non-breaking\u2009thin\u200bzero-width spaces",
    "control \x07 bell \x1b[31m ansi",
]


@pytest.fixture(scope="module", params=["llama3", "smollm2"])
def engine(request: pytest.FixtureRequest, tiny_llama3_path: Path, smollm2_path: Path) -> Engine:
    path = tiny_llama3_path if request.param == "llama3" else smollm2_path
    with Engine.load(path, n_ctx=256) as engine:
        yield engine


def test_engine_uses_tiktoken(engine: Engine) -> None:
    assert isinstance(engine.codec(), TiktokenCodec)


def test_corpus_parity(engine: Engine) -> None:
    codec = engine.codec()
    texts = [
        *CORPUS,
        (ROOT / "README.md").read_text(encoding="utf-8"),
        (ROOT / "chatctx" / "backends" / "engine" / "_engine.py").read_text(encoding="utf-8"),
    ]
    for text in texts:
        assert codec.encode(text) == engine.tokenize(text), repr(text[:80])


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# Code points this Python's Unicode tables do not assign (category Cn) are left out: among
# them are Unicode 16's new letters, which tiktoken's tables know and llama.cpp's (15.1) do
# not (U+13460, an Egyptian hieroglyph: "\U00013460:A" splits differently). See _codec.
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cn"]), max_size=80))
def test_random_text_parity(engine: Engine, text: str) -> None:
    assert engine.codec().encode(text) == engine.tokenize(text)


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(alphabet=" \n\t\r07ab'!é", max_size=24))
def test_whitespace_digit_mixes_parity(engine: Engine, text: str) -> None:
    # Runs of whitespace next to digits and letters: where folded pre-tokenizer patterns
    # differ from llama.cpp's piecewise ones ("\n  4096" once split differently).
    assert engine.codec().encode(text) == engine.tokenize(text)


def test_prompt_tokens_match_the_engine(engine: Engine) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Order NH-48213? 🎉"},
        {"role": "assistant", "content": "  It shipped.  "},
        {"role": "user", "content": "Thanks"},
    ]
    assert engine.codec().prompt_tokens(messages) == engine.prompt_tokens(messages)


def test_unmirrorable_vocabulary_falls_back_to_llama_cpp(tmp_path: Path) -> None:
    # tiktoken has no pattern for this pre-tokenizer: counting must ask llama.cpp instead.
    path = write_tiny_llama3(tmp_path / "qwen-pre.gguf", tokenizer_pre="qwen2")
    with pytest.raises(ModelError, match="cannot mirror"):
        open_codec(path)
    with Engine.load(path, n_ctx=256) as engine:
        codec = engine.codec()
        assert isinstance(codec, LlamaCodec)
        messages = [{"role": "user", "content": "numbers 12345 and words"}]
        expected = engine.tokenize(str(engine.render(messages)), special=True)
        if engine.model.add_bos and expected[0] != engine.model.bos:
            expected.insert(0, engine.model.bos)
        assert codec.prompt_tokens(messages) == expected


def test_large_text_parity(engine: Engine) -> None:
    # Source code with special-token strings in it (the codec's own module has them).
    text = (ROOT / "chatctx" / "model" / "codec.py").read_text(encoding="utf-8") * 8
    codec = engine.codec()
    assert codec.encode(text) == engine.tokenize(text, special=True)
    # Counting treats text as text: special-token strings are characters.
    assert codec.count(text) == len(engine.tokenize(text, special=False))
