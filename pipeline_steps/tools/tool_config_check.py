"""Pre-flight of a verl tool config (``actor_rollout_ref.rollout.multi_turn.tool_config_path``) on CPU, without
building any tool (an MCP tool would contact its server): the YAML's shape, each ``class_name`` importable and a
``BaseTool``, ``config.type: native`` (verl 0.9.1 knows no other), each ``tool_schema`` valid for verl; and, for the
code sandbox tool, the sandboxes a rollout holds at once against the sandbox service's capacity
(:func:`check_sandbox_capacity`)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import urllib.request
from pathlib import Path

from pipeline_steps.errors import UserError

log = logging.getLogger(__name__)
KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
TRUSTED = ("pipeline_steps.tools.", "verl.tools.")  # modules imported to check their class; others only located


def check_tool_config(path: str) -> list[str]:
    """The tool names the config declares (schema-less entries count by class); UserError on the first problem."""
    import yaml
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema

    try:
        spec = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"{KEY}={path}: not a readable YAML file ({type(exc).__name__})") from None
    tools = spec.get("tools") if isinstance(spec, dict) else None
    if not isinstance(tools, list) or not tools:
        raise UserError(f"{KEY}={path}: expected a non-empty 'tools:' list")
    names = []
    for i, entry in enumerate(tools):
        where = f"{KEY}={path} tools[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise UserError(f"{where}: needs a class_name")
        module_name, _, class_name = entry["class_name"].rpartition(".")
        try:
            if module_name.startswith(TRUSTED):
                cls = getattr(importlib.import_module(module_name), class_name)
                if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
                    raise UserError(f"{where}: {entry['class_name']!r} is not a verl BaseTool")
            elif importlib.util.find_spec(module_name) is None:  # other code is located, not run, here
                raise ImportError(module_name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise UserError(f"{where}: class {entry['class_name']!r} not importable ({type(exc).__name__})") from None
        config = entry.get("config") or {}
        if config.get("type") != "native":
            raise UserError(f"{where}: config.type must be 'native' (verl 0.9.1 has no other tool type)")
        if entry.get("tool_schema") is not None:
            try:
                names.append(OpenAIFunctionToolSchema.model_validate(entry["tool_schema"]).function.name)
            except Exception as exc:
                first = str(exc).splitlines()[0]
                raise UserError(f"{where}: tool_schema is not a valid OpenAI function schema ({first})") from None
        else:
            names.append(entry["class_name"])
    return names


def check_multi_turn(cfg, backend: str | None = None, cluster_service: tuple[int | None, str] | None = None) -> dict:
    """For the pre-flight: the tool config when multi-turn is on and the file is readable here (a path that only
    exists in the training image is left to the cluster), and the code tool's sandboxes against the service's
    capacity (``backend``: ``local`` or ``cluster``, else taken from the rollout engine; ``cluster_service``: the
    cluster's sandbox service as ``(capacity or None, where it comes from)``, resolved by the training layer from the
    preset's ``cluster.sandbox_service``: :func:`pipeline_steps.training.sandbox_services.sandbox_service_capacity`)."""
    mt = cfg.actor_rollout_ref.rollout.get("multi_turn") or {}
    path = mt.get("tool_config_path")
    if mt.get("enable") and path:
        from pipeline_steps.tools import resolve_config_path

        path = resolve_config_path(path)  # pkg: names a shipped config; a missing one fails here
    if not mt.get("enable") or not path or not Path(str(path)).is_file():
        return {}
    out = {"tools": check_tool_config(str(path))}
    sandboxes = check_sandbox_capacity(cfg, str(path), backend, cluster_service)
    if sandboxes:
        out["sandboxes"] = sandboxes
    return out


# -- sandbox capacity ---------------------------------------------------------------------------------

ROLLOUT = "actor_rollout_ref.rollout"


def _code_tool_config(path: str) -> dict | None:
    """The code sandbox tool's settings in the tool config (its defaults filled in), or None without that tool."""
    import yaml

    from pipeline_steps.tools import CODE_SANDBOX_TOOL

    spec = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    for entry in spec.get("tools") or []:
        if entry.get("class_name") == CODE_SANDBOX_TOOL:
            from pipeline_steps.tools.code_sandbox import DEFAULTS

            config = entry.get("config") or {}
            return {**DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    return None


def sandboxes_at_once(cfg, tool: dict, backend: str) -> tuple[int, str]:
    """The sandboxes one training step's rollout holds at once, and how that figure comes about (the settings).

    ``session: trajectory``: every trajectory of the step (``data.train_batch_size x rollout.n``) holds its sandbox
    from its first call to its end, and they run together. ``session: call``: a sandbox lives for one call; at most
    the calls in flight: every trajectory's parallel calls, bounded by ``max_concurrency`` per rollout process (one
    on the local backend, ``rollout.agent.num_workers`` on the cluster)."""
    ro = cfg.actor_rollout_ref.rollout
    batch, n = int(cfg.data.train_batch_size), int(ro.n)
    trajectories = f"data.train_batch_size={batch} x {ROLLOUT}.n={n}"
    if tool["session"] == "trajectory":
        return batch * n, f"{trajectories} trajectories each hold a sandbox (session: trajectory)"
    parallel = int(ro.multi_turn.get("max_parallel_calls") or 1)
    workers = 1 if backend == "local" else int((ro.get("agent") or {}).get("num_workers") or 1)
    concurrency = int(tool["max_concurrency"])
    calls = batch * n * parallel
    at_once = min(calls, concurrency * workers)
    how = f"session: call, {trajectories} x {ROLLOUT}.multi_turn.max_parallel_calls={parallel} calls, of which "
    how += f"max_concurrency={concurrency} per rollout process x {workers} process(es)"
    how += f" ({ROLLOUT}.agent.num_workers) run at once" if backend != "local" else " run at once"
    return at_once, how


def _ask_server(url: str) -> int | None:
    """The capacity a running local sandbox server reports (``GET /health``: ``capacity``); None from another
    service or when it does not answer."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as r:
            body = json.loads(r.read(64 * 1024))
    except (OSError, ValueError):
        return None
    capacity = body.get("capacity") if isinstance(body, dict) else None
    return capacity if isinstance(capacity, int) and capacity > 0 else None


def sandbox_capacity(
    tool: dict, backend: str, cluster_service: tuple[int | None, str] | None = None
) -> tuple[int | None, str]:
    """The sandbox service's capacity (None: unknown) and which service and setting it comes from
    (``cluster_service``: the cluster backend's, as the training layer resolved it from the preset)."""
    if backend == "local":
        api_url = tool.get("e2b_api_url") or os.environ.get("E2B_API_URL")
        domain = tool.get("e2b_domain") or os.environ.get("E2B_DOMAIN")
        if api_url:
            return _ask_server(api_url), f"the sandbox service at E2B_API_URL={api_url}"
        if domain:
            return None, f"the sandbox service at E2B_DOMAIN={domain}"
        from pipeline_steps.constants import LOCAL_SANDBOX_MAX

        default = LOCAL_SANDBOX_MAX  # agent_rollout.local_sandbox starts it with sandbox-server's default
        return default, f"the local sandbox server the run starts (sandbox-server --max-sandboxes {default})"
    # the cluster's sandbox service (and its capacity) is the deployment's registry's, which the training layer
    # reads (pipeline_steps.training.sandbox_services) and hands in
    return cluster_service or (None, "the cluster's sandbox service")


def check_sandbox_capacity(
    cfg, path: str, backend: str | None = None, cluster_service: tuple[int | None, str] | None = None
) -> dict:
    """The code sandbox tool's sandboxes held at once by one step's rollout against the service's capacity:
    UserError in one line, naming the settings, when they do not fit; a warning when the capacity is unknown.
    ``{}`` when the tool config has no code sandbox tool."""
    tool = _code_tool_config(path)
    if tool is None:
        return {}
    if backend is None:  # the local backend alone generates with transformers (check_registries)
        backend = "local" if str(cfg.actor_rollout_ref.rollout.get("name")) == "hf" else "cluster"
    at_once, how = sandboxes_at_once(cfg, tool, backend)
    capacity, service = sandbox_capacity(tool, backend, cluster_service)
    summary = {"at_once": at_once, "capacity": capacity, "session": tool["session"]}
    if capacity is None:
        log.warning(
            "code sandbox tool: %s: %d sandboxes at once; the capacity of %s is unknown, so calls beyond it would "
            "fail as 'sandbox unavailable'%s",
            how,
            at_once,
            service,
            "" if backend == "local" else " (give the service a capacity in $PIPELINE_SANDBOX_SERVICES)",
        )
    elif at_once > capacity:
        remedy = (
            f"lower data.train_batch_size or {ROLLOUT}.n, or use session: call"
            if tool["session"] == "trajectory"
            else "lower max_concurrency in the tool config"
        )
        raise UserError(
            f"{KEY}={path}: {how}: {at_once} sandboxes at once, but {service} holds {capacity}; {remedy}, or use a "
            "sandbox service with more"
        )
    return summary


LOOPS_KEY = "actor_rollout_ref.rollout.agent.agent_loop_config_path"
TRUSTED_LOOPS = ("pipeline_steps.rollouts.", "verl.experimental.agent_loop.")


def check_agent_loop_config(path: str) -> list[str]:
    """The agent-loop names an ``agent_loop_config_path`` file registers (verl's format: a list of ``{name,
    _target_, ...}``); each ``_target_`` located (ours and verl's imported and checked to be an ``AgentLoopBase``,
    other code only located); UserError on the first problem."""
    import yaml
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase

    try:
        spec = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"{LOOPS_KEY}={path}: not a readable YAML file ({type(exc).__name__})") from None
    if not isinstance(spec, list) or not spec:
        raise UserError(f"{LOOPS_KEY}={path}: expected a non-empty list of {{name, _target_}} entries")
    names = []
    for i, entry in enumerate(spec):
        where = f"{LOOPS_KEY}={path} [{i}]"
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) for k in ("name", "_target_")):
            raise UserError(f"{where}: needs a name and a _target_ (the loop's class)")
        module_name, _, class_name = entry["_target_"].rpartition(".")
        try:
            if module_name.startswith(TRUSTED_LOOPS):
                cls = getattr(importlib.import_module(module_name), class_name)
                if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
                    raise UserError(f"{where}: {entry['_target_']!r} is not a verl AgentLoopBase")
            elif importlib.util.find_spec(module_name) is None:  # other code is located, not run, here
                raise ImportError(module_name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise UserError(f"{where}: class {entry['_target_']!r} not importable ({type(exc).__name__})") from None
        names.append(entry["name"])
    return names


def check_agent_loops(cfg) -> dict:
    """For the pre-flight: the agent-loop config when set and readable here (a deployment's path that only exists
    in the training image is left to the cluster), and ``default_agent_loop`` registered by it or by verl."""
    agent = cfg.actor_rollout_ref.rollout.get("agent") or {}
    path = agent.get("agent_loop_config_path")
    if not path:
        return {}
    from pipeline_steps.tools import resolve_config_path

    path = resolve_config_path(path)  # pkg: names a shipped config; a missing one fails here
    if not Path(str(path)).is_file():
        return {}
    names = check_agent_loop_config(str(path))
    default = agent.get("default_agent_loop")
    if default and default not in names:
        from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

        if default not in _agent_loop_registry:
            raise UserError(
                f"actor_rollout_ref.rollout.agent.default_agent_loop={default}: not registered by {LOOPS_KEY} "
                f"({names}) nor by verl ({sorted(_agent_loop_registry)})"
            )
    return {"agent_loops": names}
