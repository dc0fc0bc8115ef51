"""Pre-flight of ``reward.custom_reward_function``: import the file and call the function on a sample row on CPU, so a
missing file, a wrong name or a broken signature fails in seconds with one line instead of after the first rollout."""

from __future__ import annotations

import inspect

from pipeline_steps.errors import UserError

KEY = "reward.custom_reward_function"
SAMPLE = {
    "data_source": "math_dapo",
    "solution_str": 'Let me compute.\n<tool_call>\n{"name": "code_interpreter"}\n</tool_call>\n42\nSo \\boxed{42}.',
    "ground_truth": "42",
    "extra_info": {"split": "train", "index": 0, "num_turns": 4, "rollout_extra": {"solution": "42"}},
}


def check_reward_function(cfg) -> dict:
    from pipeline_steps.tools import resolve_config_path

    spec = cfg.reward.get("custom_reward_function") or {}
    path, name = spec.get("path"), spec.get("name") or "compute_score"
    if not path:
        return {}
    path = resolve_config_path(path)
    try:
        from omegaconf import OmegaConf
        from verl.trainer.ppo.reward import get_custom_reward_fn

        probe = OmegaConf.create({"reward": {"custom_reward_function": {"path": path, "name": name}}})
        fn = get_custom_reward_fn(probe)
    except FileNotFoundError:
        raise UserError(f"{KEY}.path={path}: file not found") from None
    except AttributeError:
        raise UserError(f"{KEY}.name={name}: no such function in {path}") from None
    except Exception as exc:
        raise UserError(f"{KEY}.path={path}: import failed ({type(exc).__name__}: {exc})") from None
    try:
        result = fn(**SAMPLE)
        if inspect.isawaitable(result):
            import asyncio

            result = asyncio.run(result)
    except Exception as exc:
        raise UserError(
            f"{KEY}: {name}(data_source, solution_str, ground_truth, extra_info) failed on a sample row "
            f"({type(exc).__name__}: {exc})"
        ) from None
    value = result.get("score") if isinstance(result, dict) else result
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise UserError(f"{KEY}: {name} returned {type(result).__name__}; return a number or a dict with 'score'")
    return {"reward_function": f"{name} ({path})", "reward_sample": float(value)}


GROUP_KEY = f"{KEY}.group_name"


def check_group_reward(cfg, backend: str) -> dict:
    """``reward.custom_reward_function.group_name`` (local backend only): imported from the reward file and called on
    a group of two sample responses; it must return one score (or dict with 'score') per response."""
    from pipeline_steps.tools import resolve_config_path

    spec = cfg.reward.get("custom_reward_function") or {}
    name = spec.get("group_name")
    if not name:
        return {}
    if backend != "local":
        raise UserError(
            f"{GROUP_KEY}={name}: group rewards are the local backend's (verl 0.9.1's reward managers score one "
            "sample at a time); remove it for cluster runs"
        )
    if not spec.get("path"):
        raise UserError(f"{GROUP_KEY}={name}: set {KEY}.path to the file that defines it")
    path = resolve_config_path(spec["path"])
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    try:
        fn = get_custom_reward_fn(
            OmegaConf.create({"reward": {"custom_reward_function": {"path": path, "name": name}}})
        )
    except AttributeError:
        raise UserError(f"{GROUP_KEY}={name}: no such function in {path}") from None
    sample = {k: v for k, v in SAMPLE.items() if k != "solution_str"}
    try:
        result = fn(solution_strs=[SAMPLE["solution_str"], "no answer"], **sample)
    except Exception as exc:
        raise UserError(
            f"{GROUP_KEY}: {name}(data_source, solution_strs, ground_truth, extra_info) failed on a sample group "
            f"({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(result, (list, tuple)) or len(result) != 2:
        raise UserError(f"{GROUP_KEY}: {name} returned {type(result).__name__}; return a list, one score per response")
    return {"group_reward_function": f"{name} ({path})"}
