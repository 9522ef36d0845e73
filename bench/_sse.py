"""A lean HTTP/1.1 client for the benchmarks' streamed turns: a POST, then the server-sent
events of its response line by line.

The benchmark's clients run on the cores the server and llama.cpp use, and the in-process
run has none: httpx (request building, h11, anyio streams, text decoding) spent about 5 ms
of CPU per 8-token turn there, several per cent of the machine at the load measured, all
of it landing on the serve side of the comparison. This reads the same bytes with
asyncio's streams: one connection per client, kept alive unless asked not to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class HTTPStatusError(RuntimeError):
    """A response other than 200 (the message has its first bytes)."""


class SSEClient:
    """One connection to ``url``'s host; ``keepalive=False`` opens one per request."""

    def __init__(self, url: str, *, keepalive: bool = True) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"need http://host:port, not {url!r}")
        self.host, self.port = parts.hostname, parts.port
        self.keepalive = keepalive
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def lines(self, path: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """POST ``body`` as JSON and yield the response's lines (without line ends)."""
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            f"Accept: text/event-stream\r\n"
            + ("" if self.keepalive else "Connection: close\r\n")
            + "\r\n"
        ).encode()
        if self._streams is None:
            self._streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._streams
        reuse = self.keepalive
        try:
            writer.write(head + payload)
            status_line = await reader.readline()
            if not status_line:
                raise ConnectionError("the server closed the connection")
            status = int(status_line.split()[1])
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            reuse = reuse and headers.get("connection", "").lower() != "close"
            body_bytes = _body(reader, headers)
            if status != 200:
                text = b"".join([part async for part in body_bytes])
                raise HTTPStatusError(f"{status}: {text[:300]!r}")
            pending = b""
            async for part in body_bytes:
                pending += part
                *complete, pending = pending.split(b"\n")
                for line in complete:
                    yield line.rstrip(b"\r")
            if pending:
                yield pending
        except BaseException:
            reuse = False
            raise
        finally:
            if not reuse:
                await self.aclose()

    async def aclose(self) -> None:
        if self._streams is not None:
            _, writer = self._streams
            self._streams = None
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The response body as it arrives: chunked, by Content-Length, or up to the close."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while part := await reader.read(65536):
            yield part
