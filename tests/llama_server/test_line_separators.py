"""A reply holding U+2028 or U+0085 streams whole from llama-server.

llama-server writes those characters raw inside its JSON events; a reader that splits lines
as ``str.splitlines`` does (httpx's ``iter_lines``) cut such an event in two and the turn
failed with "not JSON". Oracles: a grammar that forces the reply's text, and the server's
own bytes (the characters are there raw, and its non-streamed answer says the same text).
"""

from __future__ import annotations

from pathlib import Path

import httpx

from chatctx.backends.base import KVReport
from chatctx.backends.llama_server._stream import ServerStream
from tests.llama_server.conftest import start_server

FORCED = "a\u2028b\u0085c"
GRAMMAR = r'root ::= "a\u2028b\u0085c"'


def test_a_reply_with_line_separators_streams_whole(
    llama_server_binary: Path, smollm2_path: Path, tmp_path: Path
) -> None:
    server = start_server(llama_server_binary, smollm2_path, tmp_path, slots=1, n_ctx=256)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            prompt = client.post("/tokenize", json={"content": "Write three letters."}).json()[
                "tokens"
            ]
            body = {"prompt": prompt, "n_predict": 16, "temperature": 0.0, "grammar": GRAMMAR}
            plain = client.post("/completion", json=body).json()
            assert plain["content"] == FORCED  # the server's own answer, not streamed
            raw = client.post("/completion", json={**body, "stream": True}).content
            assert "\u2028".encode() in raw  # written raw, not as \u2028
            report = KVReport("server", 0, len(prompt), 0, 0, 0)
            stream = ServerStream(
                client,
                "test",
                {**body, "stream": True, "return_tokens": True, "timings_per_token": True},
                prompt=prompt,
                n_ctx=256,
                report=lambda cache_n, prompt_n: report,
                done=lambda _: None,
            )
            chunks = list(stream)
            assert "".join(chunks) == FORCED
            assert stream.result is not None and stream.result.text == FORCED
    finally:
        server.stop()
