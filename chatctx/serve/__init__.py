"""``chatctx serve``: an OpenAI-compatible service (chat completions, Responses,
Conversations) that remembers conversations.

::

    create_app(config)   the ASGI app (FastAPI): /v1/chat/completions, /v1/responses/...,
                         /v1/conversations/..., /v1/models, /v1/cache, /, /health, /ready,
                         /metrics
    serve(config)        run it under uvicorn; SIGTERM drains
    ServeConfig, Limits  where to listen, what to run, keys and limits
    load_api_keys()      {"<key>": "<tenant>"} from a file or CHATCTX_API_KEYS

Modules: ``_config`` (settings, keys), ``_schemas`` (OpenAI shapes), ``_tenants`` (keys,
tenants, limits), ``_errors`` (the one mapping to HTTP errors), ``_service`` (what the
process owns), ``_turn`` / ``_chat`` (a reply), ``_responses`` (the Responses API on stored
conversations), ``_items`` (Responses items to messages and back), ``_routes``,
``_conversations`` (OpenAI's Conversations API and chatctx's views), ``_page`` (the cache page),
``_http`` (access log, body limit, drain refusal), ``_metrics``, ``_runner`` (uvicorn).
Needs the ``serve`` extra (FastAPI, uvicorn).
"""

from chatctx.serve._app import create_app
from chatctx.serve._config import build_config_from, check_bind
from chatctx.serve._runner import serve
from chatctx.serve._service import Service, make_backend
from chatctx.settings import Limits, ServeConfig, load_api_keys

__all__ = [
    "Limits",
    "ServeConfig",
    "Service",
    "build_config_from",
    "check_bind",
    "create_app",
    "load_api_keys",
    "make_backend",
    "serve",
]
