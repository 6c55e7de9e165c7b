"""`ringserve serve`: an OpenAI-compatible HTTP server over the engine."""

from ringserve.server.api import build_app, run_server
from ringserve.server.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "build_app", "run_server"]
