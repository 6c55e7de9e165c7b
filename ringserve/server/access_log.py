"""Structured access logs: one JSON line per HTTP request on the `ringserve.access` logger.

Off by default (`ringserve serve --access-log` turns it on): a busy server logs nothing per
request, and uvicorn's own plain-text access log is always off.
"""

from __future__ import annotations

import json
import logging
import time

logger = logging.getLogger("ringserve.access")


class AccessLog:
    """Pure ASGI middleware: when the response has been sent, log method, path, status,
    duration and client as one JSON object."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = {"code": None}

        async def record_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            client = scope.get("client")
            logger.info(
                json.dumps(
                    {
                        "method": scope["method"],
                        "path": scope["path"],
                        "status": status["code"],
                        "duration_ms": round((time.monotonic() - start) * 1000, 2),
                        "client": f"{client[0]}:{client[1]}" if client else None,
                    }
                )
            )
