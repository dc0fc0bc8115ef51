"""A user rollout function in the shape of guide 002 (Model Studio's ``CalcXRolloutProcessor``: LangGraph + an MCP
tool) written as a verl agent loop: what a team ships when verl's ``tool_agent`` is not the rollout it wants.

Registered with verl's ``register`` as ``mcp_math_agent`` (importing the module is enough; an entry of an
``agent_loop_config_path`` file registered before the import keeps its settings) and listed in
``mcp_math_loop.yaml`` (verl's ``agent_loop_config_path`` format), whose entry also holds the loop's settings (Hydra
passes them to ``__init__``):

* ``mcp_servers_config_path``: an ``mcp_server.json`` (``{"mcpServers": {name: {"url", "api_key"}}}``, as the MCP
  tool reads it); ``mcp_tool``: the MCP tool the model may call (its schema is read from the server);
* ``tool_timeout_s``: seconds one MCP call may run once it has a slot; past it the call is abandoned, the tool turn
  says ``Error: ... timed out`` (recorded as a timeout) and the rollout goes on with the model's next turn;
* ``max_concurrent``: MCP calls in flight at once over all rollouts of the process (guide 002's function
  ``concurrency``); a call waits for a slot, and its timeout starts when it has one;
* ``max_turns``: assistant turns (default ``multi_turn.max_assistant_turns``); ``system_prompt``: added when the
  row has none.

Each turn: the model answers (verl's server interface), verl's tool parser (``multi_turn.format``) reads its tool
calls, the loop calls the MCP tool through the ``mcp`` client (streamable HTTP) and appends the answers as tool
messages; tokens are built by verl's own continuous-token helpers, so masks and prompts are what ``tool_agent``
would produce. The trajectory (the loop's name, messages, one record per call: arguments, seconds, timeout, error,
calls in flight when it started, its start time) is returned in ``extra_fields["trajectory"]`` as JSON; the CPU
trainer writes it into ``rollouts/<step>.jsonl`` with the other trajectories.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import weakref
from datetime import timedelta
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, _agent_loop_registry, register
from verl.experimental.agent_loop.tool_parser import ToolParser
from verl.tools.schemas import OpenAIFunctionToolSchema
from verl.utils.profiler import simple_timer

from pipeline_steps.tools.mcp_tool import load_servers

log = logging.getLogger(__name__)

NAME = "mcp_math_agent"
SYSTEM_PROMPT = (
    "You are a careful math solver. Call the `{tool}` tool to compute intermediate results; then give the final "
    "answer after ####."
)


class Gate:
    """At most ``cap`` calls at once in one event loop; counts calls in flight and the most seen at once."""

    def __init__(self, cap: int):
        self.cap = cap
        self.sem = asyncio.Semaphore(cap)
        self.in_flight = 0
        self.max_in_flight = 0

    async def __aenter__(self) -> int:
        await self.sem.acquire()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return self.in_flight

    async def __aexit__(self, *exc):
        self.in_flight -= 1
        self.sem.release()


# one gate per (event loop, loop name, cap): every rollout of a worker shares it (verl runs them in one event loop;
# the CPU trainer starts one event loop per step)
_GATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SCHEMAS: dict[tuple[str, str], OpenAIFunctionToolSchema] = {}


def gate(name: str, cap: int) -> Gate:
    per_loop = _GATES.setdefault(asyncio.get_running_loop(), {})
    return per_loop.setdefault((name, cap), Gate(cap))


async def _session(server: dict, timeout: float, fn):
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    async with streamablehttp_client(server["url"], headers=server["headers"], timeout=timeout) as (read, write, _):
        async with ClientSession(read, write, read_timeout_seconds=timedelta(seconds=timeout)) as session:
            await session.initialize()
            return await fn(session)


def register_keeping_config(name: str):
    """verl's ``register(name)``, except that an entry an ``agent_loop_config_path`` file registered first is kept.

    verl's worker registers the file's entries (with this loop's settings) before anything imports this module; the
    first rollout's instantiation imports it, and a plain ``@register`` would then replace the entry with a bare
    ``{_target_}``, so every later rollout would run with the defaults."""

    def decorator(cls):
        configured = _agent_loop_registry.get(name)
        register(name)(cls)
        if configured is not None:
            _agent_loop_registry[name] = configured
        return cls

    return decorator


@register_keeping_config(NAME)
class MCPMathAgentLoop(AgentLoopBase):
    def __init__(
        self,
        *args,
        name: str = NAME,
        mcp_servers_config_path: str | None = None,
        mcp_tool: str = "run_code_once",
        tool_timeout_s: float = 30.0,
        max_concurrent: int = 4,
        max_turns: int | None = None,
        system_prompt: str | None = SYSTEM_PROMPT,
        tools=None,  # verl's tool_config_path tools: this loop calls its MCP server itself
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if not mcp_servers_config_path:
            raise ValueError(f"agent loop {name}: set mcp_servers_config_path in its agent_loop_config_path entry")
        if float(tool_timeout_s) <= 0 or int(max_concurrent) < 1:
            raise ValueError(f"agent loop {name}: tool_timeout_s must be > 0 and max_concurrent >= 1")
        self.name = str(name)
        self.servers = load_servers(str(mcp_servers_config_path))
        self.mcp_tool = str(mcp_tool)
        self.tool_timeout_s = float(tool_timeout_s)
        self.max_concurrent = int(max_concurrent)
        multi_turn = self.rollout_config.multi_turn
        self.max_turns = int(max_turns or multi_turn.max_assistant_turns or 2)
        self.max_parallel_calls = int(multi_turn.max_parallel_calls or 1)
        self.max_tool_response_length = int(multi_turn.max_tool_response_length or 256)
        self.system_prompt = system_prompt
        self.response_length = int(self.rollout_config.response_length)
        self.tool_parser = ToolParser.get_tool_parser(multi_turn.format or "hermes", self.tokenizer)

    async def _schema(self) -> OpenAIFunctionToolSchema:
        """The MCP tool's schema from the first server offering it (cached per process)."""
        for server_name, server in self.servers.items():
            key = (server["url"], self.mcp_tool)
            if key not in _SCHEMAS:
                listed = await _session(server, self.tool_timeout_s, lambda s: s.list_tools())
                for t in listed.tools:
                    params = {k: v for k, v in t.inputSchema.items() if k in ("type", "properties", "required")}
                    fn = {"name": t.name, "description": t.description or t.name, "parameters": params}
                    _SCHEMAS[(server["url"], t.name)] = OpenAIFunctionToolSchema.model_validate(
                        {"type": "function", "function": fn}
                    )
            if key in _SCHEMAS:
                self._server = server
                return _SCHEMAS[key]
        raise ValueError(f"agent loop {self.name}: no MCP server in the config offers {self.mcp_tool!r}")

    async def _call(self, call) -> tuple[str, dict]:
        """One MCP call under the concurrency cap and the timeout; failures come back as the tool's text."""
        record: dict[str, Any] = {"name": call.name, "arguments": call.arguments, "timeout": False, "error": False}
        async with gate(self.name, self.max_concurrent) as in_flight:
            record.update(in_flight=in_flight, started=time.time())  # wall clock, to line calls up with others
            start = time.monotonic()
            try:
                if call.name != self.mcp_tool:
                    raise ValueError(f"unknown tool {call.name!r}; the tool is {self.mcp_tool}")
                args = json.loads(call.arguments)
                async with asyncio.timeout(self.tool_timeout_s):
                    result = await _session(
                        self._server, self.tool_timeout_s, lambda s: s.call_tool(self.mcp_tool, dict(args))
                    )
                text = "\n".join(c.text for c in result.content if getattr(c, "type", "") == "text") or "(no output)"
                if result.isError:
                    text, record["error"] = "Error: " + text, True
            except TimeoutError:
                text = f"Error: {self.mcp_tool} timed out after {self.tool_timeout_s:g} s"
                record.update(timeout=True, error=True)
            except Exception as exc:  # the model sees the failure; the rollout goes on
                text = f"Error: {self.mcp_tool} failed ({type(exc).__name__}: {exc})"
                record["error"] = True
            record["seconds"] = round(time.monotonic() - start, 4)
        if len(text) > self.max_tool_response_length:
            text = text[: self.max_tool_response_length] + "...(truncated)"
        return text, record

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        messages = [dict(m) for m in kwargs["raw_prompt"]]
        if self.system_prompt and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt.format(tool=self.mcp_tool)})
        schema = await self._schema()
        schemas = [schema.model_dump(exclude_unset=True, exclude_none=True)]
        metrics: dict[str, Any] = {}
        request_id = uuid4().hex
        ids = await self.ct_build_initial_tokens(messages, tools=schemas)
        mask: list[int] = []
        records: list[dict] = []
        assistant_turns = tool_turns = 0
        if self.tool_parser.stop_token_ids:
            stops = set(sampling_params.get("stop_token_ids") or []) | set(self.tool_parser.stop_token_ids)
            sampling_params = {**sampling_params, "stop_token_ids": sorted(stops)}
        while True:
            with simple_timer("generate_sequences", metrics):
                out = await self.server_manager.generate(
                    request_id=request_id, prompt_ids=ids, sampling_params=sampling_params
                )
            assistant_turns += 1
            merged, mask, _ = await self.ct_merge_assistant_token(ids, out.token_ids, mask, None)
            ids = merged.token_ids
            content, calls = await self.tool_parser.extract_tool_calls(out.token_ids, [schema])
            done = len(mask) >= self.response_length or assistant_turns >= self.max_turns or not calls
            calls = [] if done else calls[: self.max_parallel_calls]
            message: dict[str, Any] = {"role": "assistant", "content": content or ""}
            if calls:
                message["tool_calls"] = [
                    {"type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                    for c in calls
                ]
            messages.append(message)
            if done:
                break
            before = list(messages)
            with simple_timer("tool_calls", metrics):
                answers = await asyncio.gather(*[self._call(c) for c in calls])
            for text, record in answers:
                messages.append({"role": "tool", "content": text})
                records.append(record)
            merged, new_mask, _ = await self.ct_merge_context_msg(before, messages, ids, mask, None, tools=schemas)
            if len(new_mask) >= self.response_length:
                break
            ids, mask = merged.token_ids, new_mask
            tool_turns += 1
        cut = len(ids) - len(mask)
        trajectory = {"agent_name": self.name, "messages": messages, "tool_records": records}
        return AgentLoopOutput(
            prompt_ids=ids[:cut],
            response_ids=ids[cut:][: self.response_length],
            response_mask=mask[: self.response_length],
            num_turns=tool_turns + assistant_turns + 1,  # as verl counts: user, assistant and tool turns
            metrics=metrics,
            extra_fields={"trajectory": json.dumps(trajectory, ensure_ascii=False)},
        )


def _arguments(text: str):
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text
