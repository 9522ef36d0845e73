"""Running the app under uvicorn, with SIGTERM as a drain rather than a stop.

uvicorn alone stops listening at SIGTERM (new clients get a refused connection), waits
for open connections, then re-raises the signal (exit status 143). Here SIGTERM (or
SIGINT) starts ``Service.drain``: the port stays open and new requests get 503, in-flight
replies finish or are cut at the drain deadline (stored as partial, the stream ending
cleanly), then uvicorn shuts down and the process exits 0. A second signal cuts the
replies at once.
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn

from chatctx.backends.router import backends_from_env
from chatctx.errors import ConfigError
from chatctx.serve._app import create_app
from chatctx.serve._config import check_bind
from chatctx.serve._service import Service, server_backend_class
from chatctx.settings import ServeConfig

logger = logging.getLogger("chatctx.serve")


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose exit signals drain the chatctx service first."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)  # type: ignore[arg-type]
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                logger.info("listening on http://%s:%d", host, port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it only schedules; the drain runs on the loop.
        if self._loop is None:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain, sig)

    def _start_drain(self, sig: int) -> None:
        if self._drain is not None:
            logger.warning("signal %d again: cutting the replies now", sig)
            for cancel in list(self.service.cancels):
                cancel.set()
            return
        logger.info("signal %d: draining", sig)
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.service.drain(self.service.config.limits.drain_timeout_s)
        finally:
            self.should_exit = True


def reachable(url: str, timeout: float = 10.0) -> None:
    """``ConfigError`` unless a llama-server answers at ``url`` (``/health``; 503 while it
    loads is an answer: the backend waits for it)."""
    import httpx

    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=timeout)
    except httpx.HTTPError as exc:
        raise ConfigError(f"no llama-server answers at {url}: {exc}") from exc


def serve(config: ServeConfig) -> None:
    """Run ``chatctx serve`` until SIGTERM/SIGINT (then drain and return)."""
    check_bind(config)
    urls = list(config.backend_urls) or backends_from_env()
    if urls:
        server_backend_class()  # a clear error now, not after the server started
        for url in urls:  # a wrong URL is an error at start, not a server never ready
            reachable(url)
    app = create_app(config)
    service: Service = app.state.service
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        access_log=False,  # ours is structured and leaves message text out
        log_config=None,  # logging is the caller's (the CLI sets it up)
        timeout_graceful_shutdown=10,
        lifespan="on",
    )
    DrainingServer(uv_config, service).run()
