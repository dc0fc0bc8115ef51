"""Multi-turn rollouts for the CPU trainer through verl's own agent loops.

With ``actor_rollout_ref.rollout.multi_turn.enable`` on, every row is rolled out by the agent loop its ``agent_name``
names (``rollout.agent.default_agent_loop`` when it has none), instantiated from verl's registry exactly as verl's
``AgentLoopWorker`` does, with the tools of ``multi_turn.tool_config_path`` loaded by verl's tool registry. The
trainer's model answers through verl's async server interface (:class:`~pipeline_steps.local.agent_server
.HFAsyncServer`). The result has the trainer's batch layout, so the rest of the GRPO step is unchanged: responses hold
the model's and the tools' tokens, ``response_mask`` is verl's (0 on tool tokens, so they take no part in the loss),
``attention_mask`` covers all of them.

A preset's own agent loops (``rollout.agent.agent_loop_config_path``: a shipped ``pkg:`` file or a deployment's
path) are registered as verl's ``AgentLoopWorker`` registers them: the file's ``{name, _target_, ...}`` entries go
into verl's registry by name.

Besides tensors, each sample keeps a readable trajectory (the loop's name, turns, tool calls, tool outputs) for the
trajectory files: ``tool_agent``'s from its messages, another loop's from the JSON it returns in
``extra_fields["trajectory"]`` (``{agent_name, messages, tool_records}``, as :mod:`pipeline_steps.rollouts
.mcp_math_loop` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable

from pipeline_steps import library_env
from pipeline_steps.errors import UserError
from pipeline_steps.local.agent_server import HFAsyncServer

log = logging.getLogger(__name__)
CAPACITY_REFUSED = "sandbox_capacity_refused"  # pipeline_steps.tools.code_sandbox's count (verl-free import here)

# Tool answers that are failures: our code tool's ("[error] Name: ..." when the code raised, "Error: ..." when the
# tool or the sandbox failed) and verl's own ("Unknown function ...", "Invalid JSON in arguments ...").
_TOOL_ERROR = re.compile(r"^(Error:|Unknown function|Invalid JSON in arguments)|\[error\]")


def is_tool_error(text: str) -> bool:
    return bool(_TOOL_ERROR.search(text or ""))


def enabled(cfg) -> bool:
    return bool(cfg.actor_rollout_ref.rollout.multi_turn.get("enable", False))


class AgentRollout:
    """:param server_factory: ``fn(model, tokenizer) -> server`` with verl's ``generate`` interface; tests wrap the
    model's server to script a turn."""

    def __init__(self, cfg, model, tokenizer, eos_ids: list[int], server_factory: Callable | None = None):
        from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

        self.cfg = cfg
        self.tokenizer = tokenizer
        ro = cfg.actor_rollout_ref.rollout
        self.response_length = int(ro.response_length)
        self.default_agent = str(ro.agent.get("default_agent_loop") or "single_turn_agent")
        self.registry = _agent_loop_registry
        register_agent_loops(ro.agent.get("agent_loop_config_path"))
        path = ro.multi_turn.get("tool_config_path")
        self.tools = []
        if path:
            from verl.tools.tool_registry import initialize_tools_from_config

            from pipeline_steps.tools import resolve_config_path

            try:
                self.tools = initialize_tools_from_config(resolve_config_path(path))
            except (OSError, ValueError, ImportError, AttributeError) as exc:
                raise UserError(
                    f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path}: {type(exc).__name__}: {exc}"
                ) from None
        self.server = (server_factory or _default_server)(model, tokenizer, eos_ids)

    def _loop(self, agent_name: str):
        import hydra
        from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
        from verl.utils.dataset.rl_dataset import RLHFDataset

        if agent_name not in self.registry:
            raise UserError(f"agent_name {agent_name!r}: not a verl agent loop; use one of {sorted(self.registry)}")
        return hydra.utils.instantiate(
            config=self.registry[agent_name],
            trainer_config=DictConfigWrap(config=self.cfg),
            server_manager=self.server,
            tokenizer=self.tokenizer,
            processor=None,
            dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(self.cfg.data),
            tools=ToolListWrap(self.tools),
        )

    async def _one(self, prompt, sampling_params: dict) -> tuple:
        agent_name = prompt.agent_name or self.default_agent
        loop = self._loop(agent_name)
        seen: list = []
        pending = getattr(loop, "_handle_pending_state", None)
        if pending is not None:  # tool agent: keep its AgentData (messages, tool calls, tool answers) to read after

            async def observe(agent_data, sp):
                seen.append(agent_data)
                return await pending(agent_data, sp)

            loop._handle_pending_state = observe
        extra = prompt.extra_info or {}
        out = await loop.run(
            dict(sampling_params),
            raw_prompt=list(prompt.messages),
            tools_kwargs=extra.get("tools_kwargs") or {},  # as verl's RLHFDataset passes them
            extra_info=extra,
        )
        own = _own_trajectory(out)
        if own is not None:  # a loop that records its own trajectory
            return out, dict(own, agent_name=str(own.get("agent_name") or agent_name))
        return out, {"agent_name": agent_name, "messages": seen[0].messages if seen else None}

    async def _all(self, prompts, n: int, sampling_params: dict):
        try:
            return await asyncio.gather(*[self._one(p, sampling_params) for p in prompts for _ in range(n)])
        finally:  # every trajectory has ended: a tool that holds something per trajectory lets it go now
            for tool in self.tools:
                if hasattr(tool, "end_rollout"):
                    await tool.end_rollout()

    def _tool_counts(self) -> dict[str, int]:
        """The counts the tools kept during the rollout (the code tool's ``sandbox_capacity_refused``), summed;
        verl's ``ToolAgentLoop`` drops the metrics ``execute`` returns, so they are read from the tools."""
        counts: dict[str, int] = {}
        for tool in self.tools:
            for k, v in (tool.take_counts() if hasattr(tool, "take_counts") else {}).items():
                counts[k] = counts.get(k, 0) + int(v)
        return counts

    def generate(self, prompts, n: int, *, temperature: float, top_p: float, top_k: int, seed: int):
        """The trainer's batch for ``prompts`` x ``n`` (interleaved like verl's repeat), plus trajectories."""
        import numpy as np
        import torch

        # verl's AgentLoopWorker sampling parameters; greedy is temperature 0
        sp = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
        sp["max_tokens"] = self.response_length  # the loop itself stops at response_length over all turns
        torch.manual_seed(seed)
        self._tool_counts()  # counts from before this rollout are not its own
        results = asyncio.run(self._all(prompts, n, sp))
        tool_counts = self._tool_counts()
        refused = tool_counts.get(CAPACITY_REFUSED, 0)
        if refused:  # once per step: the calls failed, and the run would say nothing else
            log.warning(
                "%d code tool calls this step were refused by the sandbox service for capacity (scored as failed "
                "calls; metric tool/%s): fewer sandboxes at once (data.train_batch_size x actor_rollout_ref.rollout.n "
                "in session: trajectory, else the tool's max_concurrency) or a larger sandbox service",
                refused,
                CAPACITY_REFUSED,
            )
        pad = self.tokenizer.pad_token_id
        width_p = max(len(o.prompt_ids) for o, _ in results)
        rows = len(results)
        prompt_t = torch.full((rows, width_p), pad, dtype=torch.long)
        prompt_a = torch.zeros((rows, width_p), dtype=torch.long)
        resp = torch.full((rows, self.response_length), pad, dtype=torch.long)
        resp_a = torch.zeros((rows, self.response_length), dtype=torch.long)
        resp_m = torch.zeros((rows, self.response_length), dtype=torch.long)
        trajectories = []
        for i, (o, seen) in enumerate(results):
            p, r = len(o.prompt_ids), len(o.response_ids)
            prompt_t[i, width_p - p :] = torch.tensor(o.prompt_ids)  # left padded, as verl's postprocess
            prompt_a[i, width_p - p :] = 1
            resp[i, :r] = torch.tensor(o.response_ids)
            resp_a[i, :r] = 1
            resp_m[i, :r] = torch.tensor(o.response_mask)
            trajectories.append(self._trajectory(o, seen))
        return {
            "prompts": prompt_t,
            "responses": resp,
            "input_ids": torch.cat([prompt_t, resp], 1),
            "attention_mask": torch.cat([prompt_a, resp_a], 1),
            "response_mask": resp_m,
            "items": [p for p in prompts for _ in range(n)],
            "uids": [str(j) for j in range(len(prompts)) for _ in range(n)],
            "num_turns": [int(o.num_turns) for o, _ in results],
            "extra_fields": [dict(o.extra_fields or {}) for o, _ in results],  # the loop's turn_scores, tool_rewards
            "tool_call_counts": np.array([len(t["tool_calls"]) for t in trajectories], dtype=np.int32),
            "trajectories": trajectories,
            "loop_timings": [_timings(o) for o, _ in results],
            "tool_counts": tool_counts,
        }

    def _trajectory(self, out, seen: dict) -> dict:
        """The loop's name, turns as the model saw them (token segments split by the response mask), the tool calls
        the loop parsed and the tools' answers (``timeout`` from a loop's own call records)."""
        messages = seen.get("messages")
        records = seen.get("tool_records") or []
        turns, seg, cur = [], [], None
        for tok, m in zip(out.response_ids, out.response_mask):
            if cur is not None and m != cur:
                turns.append(self._turn(cur, seg))
                seg = []
            cur = m
            seg.append(tok)
        if seg:
            turns.append(self._turn(cur, seg))
        calls, outputs = [], []
        for msg in messages or []:
            for call in msg.get("tool_calls") or []:
                fn = call.get("function") or {}
                args = fn.get("arguments")
                calls.append({"name": fn.get("name"), "arguments": args if isinstance(args, dict) else str(args)})
            if msg.get("role") == "tool":
                text = msg.get("content") if isinstance(msg.get("content"), str) else json.dumps(msg.get("content"))
                outputs.append({"text": text, "error": is_tool_error(text)})
        for o, r in zip(outputs, records):
            if isinstance(r, dict):
                o.update(timeout=bool(r.get("timeout")), seconds=r.get("seconds"), started=r.get("started"))
        return {"agent_name": seen.get("agent_name"), "turns": turns, "tool_calls": calls, "tool_outputs": outputs}

    def _turn(self, mask_value: int, ids: list[int]) -> dict:
        return {"role": "assistant" if mask_value else "tool", "text": self.tokenizer.decode(ids)}


