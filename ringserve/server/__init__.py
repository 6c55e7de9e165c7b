"""`ringserve serve`: an OpenAI-compatible HTTP server over the engine."""

from ringserve.server.api import build_app
from ringserve.server.async_engine import AsyncEngine
from ringserve.server.launcher import run_server

__all__ = ["AsyncEngine", "build_app", "run_server"]
