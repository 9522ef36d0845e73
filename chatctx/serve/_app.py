"""The ASGI application: ``create_app(config)``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from chatctx import __version__
from chatctx.backends.base import Backend
from chatctx.serve._conversations import router as conversations_router
from chatctx.serve._errors import install_handlers
from chatctx.serve._http import ServeMiddleware
from chatctx.serve._page import page_router
from chatctx.serve._routes import router
from chatctx.serve._service import Service
from chatctx.settings import ServeConfig
from chatctx.store import Store


def create_app(
    config: ServeConfig | None = None,
    *,
    backend: Backend | None = None,
    store: Store | None = None,
) -> FastAPI:
    """The chatctx service as an ASGI app (run it with uvicorn, or ``chatctx serve``).

    The model is loaded (and the store opened) in the background when the app starts, unless
    ``backend`` / ``store`` are given: those are used as they are and left open.
    ``app.state.service`` is the ``Service`` behind it (``drain()`` for a graceful stop).
    """
    config = config or ServeConfig()
    service = Service(config, backend=backend, store=store)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(asyncio.to_thread(service.load))
        try:
            yield
        finally:
            await loading
            await asyncio.to_thread(service.close)

    app = FastAPI(
        title="chatctx serve",
        version=__version__,
        description="OpenAI-compatible chat completions that remember conversations.",
        lifespan=lifespan,
    )
    app.state.service = service
    install_handlers(app)
    app.include_router(router)
    app.include_router(conversations_router)
    app.include_router(page_router)
    app.add_middleware(ServeMiddleware, service=service)
    return app