def register_agent_loops(path) -> list[str]:
    """Register the agent loops of ``agent_loop_config_path`` as verl's ``AgentLoopWorker`` does (its
    ``resolve_config_path``, ``OmegaConf.load``, each entry into ``_agent_loop_registry`` under its ``name``);
    ``pkg:`` names a file the package ships. The names registered; UserError in one line for a bad file."""
    if not path:
        return []
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.utils.import_utils import resolve_config_path as verl_resolve

    from pipeline_steps.tools import resolve_config_path

    where = f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path}"
    try:
        configs = OmegaConf.load(verl_resolve(resolve_config_path(path)))
        names = []
        for entry in configs:
            _agent_loop_registry[entry.name] = entry
            names.append(str(entry.name))
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
        raise UserError(
            f"{where}: {type(exc).__name__}: {exc}; expected a YAML list of {{name, _target_}} entries"
        ) from None
    except Exception as exc:  # omegaconf's own errors (a missing key, a bad interpolation)
        if type(exc).__module__.startswith("omegaconf"):
            raise UserError(f"{where}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
        raise
    return names


def _own_trajectory(out) -> dict | None:
    text = (out.extra_fields or {}).get("trajectory")
    if not isinstance(text, str):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _timings(out) -> dict[str, float]:
    """The seconds verl's agent loop itself timed in one rollout (``AgentLoopOutput.metrics``)."""
    m = out.metrics
    m = m.model_dump() if hasattr(m, "model_dump") else dict(m or {})
    return {k: float(m.get(k) or 0.0) for k in TIMED}


TIMED = ("generate_sequences", "tool_calls")  # what verl's ToolAgentLoop times with simple_timer


def metrics(batch: dict) -> dict:
    """Tool use of one step: share of samples calling a tool, calls and failed calls (verl's ``tool_call_counts/*``
    come from ``compute_data_metrics``), calls the sandbox service refused for capacity
    (``tool/sandbox_capacity_refused``, among the failed ones); and the agent loop's timings under the names verl's
    AgentLoopManager gives them on the cluster (``timing_s/agent_loop/<generate_sequences|tool_calls>/<min|max|mean>``),
    so a local run and a cluster run show the time in tools against the time generating the same way."""
    trajectories = batch.get("trajectories") or []
    if not trajectories:
        return {}
    calls = sum(len(t["tool_calls"]) for t in trajectories)
    errors = sum(o["error"] for t in trajectories for o in t["tool_outputs"])
    timeouts = sum(bool(o.get("timeout")) for t in trajectories for o in t["tool_outputs"])
    answered = sum(len(t["tool_outputs"]) for t in trajectories)
    out = {
        "tool/call_rate": sum(bool(t["tool_calls"]) for t in trajectories) / len(trajectories),
        "tool/calls": float(calls),
        "tool/errors": float(errors),
        "tool/error_rate": errors / answered if answered else 0.0,
        "tool/timeouts": float(timeouts),
    }
    if "tool_counts" in batch:  # calls the sandbox service refused for capacity (also counted in tool/errors)
        out[f"tool/{CAPACITY_REFUSED}"] = float(batch["tool_counts"].get(CAPACITY_REFUSED, 0))
    timings = batch.get("loop_timings") or []
    for name in TIMED if timings else ():
        values = [t[name] for t in timings]
        out[f"timing_s/agent_loop/{name}/min"] = min(values)
        out[f"timing_s/agent_loop/{name}/max"] = max(values)
        out[f"timing_s/agent_loop/{name}/mean"] = sum(values) / len(values)
    return out


def _default_server(model, tokenizer, eos_ids):
    return HFAsyncServer(model, tokenizer, eos_ids=eos_ids, with_log_probs=False)


_E2B_ENDPOINT = ("E2B_DOMAIN", "E2B_API_URL")
MCP_CONFIG_ENV = "MCP_SERVERS_CONFIG"  # the mcp_server.json the MCP tool and the MCP agent loop read
MCP_LOOP = "pipeline_steps.rollouts.mcp_math_loop"


def _uses_code_tool(cfg) -> bool:
    path = cfg.actor_rollout_ref.rollout.multi_turn.get("tool_config_path") if enabled(cfg) else None
    if not path:
        return False
    from pipeline_steps.tools import uses_code_sandbox

    return uses_code_sandbox(path)


def _needs_local_mcp(cfg) -> bool:
    """Our MCP agent loop with its servers file left to ``$MCP_SERVERS_CONFIG``, which is unset."""
    path = cfg.actor_rollout_ref.rollout.agent.get("agent_loop_config_path") if enabled(cfg) else None
    if not path or os.environ.get(MCP_CONFIG_ENV):
        return False
    from pipeline_steps.tools import resolve_config_path

    try:
        text = Path(resolve_config_path(path)).read_text(errors="replace")
    except (OSError, UserError):
        return False
    return MCP_LOOP in text and MCP_CONFIG_ENV in text


@contextlib.contextmanager
def local_mcp_server(directory: Path, exec_timeout: float = 30.0):
    """Our MCP code server (``pipeline_steps.tools.mcp_code_server``) on a free local port, its sandboxes from the
    ``E2B_*`` settings in the environment; ``$MCP_SERVERS_CONFIG`` names an ``mcp_server.json`` for it meanwhile."""
    import secrets
    import socket
    import subprocess
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pipeline_steps.tools.mcp_code_server", "--port", str(port)]
    cmd += ["--exec-timeout", str(exec_timeout)]
    log = open(directory / "mcp-server.log", "wb")
    token = secrets.token_hex(16)  # the server refuses a caller without it (issue 46); the loop sends it
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "MCP_SERVER_TOKEN": token})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the local MCP code server did not start (log: {log.name})") from None
                time.sleep(0.2)
        servers = directory / "mcp_server.json"
        url = f"http://127.0.0.1:{port}/mcp"
        servers.write_text(json.dumps({"mcpServers": {"sandbox": {"url": url, "api_key": "$MCP_SERVER_TOKEN"}}}))
        print(f"started the local MCP code server for the agent loop: http://127.0.0.1:{port}/mcp", file=sys.stderr)
        with library_env.scoped({MCP_CONFIG_ENV: str(servers), "MCP_SERVER_TOKEN": token}):
            yield servers
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def local_sandbox(cfg, hide=()):
    """The local profile's sandbox server for the run, started on demand like the local Ray cluster: when multi-turn
    is on, the tool config uses our code sandbox tool or the agent loop config our MCP loop (its servers file left to
    an unset ``$MCP_SERVERS_CONFIG``), and no E2B endpoint is configured (``E2B_DOMAIN`` or ``E2B_API_URL``); the
    ``E2B_*`` settings point the tools at it while the run lasts. For the MCP loop, the local MCP code server runs
    too (on the configured E2B service when there is one), and ``$MCP_SERVERS_CONFIG`` points the loop at it."""
    mcp = _needs_local_mcp(cfg)
    if not (mcp or _uses_code_tool(cfg)):
        yield None
        return
    with contextlib.ExitStack() as stack:
        # state outside the hidden run directory (a sandbox's own directory lives in it)
        state = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sandboxes-")))
        server = None
        if not any(os.environ.get(k) for k in _E2B_ENDPOINT):
            if os.geteuid() != 0:
                raise UserError(
                    "the code sandbox tool needs a sandbox service: set E2B_API_KEY and E2B_DOMAIN (or E2B_API_URL), "
                    "or run as root so the local sandbox server can start"
                )
            from pipeline_steps.sandbox.launcher import LocalSandboxServer

            server = stack.enter_context(LocalSandboxServer(state / "state", args=["--warm", "2"], hide=hide))
            stack.enter_context(library_env.scoped(server.env()))
            # stderr: a step's stdout is its JSON summary; the line tells the log reader where tool calls went
            print(
                f"started the local sandbox server for the code tool: {server.env().get('E2B_API_URL')}",
                file=sys.stderr,
            )
        if mcp:
            stack.enter_context(local_mcp_server(state))
        yield server
