"""The MCP tool against a real MCP server (the ``mcp`` SDK's FastMCP over streamable HTTP) whose ``run_code_once``
runs code in the local E2B-compatible sandbox server."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from importlib.resources import files

import pytest

pytestmark = [
    pytest.mark.needs_root(reason="the sandbox server needs root (uids, namespaces)"),
    pytest.mark.slow,  # about 16 s of CPU: the sandbox and MCP servers started, the shipped tool run through them
]

TOOL_CONFIG = str(files("pipeline_steps.tools") / "mcp_tool.yaml")
TOKEN_ENV = "MCP_SERVER_TOKEN"  # the MCP code server's bearer token (pipeline_steps/tools/mcp_code_server.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mcp_server(tmp_path_factory):
    from pipeline_steps.sandbox.launcher import LocalSandboxServer

    tmp = tmp_path_factory.mktemp("mcp")
    token = secrets.token_hex(16)
    saved = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = token  # the tool reads it as the servers file says ("api_key": "$MCP_SERVER_TOKEN")
    with LocalSandboxServer(tmp / "state", args=["--warm", "2"]) as sandboxes:
        port = _free_port()
        cmd = [sys.executable, "-m", "pipeline_steps.tools.mcp_code_server", "--port", str(port)]
        proc = subprocess.Popen(cmd, env={**os.environ, **sandboxes.env()}, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120  # a cold import of the MCP server takes over 30 s on a loaded machine
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert proc.poll() is None and time.monotonic() < deadline, "MCP server did not start"
                    time.sleep(0.2)
            servers = tmp / "mcp_server.json"
            url = f"http://127.0.0.1:{port}/mcp"
            servers.write_text(json.dumps({"mcpServers": {"sandbox": {"url": url, "api_key": f"${TOKEN_ENV}"}}}))
            yield {"servers_file": servers, "port": port}
        finally:
            proc.terminate()
            proc.wait(10)
            if saved is None:
                os.environ.pop(TOKEN_ENV, None)
            else:
                os.environ[TOKEN_ENV] = saved


def _tool(servers_file, **config):
    from pipeline_steps.tools.mcp_tool import MCPTool

    mcp = {"mcp_servers_config_path": str(servers_file), "tool_selected_list": ["run_code_once"]}
    return MCPTool({"type": "native", "mcp": mcp, **config}, None)


async def _call(tool, code):
    iid, _ = await tool.create()
    return await tool.execute(iid, {"code": code})


def test_shipped_config_loads_schema_from_server_and_runs_code(mcp_server, monkeypatch):
    from verl.tools.tool_registry import initialize_tools_from_config

    monkeypatch.setenv("MCP_SERVERS_CONFIG", str(mcp_server["servers_file"]))
    [tool] = initialize_tools_from_config(TOOL_CONFIG)  # verl's registry, as rollout workers load it
    assert tool.name == "run_code_once"
    assert tool.tool_schema.function.parameters.required == ["code"]
    resp, _, metrics = asyncio.run(_call(tool, "print('hi')\n6 * 7"))
    assert resp.text == "hi\n42" and metrics["mcp_error"] == 0
    resp, _, _ = asyncio.run(_call(tool, "undefined_name"))
    assert resp.text.startswith("[error] NameError")


def test_timeout_and_unreachable_server_come_back_as_text(mcp_server, tmp_path):
    resp, _, metrics = asyncio.run(_call(_tool(mcp_server["servers_file"], timeout=2), "import time; time.sleep(5)"))
    assert "unavailable" in resp.text and metrics["mcp_error"] == 1
    down = tmp_path / "down.json"
    down.write_text(json.dumps({"mcpServers": {"x": {"url": f"http://127.0.0.1:{_free_port()}/mcp"}}}))
    from verl.tools.schemas import OpenAIFunctionToolSchema

    from pipeline_steps.tools.mcp_tool import MCPTool

    schema = OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "run_code_once", "description": "run code"}}
    )
    tool = MCPTool({"type": "native", "timeout": 5, "mcp": {"mcp_servers_config_path": str(down)}}, schema)
    resp, _, metrics = asyncio.run(_call(tool, "1"))
    assert resp.text.startswith("Error: MCP tool run_code_once unavailable") and metrics["mcp_error"] == 1


def test_rate_limit(mcp_server, monkeypatch):
    import time

    from pipeline_steps.tools import mcp_tool

    tool = _tool(mcp_server["servers_file"], rate_limit=2)
    sent = []  # when each call left the limiter for the server (the real session call follows at once)
    real = mcp_tool._session_call

    async def recording(server, timeout, fn):
        if "call_tool" in fn.__code__.co_names:  # the tool call itself, not the schema lookup
            sent.append(time.monotonic())
        return await real(server, timeout, fn)

    monkeypatch.setattr(mcp_tool, "_session_call", recording)

    async def main():
        return await asyncio.gather(*[_call(tool, "print(1)") for _ in range(5)])

    results = asyncio.run(main())
    assert [r[0].text.strip() for r in results] == ["1"] * 5
    sent.sort()
    # 2 per second, the first two from a full bucket: calls 3, 4, 5 leave no sooner than 0.5, 1.0, 1.5 s after the
    # first. A rate of 1 per second would need 3 s or more; no limit would need none.
    assert len(sent) == 5 and 1.4 <= sent[-1] - sent[0] < 2.2, sent
    # the bucket's contract: by t seconds after the first call, at most 2 + 2t calls have left (a per-gap check
    # failed under load: a late call 3 followed by an on-time call 4)
    assert all(sent[k] - sent[0] >= 0.5 * (k - 1) - 0.02 for k in range(2, 5)), sent


def test_bad_servers_file_is_one_line(tmp_path):
    from pipeline_steps.tools.mcp_tool import load_servers

    bad = tmp_path / "bad.json"
    bad.write_text('{"mcpServers": {"x": {"url": "ftp://nope"}}}')
    with pytest.raises(ValueError, match="needs an http") as err:
        load_servers(str(bad))
    assert "\n" not in str(err.value)
    bad.write_text("not json")
    with pytest.raises(ValueError, match="expected"):
        load_servers(str(bad))


def test_a_token_named_but_not_set_is_one_line_not_an_empty_bearer(tmp_path, monkeypatch):
    from pipeline_steps.tools.mcp_tool import load_servers

    monkeypatch.delenv("NO_SUCH_TOKEN", raising=False)
    servers = tmp_path / "mcp_server.json"
    servers.write_text(
        json.dumps({"mcpServers": {"x": {"url": "http://127.0.0.1:1/mcp", "api_key": "$NO_SUCH_TOKEN"}}})
    )
    with pytest.raises(ValueError, match=r"\$NO_SUCH_TOKEN, unset") as err:
        load_servers(str(servers))
    assert "\n" not in str(err.value)
    monkeypatch.setenv("NO_SUCH_TOKEN", "t0ken")
    assert load_servers(str(servers))["x"]["headers"] == {"Authorization": "Bearer t0ken"}
