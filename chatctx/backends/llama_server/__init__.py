"""chatctx on llama.cpp's own ``llama-server``, over HTTP.

::

    LlamaServerBackend   a Backend on one llama-server (slots, prompts as token arrays)
    ServerStream         one streamed /completion (a chatctx.backends.base.Stream)
    LlamaServerProcess   start/stop a local llama-server (tests, demos, benchmarks)
    find_llama_server    the binary: CHATCTX_LLAMA_SERVER, else llama-server on PATH

Needs httpx (``pip install 'chatctx[llama-server]'``); never loads llama.cpp in this process.
"""

from __future__ import annotations

from chatctx.backends.llama_server._backend import LlamaServerBackend
from chatctx.backends.llama_server._process import LlamaServerProcess, find_llama_server, free_port
from chatctx.backends.llama_server._slot_files import state_filename
from chatctx.backends.llama_server._stream import ServerStream

__all__ = [
    "LlamaServerBackend",
    "LlamaServerProcess",
    "ServerStream",
    "find_llama_server",
    "free_port",
    "state_filename",
]
