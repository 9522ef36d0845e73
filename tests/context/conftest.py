from pathlib import Path

import pytest

from chatctx.model.codec import TiktokenCodec, open_codec


@pytest.fixture(scope="session")
def llama3_codec(tiny_llama3_path: Path) -> TiktokenCodec:
    # The real Llama 3 tokenizer and Meta's template, without loading llama.cpp.
    return open_codec(tiny_llama3_path)
