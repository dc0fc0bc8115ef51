"""A verl tool that calls a tool of an MCP server over streamable HTTP (the ``mcp`` SDK's client).

verl 0.9.1 dropped its MCP tool and ``type: mcp``; this one is ``type: native`` and reads the ACK guide's
settings: ``mcp.mcp_servers_config_path`` (a JSON file ``{"mcpServers": {name: {"url": ..., "api_key": ...}}}``;
an ``api_key`` of ``$NAME`` is read from the environment, and is sent as ``Authorization: Bearer``; our MCP code
server requires it: ``"api_key": "$MCP_SERVER_TOKEN"``),
``mcp.tool_selected_list`` (the MCP tools this entry may call), ``timeout`` (seconds per call) and ``rate_limit``
(calls per second, a token bucket shared by all rollouts of the process).

One ``tools:`` entry is one verl tool: it calls the MCP tool named by its ``tool_schema`` (or, without a schema,
the single name in ``tool_selected_list``, whose schema is then read from the server). Failures (server down,
timeout, tool error) come back as the tool's text; nothing raises out of ``execute``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import time
from datetime import timedelta
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from pipeline_steps.tools.code_sandbox import truncate

log = logging.getLogger(__name__)


def load_servers(path: str) -> dict[str, dict]:
    """``{name: {"url": ..., "headers": {...}}}`` from an ``mcp_server.json``; ValueError in one line if malformed."""
    try:
        servers = json.loads(open(path, encoding="utf-8").read())["mcpServers"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"MCP servers file {path}: {type(exc).__name__}: {exc}; expected {{'mcpServers': {{...}}}}")
    out = {}
    for name, spec in servers.items():
        if not isinstance(spec, dict) or not str(spec.get("url", "")).startswith(("http://", "https://")):
            raise ValueError(f"MCP servers file {path}: server {name!r} needs an http(s) 'url'")
        headers = dict(spec.get("headers") or {})
        key = spec.get("api_key")
        if key:
            if str(key).startswith("$"):  # the token from the environment, never written into the file
                var, key = key[1:], os.environ.get(key[1:], "")
                if not key:
                    raise ValueError(f"MCP servers file {path}: server {name!r} takes its api_key from ${var}, unset")
            headers["Authorization"] = f"Bearer {key}"
        out[name] = {"url": spec["url"], "headers": headers}
    return out


class TokenBucket:
    def __init__(self, rate: float):
        self.rate = float(rate)
        self.tokens = max(1.0, self.rate)
        self.stamp = time.monotonic()
        self.lock: asyncio.Lock | None = None

    async def take(self):
        if self.rate <= 0:
            return
        if self.lock is None:  # created in the rollout's event loop
            self.lock = asyncio.Lock()
        async with self.lock:
            while True:
                now = time.monotonic()
                self.tokens = min(max(1.0, self.rate), self.tokens + (now - self.stamp) * self.rate)
                self.stamp = now
                if self.tokens >= 1:
                    self.tokens -= 1
                    return
                await asyncio.sleep((1 - self.tokens) / self.rate)


async def _session_call(server: dict, timeout: float, fn):
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    async with streamablehttp_client(server["url"], headers=server["headers"], timeout=timeout) as (read, write, _):
        async with ClientSession(read, write, read_timeout_seconds=timedelta(seconds=timeout)) as session:
            await session.initialize()
            return await fn(session)


def _in_thread(coro):
    """Run ``coro`` to completion even when called from inside a running event loop (verl builds tools there)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class MCPTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        mcp_cfg = dict(config.get("mcp") or {})
        if not mcp_cfg.get("mcp_servers_config_path"):
            raise ValueError("MCP tool: set config.mcp.mcp_servers_config_path to an mcp_server.json")
        self.servers = load_servers(mcp_cfg["mcp_servers_config_path"])
        self.selected = list(mcp_cfg.get("tool_selected_list") or [])
        self.timeout = float(config.get("timeout", 120))
        self.bucket = TokenBucket(float(config.get("rate_limit", 0)))
        self.max_output_chars = int(config.get("max_output_chars", 4096))
        self._where: dict[str, str] = {}  # MCP tool name -> server name
        if tool_schema is None:
            if len(self.selected) != 1:
                raise ValueError("MCP tool: without a tool_schema, tool_selected_list must name exactly one tool")
            tool_schema = _in_thread(self._schema_from_server(self.selected[0]))
        elif self.selected and tool_schema.function.name not in self.selected:
            raise ValueError(f"MCP tool: {tool_schema.function.name!r} is not in tool_selected_list {self.selected}")
        super().__init__(config, tool_schema)

    async def _locate(self, name: str) -> tuple[str, Any]:
        """The server offering tool ``name`` (first in file order), and the tool's description."""
        for server_name, server in self.servers.items():
            tools = await _session_call(server, self.timeout, lambda s: s.list_tools())
            for t in tools.tools:
                if t.name == name:
                    self._where[name] = server_name
                    return server_name, t
        raise ValueError(f"MCP tool {name!r}: no server in the config offers it")

    async def _schema_from_server(self, name: str) -> OpenAIFunctionToolSchema:
        _, t = await self._locate(name)
        params = {k: v for k, v in t.inputSchema.items() if k in ("type", "properties", "required")}
        return OpenAIFunctionToolSchema.model_validate(
            {"type": "function", "function": {"name": name, "description": t.description or name, "parameters": params}}
        )

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        start = time.monotonic()
        try:
            await self.bucket.take()
            async with asyncio.timeout(self.timeout):
                server_name = self._where.get(self.name) or (await self._locate(self.name))[0]
                result = await _session_call(
                    self.servers[server_name], self.timeout, lambda s: s.call_tool(self.name, dict(parameters))
                )
            texts = [c.text for c in result.content if getattr(c, "type", "") == "text"]
            text = "\n".join(texts) or "(no output)"
            if result.isError:
                text = "Error: " + text
            metrics = {"mcp_error": int(bool(result.isError))}
        except Exception as exc:  # the model sees the failure; the rollout goes on
            log.warning("MCP tool %s: %s: %s", self.name, type(exc).__name__, exc)
            text, metrics = f"Error: MCP tool {self.name} unavailable ({type(exc).__name__}: {exc})", {"mcp_error": 1}
            self._where.pop(self.name, None)
        metrics["seconds"] = time.monotonic() - start
        return ToolResponse(text=truncate(text, self.max_output_chars)), 0.0, metrics
