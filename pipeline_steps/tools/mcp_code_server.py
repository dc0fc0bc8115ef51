"""An MCP server (streamable HTTP, the ``mcp`` SDK's FastMCP) with one tool, ``run_code_once``: run Python code in
a fresh E2B sandbox and return its output, like the MCP code sandbox of the ACK guide.

``MCP_SERVER_TOKEN=... python -m pipeline_steps.tools.mcp_code_server --port 8000`` (or ``--token-file PATH``); the
sandbox service comes from ``E2B_API_KEY`` and ``E2B_DOMAIN`` or ``E2B_API_URL`` + ``E2B_SANDBOX_URL`` (e.g. the
local ``sandbox-server``).

Every request must carry ``Authorization: Bearer <token>`` (401 otherwise, before any tool runs: an unauthenticated
caller never makes this server spend the sandbox service's key); the server does not start without a token. On a
loopback address a ``Host`` that is not a loopback name is refused too (DNS rebinding:
:mod:`pipeline_steps.host_guard`). The pipeline's MCP tool sends the token from its ``mcp_server.json``
(``"api_key": "$MCP_SERVER_TOKEN"``: :mod:`pipeline_steps.tools.mcp_tool`).
"""

from __future__ import annotations

import argparse
import hmac
import os
import sys

from pipeline_steps.host_guard import header, send_error
from pipeline_steps.tools.code_sandbox import format_execution

TOKEN_ENV = "MCP_SERVER_TOKEN"  # the bearer token clients must send (or --token-file)


class BearerTokenMiddleware:
    """ASGI middleware: 401 for an HTTP request without ``Authorization: Bearer <token>`` (constant-time check)."""

    def __init__(self, app, token: str):
        if not token:
            raise ValueError("an empty token would let anyone in")
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        if hmac.compare_digest(header(scope, b"authorization") or b"", self.expected):
            return await self.app(scope, receive, send)
        body = b'{"error": "unauthorized: send Authorization: Bearer <the MCP server token>"}\n'
        await send_error(
            send, 401, body, b"application/json", [(b"www-authenticate", b'Bearer realm="mcp-code-server"')]
        )


def build(host: str, port: int, template: str, exec_timeout: float, max_chars: int):
    from e2b_code_interpreter import AsyncSandbox
    from mcp.server.fastmcp import FastMCP

    # FastMCP bound to a loopback host checks Host and Origin on its /mcp route itself; app() adds the same Host
    # check on every route, and the token
    server = FastMCP("code-sandbox", host=host, port=port, stateless_http=True)

    @server.tool()
    async def run_code_once(code: str) -> str:
        """Run Python code in a fresh sandbox and return stdout, the last expression's value, stderr and any error."""
        sandbox = await AsyncSandbox.create(template=template, timeout=int(exec_timeout) + 60)
        try:
            return format_execution(await sandbox.run_code(code, timeout=exec_timeout), max_chars)
        finally:
            await sandbox.kill()

    return server


def app(server, token: str):
    """The server's ASGI app: the token checked first, then the loopback Host check, then FastMCP's routes."""
    from pipeline_steps.host_guard import LoopbackHostMiddleware

    return BearerTokenMiddleware(LoopbackHostMiddleware(server.streamable_http_app()), token)


def read_token(token_file: str | None) -> str:
    """The token from ``--token-file`` or ``$MCP_SERVER_TOKEN``; SystemExit(2) in one line when there is none."""
    if token_file:
        try:
            token = open(token_file, encoding="utf-8").read().strip()
        except OSError as exc:
            raise SystemExit(f"error: --token-file {token_file}: {exc.strerror or exc}") from None
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        print(
            f"error: the MCP code server needs a token: set ${TOKEN_ENV} or --token-file (clients send it as "
            "'Authorization: Bearer <token>'; without one anyone who reaches the port would spend the sandbox key)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return token


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m pipeline_steps.tools.mcp_code_server", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--template", default="code-interpreter-v1")
    p.add_argument("--exec-timeout", type=float, default=30.0)
    p.add_argument("--max-output-chars", type=int, default=4096)
    p.add_argument("--token-file", default=None, help=f"a file holding the bearer token (else ${TOKEN_ENV})")
    args = p.parse_args(argv)
    token = read_token(args.token_file)
    import uvicorn

    server = build(args.host, args.port, args.template, args.exec_timeout, args.max_output_chars)
    uvicorn.run(app(server, token), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
