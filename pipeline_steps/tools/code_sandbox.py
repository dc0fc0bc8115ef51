"""A code-execution tool for verl's tool agent loop, speaking E2B through the pinned E2B code-interpreter SDK.

It works against any E2B-compatible service: E2B itself, Tencent AGS (``e2b_domain: ap-shanghai.tencentags.com``),
OpenKruise's sandbox-manager on ACK, or this project's local server (``python -m pipeline_steps sandbox-server``).
The tool config takes the keys of the Tencent guide's ``E2BCodeTool`` (``e2b_domain``, ``e2b_api_key``,
``e2b_template``, ``sandbox_timeout``, ``default_timeout``) plus ``e2b_api_url``, ``e2b_sandbox_url``,
``max_concurrency`` and ``max_output_chars``; empty ones fall back to ``E2B_DOMAIN``, ``E2B_API_KEY``,
``E2B_API_URL`` and ``E2B_SANDBOX_URL`` (keep keys out of config files: set them in the environment).

verl creates, executes and releases a tool instance around every single call, so each call gets a fresh
sandbox (killed on release) unless ``session: trajectory``, which keeps one sandbox per rollout trajectory
(variables persist across turns) and leaves it to expire after ``sandbox_timeout`` seconds.
Nothing raises out of ``execute``: sandbox, network and timeout failures come back as the tool's text.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

log = logging.getLogger(__name__)

DEFAULTS = {
    "e2b_template": "code-interpreter-v1",
    "sandbox_timeout": 300,  # seconds a sandbox lives (the guide's AGS setting)
    "default_timeout": 30,  # seconds one execution may take (the guide's AGS setting)
    "max_concurrency": 32,  # sandboxes in use at once by this process
    "max_output_chars": 2048,
    "session": "call",  # or "trajectory"
}


def format_execution(execution, max_chars: int) -> str:
    """stdout, the last expression's value, stderr and the error, in that order, cut to ``max_chars``."""
    parts = []
    stdout, stderr = "".join(execution.logs.stdout), "".join(execution.logs.stderr)
    if stdout:
        parts.append(stdout.rstrip("\n"))
    main = [r.text for r in execution.results if getattr(r, "is_main_result", False) and r.text]
    if main:
        parts.append(main[-1])
    if stderr:
        parts.append("[stderr]\n" + stderr.rstrip("\n"))
    if execution.error is not None:
        parts.append(f"[error] {execution.error.name}: {execution.error.value}")
    return truncate("\n".join(parts) or "(no output)", max_chars)


def truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    note = f"\n...[{len(text) - max_chars} characters cut]...\n"
    head = max(0, (max_chars - len(note)) * 2 // 3)
    tail = max(0, max_chars - len(note) - head)
    return text[:head] + note + (text[-tail:] if tail else "")


class CodeSandboxTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        cfg = {**DEFAULTS, **{k: v for k, v in (config or {}).items() if v is not None}}
        if cfg["session"] not in ("call", "trajectory"):
            raise ValueError(f"code sandbox tool: session must be 'call' or 'trajectory', not {cfg['session']!r}")
        self.template = str(cfg["e2b_template"])
        self.sandbox_timeout = int(cfg["sandbox_timeout"])
        self.exec_timeout = float(cfg["default_timeout"])
        self.max_output_chars = int(cfg["max_output_chars"])
        self.session = cfg["session"]
        self.max_concurrency = int(cfg["max_concurrency"])
        self._semaphore: asyncio.Semaphore | None = None
        self._connection = {
            "api_key": cfg.get("e2b_api_key") or os.environ.get("E2B_API_KEY"),
            "domain": cfg.get("e2b_domain") or os.environ.get("E2B_DOMAIN"),
            "api_url": cfg.get("e2b_api_url") or os.environ.get("E2B_API_URL"),
            "sandbox_url": cfg.get("e2b_sandbox_url") or os.environ.get("E2B_SANDBOX_URL"),
            "request_timeout": float(cfg.get("request_timeout", 30)),
        }
        self._sandboxes: dict[str, Any] = {}  # instance id (or trajectory id) -> AsyncSandbox
        self._last_used: dict[str, float] = {}

    @property
    def semaphore(self) -> asyncio.Semaphore:
        if self._semaphore is None:  # created in the rollout's event loop, not at construction
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        return self._semaphore

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        return instance_id or str(uuid4()), ToolResponse()

    def _key(self, instance_id: str, kwargs: dict) -> str:
        agent_data = kwargs.get("agent_data")
        if self.session == "trajectory" and agent_data is not None:
            return f"trajectory:{agent_data.request_id}"
        return instance_id

    async def _sandbox(self, key: str):
        from e2b_code_interpreter import AsyncSandbox

        sb = self._sandboxes.get(key)
        if sb is None:
            sb = await AsyncSandbox.create(
                template=self.template,
                timeout=self.sandbox_timeout,
                **{k: v for k, v in self._connection.items() if v is not None},
            )
            self._sandboxes[key] = sb
        self._last_used[key] = time.monotonic()
        return sb

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code") if isinstance(parameters, dict) else None
        if not isinstance(code, str) or not code.strip():
            return ToolResponse(text="Error: the 'code' argument must be a non-empty string of Python code."), 0.0, {}
        key = self._key(instance_id, kwargs)
        start = time.monotonic()
        metrics = {"sandbox_error": 0, "code_error": 0}
        try:
            async with self.semaphore:
                # Bounded here too: a stalled network must not hold the rollout past the execution timeout.
                async with asyncio.timeout(self.exec_timeout + self._connection["request_timeout"]):
                    sb = await self._sandbox(key)
                    execution = await sb.run_code(code, timeout=self.exec_timeout)
            text = format_execution(execution, self.max_output_chars)
            metrics["code_error"] = int(execution.error is not None)
        except Exception as exc:  # any failure of the sandbox service is the model's observation, not a crash
            log.warning("code sandbox: %s: %s", type(exc).__name__, exc)
            text = truncate(f"Error: code sandbox unavailable ({type(exc).__name__}: {exc})", self.max_output_chars)
            metrics["sandbox_error"] = 1
            await self._discard(key)
        metrics["seconds"] = time.monotonic() - start
        return ToolResponse(text=text), 0.0, metrics

    async def release(self, instance_id: str, **kwargs) -> None:
        if self.session == "call":
            await self._discard(instance_id)
        else:  # trajectory sandboxes expire on the service; forget those idle past their lifetime
            now = time.monotonic()
            for key in [k for k, t in self._last_used.items() if now - t > self.sandbox_timeout]:
                self._sandboxes.pop(key, None)
                self._last_used.pop(key, None)

    async def _discard(self, key: str) -> None:
        sb = self._sandboxes.pop(key, None)
        self._last_used.pop(key, None)
        if sb is not None:
            try:
                await sb.kill()
            except Exception as exc:  # it expires by itself anyway
                log.warning("code sandbox: kill failed: %s", exc)
