"""An MCP server (streamable HTTP, the ``mcp`` SDK's FastMCP) with one tool, ``run_code_once``: run Python code in
a fresh E2B sandbox and return its output, like the MCP code sandbox of the ACK guide.

``python -m pipeline_steps.tools.mcp_code_server --port 8000``; the sandbox service comes from ``E2B_API_KEY``
and ``E2B_DOMAIN`` or ``E2B_API_URL`` + ``E2B_SANDBOX_URL`` (e.g. the local ``sandbox-server``).
"""

from __future__ import annotations

import argparse

from pipeline_steps.tools.code_sandbox import format_execution


def build(host: str, port: int, template: str, exec_timeout: float, max_chars: int):
    from e2b_code_interpreter import AsyncSandbox
    from mcp.server.fastmcp import FastMCP

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


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m pipeline_steps.tools.mcp_code_server", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--template", default="code-interpreter-v1")
    p.add_argument("--exec-timeout", type=float, default=30.0)
    p.add_argument("--max-output-chars", type=int, default=4096)
    args = p.parse_args(argv)
    build(args.host, args.port, args.template, args.exec_timeout, args.max_output_chars).run("streamable-http")


if __name__ == "__main__":
    main()
