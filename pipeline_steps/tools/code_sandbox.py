"""A code-execution tool for verl's tool agent loop, speaking E2B through the pinned E2B code-interpreter SDK.

It works against any E2B-compatible service: E2B itself, Tencent AGS (``e2b_domain: ap-shanghai.tencentags.com``),
OpenKruise's sandbox-manager on ACK, or this project's local server (``python -m pipeline_steps sandbox-server``).
The tool config takes the keys of the Tencent guide's ``E2BCodeTool`` (``e2b_domain``, ``e2b_api_key``,
``e2b_template``, ``sandbox_timeout``, ``default_timeout``) plus ``e2b_api_url``, ``e2b_sandbox_url``,
``max_concurrency`` and ``max_output_chars``; empty ones fall back to ``E2B_DOMAIN``, ``E2B_API_KEY``,
``E2B_API_URL`` and ``E2B_SANDBOX_URL`` (keep keys out of config files: set them in the environment).

verl creates, executes and releases a tool instance around every single call, so each call gets a fresh
sandbox (killed on release) unless ``session: trajectory``, which keeps one sandbox per rollout trajectory
(variables persist across turns). verl's ``ToolAgentLoop`` has no hook for a trajectory's end, and its
``release`` is per call; a trajectory lives exactly as long as its ``AgentData`` (the object verl passes to
``execute``, dropped when the loop's ``run`` returns), so its sandbox is killed when that object goes
(``weakref.finalize``), on the event loop the sandbox was made on; the CPU trainer also calls
:meth:`CodeSandboxTool.end_rollout` after each rollout. ``sandbox_timeout`` is only the service's backstop.

Nothing raises out of ``execute``: sandbox, network and timeout failures come back as the tool's text. A sandbox the
service refuses for capacity (429 ``RateLimitException``, E2B's concurrency limit; 503 ``ServiceBusyException``,
the local server's "all N sandboxes are in use") is counted: ``execute``'s metrics have
``sandbox_capacity_refused``, and :meth:`CodeSandboxTool.take_counts` gives the counts since it was last called
(verl 0.9.1's ``ToolAgentLoop`` drops ``execute``'s metrics, so the CPU trainer reads these for its step metrics;
elsewhere the tool warns itself, at most once a minute).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import weakref
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
CAPACITY_REFUSED = "sandbox_capacity_refused"  # the count's name in execute's metrics and take_counts()
WARN_EVERY_S = 60.0  # the tool's own capacity warning, when nobody collects the counts per step


def is_capacity_refusal(exc: BaseException) -> bool:
    """The sandbox service has no sandbox free: E2B's concurrency limit (429) or a full pool (503)."""
    from e2b.exceptions import RateLimitException, ServiceBusyException

    return isinstance(exc, (RateLimitException, ServiceBusyException))


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
        self._semaphore_loop: asyncio.AbstractEventLoop | None = None
        self._connection = {
            "api_key": cfg.get("e2b_api_key") or os.environ.get("E2B_API_KEY"),
            "domain": cfg.get("e2b_domain") or os.environ.get("E2B_DOMAIN"),
            "api_url": cfg.get("e2b_api_url") or os.environ.get("E2B_API_URL"),
            "sandbox_url": cfg.get("e2b_sandbox_url") or os.environ.get("E2B_SANDBOX_URL"),
            "request_timeout": float(cfg.get("request_timeout", 30)),
        }
        self._sandboxes: dict[str, Any] = {}  # instance id (or trajectory key) -> AsyncSandbox
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}  # key -> the event loop its sandbox was made on
        self._creating: dict[str, asyncio.Lock] = {}  # trajectory key -> one create at a time (parallel calls)
        self._trajectories: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # AgentData -> key
        self._ending: set = set()  # kills scheduled for trajectories that ended
        self._counts = {CAPACITY_REFUSED: 0, "trajectory_sandboxes_killed": 0}
        self._counts_lock = threading.Lock()
        self._collected = False  # take_counts() was called: the caller reports refusals per step
        self._refused_unreported = 0
        self._warned_at = float("-inf")

    @property
    def semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._semaphore_loop is not loop:
            # one per event loop: the CPU trainer runs each step's rollout in a loop of its own, and a semaphore
            # that once waited is bound to the loop it waited in
            self._semaphore, self._semaphore_loop = asyncio.Semaphore(self.max_concurrency), loop
        return self._semaphore

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        return instance_id or str(uuid4()), ToolResponse()

    def _key(self, instance_id: str, kwargs: dict) -> str:
        agent_data = kwargs.get("agent_data")
        if self.session != "trajectory" or agent_data is None:
            return instance_id
        loop_module = sys.modules.get("verl.experimental.agent_loop.tool_agent_loop")
        if loop_module is None or not isinstance(agent_data, loop_module.AgentData):
            # another loop's object, whose lifetime says nothing: its request id, until end_rollout or the timeout
            return f"trajectory:{agent_data.request_id}"
        key = self._trajectories.get(agent_data)
        if key is None:
            # not the request id alone: the CPU trainer's loops all get "det-0" under rollout.full_determinism
            key = f"trajectory:{agent_data.request_id}:{uuid4().hex[:12]}"
            self._trajectories[agent_data] = key
            self._loops[key] = asyncio.get_running_loop()
            weakref.finalize(agent_data, self._trajectory_ended, key).atexit = False  # at exit: the timeout
        return key

    async def _sandbox(self, key: str):
        from e2b_code_interpreter import AsyncSandbox

        sb = self._sandboxes.get(key)
        if sb is not None:
            return sb
        lock = self._creating.setdefault(key, asyncio.Lock()) if key.startswith("trajectory:") else None
        async with lock or _NO_LOCK:  # a trajectory's parallel calls share one sandbox, not one each
            sb = self._sandboxes.get(key)
            if sb is None:
                sb = await AsyncSandbox.create(
                    template=self.template,
                    timeout=self.sandbox_timeout,
                    **{k: v for k, v in self._connection.items() if v is not None},
                )
                self._sandboxes[key] = sb
                self._loops.setdefault(key, asyncio.get_running_loop())
        return sb

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code") if isinstance(parameters, dict) else None
        if not isinstance(code, str) or not code.strip():
            return ToolResponse(text="Error: the 'code' argument must be a non-empty string of Python code."), 0.0, {}
        key = self._key(instance_id, kwargs)
        start = time.monotonic()
        metrics = {"sandbox_error": 0, "code_error": 0, CAPACITY_REFUSED: 0}
        try:
            async with self.semaphore:
                # Bounded here too: a stalled network must not hold the rollout past the execution timeout.
                async with asyncio.timeout(self.exec_timeout + self._connection["request_timeout"]):
                    sb = await self._sandbox(key)
                    execution = await sb.run_code(code, timeout=self.exec_timeout)
            text = format_execution(execution, self.max_output_chars)
            metrics["code_error"] = int(execution.error is not None)
        except Exception as exc:  # any failure of the sandbox service is the model's observation, not a crash
            metrics["sandbox_error"] = 1
            if is_capacity_refusal(exc):
                metrics[CAPACITY_REFUSED] = 1
                self._refused(exc)
                what = f"the sandbox service is at capacity ({type(exc).__name__}: {exc})"
            else:
                log.warning("code sandbox: %s: %s", type(exc).__name__, exc)
                what = f"{type(exc).__name__}: {exc}"
            text = truncate(f"Error: code sandbox unavailable ({what})", self.max_output_chars)
            await self._discard(key)
        metrics["seconds"] = time.monotonic() - start
        return ToolResponse(text=text), 0.0, metrics

    def _refused(self, exc: Exception) -> None:
        with self._counts_lock:
            self._counts[CAPACITY_REFUSED] += 1
            self._refused_unreported += 1
            now = time.monotonic()
            if self._collected or now - self._warned_at < WARN_EVERY_S:
                log.debug("code sandbox: refused for capacity: %s", exc)
                return
            count, self._refused_unreported, self._warned_at = self._refused_unreported, 0, now
        log.warning(
            "code sandbox: the sandbox service refused %d sandbox(es) for capacity (%s); those calls failed. Fewer "
            "trajectories at once (data.train_batch_size x actor_rollout_ref.rollout.n in session: trajectory), a "
            "lower max_concurrency, or a larger service",
            count,
            exc,
        )

    def take_counts(self) -> dict[str, int]:
        """The counts since the last call (``sandbox_capacity_refused``, ``trajectory_sandboxes_killed``), reset.
        A caller that reports them per step takes over the capacity warning."""
        with self._counts_lock:
            self._collected = True
            out = dict(self._counts)
            self._counts = dict.fromkeys(self._counts, 0)
        return out

    async def release(self, instance_id: str, **kwargs) -> None:
        if self.session == "call":
            await self._discard(instance_id)
        # trajectory mode: release is per call; the sandbox goes when its trajectory ends (_trajectory_ended)

    def _trajectory_ended(self, key: str) -> None:
        """The trajectory's AgentData is gone (finalizer: may run in any thread, also at garbage collection):
        its sandbox is killed on the event loop it was made on, or, with that loop closed, from a thread."""
        loop = self._loops.get(key)
        try:
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._end_soon, key)
                return
        except RuntimeError:  # closed meanwhile
            pass
        self._loops.pop(key, None)
        self._creating.pop(key, None)
        sb = self._sandboxes.pop(key, None)
        if sb is not None:
            threading.Thread(target=self._kill_by_id, args=(sb.sandbox_id,), daemon=True).start()

    def _end_soon(self, key: str) -> None:
        if key not in self._sandboxes:
            self._loops.pop(key, None)
            self._creating.pop(key, None)
            return
        task = asyncio.get_running_loop().create_task(self._discard(key, ended=True))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def end_rollout(self) -> None:
        """After a rollout whose trajectories have all ended (the CPU trainer's step): the kills their ends
        scheduled are awaited, and any trajectory sandbox still held (an AgentData kept alive by a reference cycle
        until the next garbage collection) is killed now."""
        loop = asyncio.get_running_loop()
        pending = [t for t in self._ending if t.get_loop() is loop]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        held = [k for k in self._sandboxes if k.startswith("trajectory:") and self._loops.get(k) in (loop, None)]
        await asyncio.gather(*(self._discard(k, ended=True) for k in held))

    async def _discard(self, key: str, ended: bool = False) -> None:
        sb = self._sandboxes.pop(key, None)
        if ended:
            self._loops.pop(key, None)
            self._creating.pop(key, None)
        if sb is not None:
            try:
                await sb.kill()
                if ended:
                    with self._counts_lock:
                        self._counts["trajectory_sandboxes_killed"] += 1
            except Exception as exc:  # it expires by itself anyway
                log.warning("code sandbox: kill failed: %s", exc)

    def _kill_by_id(self, sandbox_id: str) -> None:
        """The sandbox's kill through the SDK's synchronous API (its event loop is gone)."""
        try:
            from e2b import Sandbox

            api = {k: v for k, v in self._connection.items() if k != "sandbox_url" and v is not None}
            Sandbox.kill(sandbox_id, **api)
        except Exception as exc:  # it expires by itself anyway
            log.warning("code sandbox: kill of %s failed: %s", sandbox_id, exc)


class _NoLock:
    async def __aenter__(self):
        return None

    async def __aexit__(self, *exc):
        return False


_NO_LOCK = _NoLock()
