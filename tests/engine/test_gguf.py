from pathlib import Path

import pytest

from chatctx.errors import ModelError
from chatctx.model.gguf import model_facts, read_metadata


def test_smollm2_facts(smollm2_path: Path) -> None:
    facts = model_facts(read_metadata(smollm2_path))
    assert facts["architecture"] == "llama"
    assert facts["n_layer"] == 30
    assert facts["n_ctx_train"] == 8192
    assert facts["vocab_size"] == 49152
    assert facts["chat_template"] is True
    # 2 bytes x 30 layers x 3 KV heads x (64 K + 64 V)
    assert facts["kv_bytes_per_token_f16"] == 2 * 30 * 3 * 128


def test_tiny_llama3_facts(tiny_llama3_path: Path) -> None:
    facts = model_facts(read_metadata(tiny_llama3_path))
    assert facts["vocab_size"] == 128256
    assert facts["bos_token_id"] == 128000 and facts["eos_token_id"] == 128009
    assert facts["kv_bytes_per_token_f16"] == 2 * 2 * 2 * 32


def test_missing_and_non_gguf_files(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not found"):
        read_metadata(tmp_path / "missing.gguf")
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelError, match="not a GGUF"):
        read_metadata(bogus)
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00\x01")
    with pytest.raises(ModelError, match="corrupt"):
        read_metadata(truncated)
