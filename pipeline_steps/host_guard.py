"""Refuse a request to a loopback port whose ``Host`` header is not a loopback name (DNS rebinding).

A web page in the user's browser can make its own host name resolve to 127.0.0.1 (DNS rebinding) and then talk to
any service on a loopback port as a same-origin page; what gives it away is the ``Host`` header, which still names
the page's host. So every local server of the pipeline (Airflow's API server on the local profile, the MLflow
server, the MCP code server, the local sandbox server) answers a request that reached it on a loopback address only
when its ``Host`` is ``localhost``, ``127.0.0.1`` or ``[::1]``, with or without a port. A request that reached a
non-loopback address (a server deliberately bound to an interface, e.g. in a pod) is left to the server's own
authentication: its ``Host`` is whatever name the network gives it.

:class:`LoopbackHostMiddleware` is a plain ASGI middleware (Starlette, FastAPI, FastMCP apps).
"""

from __future__ import annotations

import ipaddress
import re

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
_HOST = re.compile(r"^(?P<name>\[[0-9A-Fa-f:.]+\]|[^:\[\]]+)(?::(?P<port>[0-9]{1,5}))?$")


def is_loopback_host(value: str | None) -> bool:
    """True for a ``Host`` header naming a loopback name: ``localhost``, ``127.0.0.1``, ``[::1]``, any port."""
    m = _HOST.match((value or "").strip())
    return bool(m) and m.group("name").lower().rstrip(".") in LOOPBACK_NAMES


def is_loopback_address(address: str | None) -> bool:
    """True for an IP address on the loopback interface (127.0.0.0/8, ::1); False for anything else or None."""
    try:
        return ipaddress.ip_address((address or "").strip("[]")).is_loopback
    except ValueError:
        return False


def refusal(host: str | None) -> str:
    return (
        f"refused: Host {host!r} is not a loopback name (localhost, 127.0.0.1, [::1]); "
        "a page that rebinds its DNS name to this machine cannot use this server"
    )


class LoopbackHostMiddleware:
    """ASGI middleware: 403 for an HTTP or WebSocket request that arrived on a loopback address with a ``Host`` that
    is not a loopback name (or none). Requests that arrived on another address pass (see the module's doc)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        server = scope.get("server")
        if server and server[0] and not is_loopback_address(str(server[0])):
            return await self.app(scope, receive, send)  # reached through a real interface: not a rebinding case
        raw = header(scope, b"host")
        host = None if raw is None else raw.decode("latin-1")
        if is_loopback_host(host):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send_error(send, 403, (refusal(host) + "\n").encode(), b"text/plain; charset=utf-8")


def header(scope, name: bytes) -> bytes | None:
    """An ASGI request's header ``name`` (lower case), its first value; None when absent."""
    for k, v in scope.get("headers") or ():
        if k.lower() == name:
            return v
    return None


async def send_error(send, status: int, body: bytes, content_type: bytes, extra_headers=()) -> None:
    """An ASGI middleware's own answer: ``status`` with ``body``, sent instead of calling the app."""
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
