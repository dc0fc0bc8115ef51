"""Pre-flight of a verl tool config (``actor_rollout_ref.rollout.multi_turn.tool_config_path``) on CPU, without
building any tool (an MCP tool would contact its server): the YAML's shape, each ``class_name`` importable and a
``BaseTool``, ``config.type: native`` (verl 0.9.1 knows no other), each ``tool_schema`` valid for verl."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from pipeline_steps.errors import UserError

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


def check_multi_turn(cfg) -> dict:
    """For the pre-flight: the tool config when multi-turn is on and the file is readable here (a path that only
    exists in the training image is left to the cluster)."""
    mt = cfg.actor_rollout_ref.rollout.get("multi_turn") or {}
    path = mt.get("tool_config_path")
    if mt.get("enable") and path:
        from pipeline_steps.tools import resolve_config_path

        path = resolve_config_path(path)  # pkg: names a shipped config; a missing one fails here
    if not mt.get("enable") or not path or not Path(str(path)).is_file():
        return {}
    return {"tools": check_tool_config(str(path))}


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
