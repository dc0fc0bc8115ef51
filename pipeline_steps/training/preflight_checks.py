"""Pre-flight on CPU: fail a bad experiment in seconds, before any GPU is asked for.

``python -m pipeline_steps preflight --experiment FILE [--override KEY=VALUE ...]``

Composes verl's own Hydra config (``verl.trainer.config/ppo_trainer``) with the
preset and the overrides, runs verl's own ``validate_config``, and adds what that
misses: unknown advantage estimator / policy loss / rollout engine (verl's own
registries), required keys left unset, values of the wrong type (checked against
verl's generated default config), batch sizes that do not divide over the GPUs,
and data files or a model that are not staged in the store.

Every failure is a :class:`UserError` whose one line names the key.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
import warnings
from pathlib import Path

from pipeline_steps import log_levels
from pipeline_steps.errors import UserError
from pipeline_steps.training import experiment as experiment_mod
from pipeline_steps.training.experiment import Experiment

log = logging.getLogger(__name__)

# Sections whose required keys only matter when the feature is on: (key prefix, "is it on?").
_OPTIONAL_SECTIONS = (
    ("reward.reward_model.", lambda cfg, u: bool(u.need_reward_model(cfg))),
    ("critic.", lambda cfg, u: bool(_quiet(u.need_critic, cfg))),
    ("actor_rollout_ref.ref.", lambda cfg, u: bool(u.need_reference_policy(cfg))),
    ("distillation.", lambda cfg, u: bool(u.need_teacher_policy(cfg))),
)
DATA_KEYS = ("data.train_files", "data.val_files")
MODEL_KEYS = ("actor_rollout_ref.model.path",)
LOCAL_ROLLOUTS = ("hf",)  # the local CPU backend generates with transformers


def preflight(exp: Experiment, *, check_store: bool = True) -> dict:
    """Validate ``exp`` as verl would on the cluster; raise UserError naming the first bad key.

    :param exp: the loaded experiment (preset + derived keys + user overrides)
    :param check_store: also check that data files and model are staged (manifest present)
    :return: summary: experiment, digest, backend, GPUs, batch figures, seconds taken
    """
    t0 = time.monotonic()
    backend = str(exp.spec.get("backend", "cluster"))
    check_value_types(exp)  # before composing: arithmetic on 'two' would fail obscurely
    cfg = experiment_mod.compose(exp)
    from verl.trainer.ppo import utils as ppo_utils

    check_missing_keys(cfg, ppo_utils)
    check_registries(cfg, backend)
    batch = check_batch_sizes(cfg)
    check_exportable(cfg)
    run_verl_validate(cfg, ppo_utils)
    from pipeline_steps.tools.tool_config_check import check_agent_loops, check_multi_turn  # verl and the classes named

    tools = check_multi_turn(cfg)
    tools.update(check_agent_loops(cfg))  # a preset's own agent loops (agent_loop_config_path)
    from pipeline_steps.rewards.reward_check import check_reward_function

    tools.update(check_reward_function(cfg))  # a user reward is imported and called on a sample row
    from pipeline_steps.rewards.reward_check import check_group_reward

    tools.update(check_group_reward(cfg, backend))
    staged = check_staged(cfg, backend) if check_store else {}
    return {
        "experiment": exp.name,
        "digest": exp.digest(),
        "backend": backend,
        "adv_estimator": str(cfg.algorithm.adv_estimator),
        "rollout": str(cfg.actor_rollout_ref.rollout.name),
        **batch,
        **tools,
        "staged": staged,
        "store_checked": check_store,
        "seconds": round(time.monotonic() - t0, 2),
    }


def check_exportable(cfg) -> None:
    """verl saves a checkpoint only when ``trainer.save_freq > 0`` (then at every multiple and at the last step);
    without one there is nothing to evaluate or export. Both backends follow that rule."""
    save_freq = cfg.trainer.get("save_freq")
    if save_freq is None or int(save_freq) <= 0:
        raise UserError(
            f"trainer.save_freq={save_freq}: verl saves no checkpoint unless it is > 0, so the run would leave "
            "nothing to evaluate or export; set it to a positive number of steps"
        )


# -- value types ------------------------------------------------------------------------------------


verl_defaults = experiment_mod.verl_defaults

_MISSING = object()


def _lookup(tree: dict, key: str):
    node = tree
    for part in key.lstrip("+").split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _kind(v) -> str:
    if isinstance(v, bool):
        return "a boolean (true/false)"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, (list, tuple)):
        return "a list"
    if isinstance(v, dict):
        return "a mapping"
    return "a string"


def _type_ok(default, value) -> bool:
    if isinstance(default, str) and default.startswith("${"):
        return True  # an interpolation: its type is whatever it points to
    if value is None:
        return default is None or isinstance(default, (str, list, dict))
    if default is None or default == "???":
        return True
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, str):  # verl takes lists where it defaults to one path, numbers as names
        return not isinstance(value, (bool, dict))
    if isinstance(default, list):
        return isinstance(value, (list, tuple, str))
    if isinstance(default, dict):
        return isinstance(value, dict)
    return True


def _field_type(defaults: dict, key: str):
    """The annotated type of ``key`` in the verl dataclass its section is built into (``_target_``), or _MISSING."""
    import importlib
    import typing

    parent = _lookup(defaults, key.rsplit(".", 1)[0]) if "." in key else defaults
    target = parent.get("_target_") if isinstance(parent, dict) else None
    if not isinstance(target, str) or not target.startswith("verl."):
        return _MISSING
    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        return typing.get_type_hints(cls).get(key.rsplit(".", 1)[-1], _MISSING)
    except Exception:  # an unresolvable annotation: fall back to the default's type
        return _MISSING


def _matches(tp, value) -> bool | None:
    """Does ``value`` fit annotation ``tp``? None when the annotation says nothing checkable."""
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        results = [_matches(a, value) for a in args]
        return True if any(r is not False for r in results) else False
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp in (list, tuple) or origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if tp is dict or origin is dict:
        return isinstance(value, dict)
    return None


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def check_value_types(exp: Experiment) -> None:
    """Every key the experiment sets must fit verl's dataclass field type, else the type of verl's default."""
    defaults = verl_defaults()
    for key, value in exp.verl.items():
        default = _lookup(defaults, key)
        if default is _MISSING:
            continue  # a new key ('+key=...') or one Hydra will reject by name
        if isinstance(value, str) and value.startswith("${"):
            continue  # an interpolation, resolved by OmegaConf
        tp = _field_type(defaults, key)
        verdict = _matches(tp, value) if tp is not _MISSING else None
        if verdict is False:
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise UserError(
                f"{key}={shown}: expected {_type_name(tp)} (verl's field type); fix the value in the preset or "
                "--override"
            )
        if verdict is None and not _type_ok(default, value):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise UserError(
                f"{key}={shown}: expected {_kind(default)} (verl's default is {default!r}); "
                "fix the value in the preset or --override"
            )


# -- required keys and registries -------------------------------------------------------------------


def _quiet(fn, *a):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a)


def check_missing_keys(cfg, ppo_utils) -> None:
    """Keys verl marks ``???`` and nothing set, except in sections the config leaves switched off."""
    from omegaconf import OmegaConf

    missing = sorted(OmegaConf.missing_keys(cfg))
    off = [prefix for prefix, on in _OPTIONAL_SECTIONS if not on(cfg, ppo_utils)]
    needed = [k for k in missing if not any(k.startswith(p) for p in off)]
    if needed:
        key = needed[0]
        hint = (
            " (vllm, sglang or trtllm on the cluster; hf on the local backend)" if key.endswith("rollout.name") else ""
        )
        more = f" (and {len(needed) - 1} more: {', '.join(needed[1:4])})" if len(needed) > 1 else ""
        raise UserError(f"{key} is required but not set{hint}{more}; set it in the preset or with --override {key}=...")


def check_registries(cfg, backend: str) -> None:
    from verl.trainer.ppo import core_algos

    est = cfg.algorithm.adv_estimator
    try:
        core_algos.get_adv_estimator_fn(est)
    except ValueError:
        known = sorted(core_algos.ADV_ESTIMATOR_REGISTRY)
        raise UserError(
            f"algorithm.adv_estimator={str(est)!r} is not an advantage estimator verl knows; choose one of {known}"
        ) from None
    loss = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if loss not in core_algos.POLICY_LOSS_REGISTRY:
        known = sorted(core_algos.POLICY_LOSS_REGISTRY)
        raise UserError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss!r} is not a policy loss verl knows; choose one of "
            f"{known}"
        )
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY  # verl's own table of rollout engines

    name = cfg.actor_rollout_ref.rollout.name
    engines = sorted({n for n, _ in _ROLLOUT_REGISTRY})
    allowed = engines + list(LOCAL_ROLLOUTS) if backend == "local" else engines
    if name not in allowed:
        raise UserError(
            f"actor_rollout_ref.rollout.name={name!r} is not a rollout engine for the {backend} backend; choose one of "
            f"{allowed}"
        )


# -- batch arithmetic ---------------------------------------------------------------------------------


def _pos_int(cfg, key: str) -> int:
    from omegaconf import OmegaConf

    v = OmegaConf.select(cfg, key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise UserError(f"{key}={v!r}: must be a positive integer")
    return v


def check_batch_sizes(cfg) -> dict:
    """The divisibility verl asserts deep inside its workers, checked up front with the keys named."""
    from omegaconf import OmegaConf

    nnodes = _pos_int(cfg, "trainer.nnodes")
    per_node = _pos_int(cfg, "trainer.n_gpus_per_node")
    n_gpus = nnodes * per_node
    tbs = _pos_int(cfg, "data.train_batch_size")
    n = _pos_int(cfg, "actor_rollout_ref.rollout.n")
    out = {"nnodes": nnodes, "n_gpus_per_node": per_node, "n_gpus": n_gpus, "train_batch_size": tbs, "rollout_n": n}
    gpus = f"trainer.nnodes x trainer.n_gpus_per_node = {nnodes} x {per_node} = {n_gpus} GPUs"
    if (tbs * n) % n_gpus:
        raise UserError(
            f"data.train_batch_size x actor_rollout_ref.rollout.n = {tbs} x {n} = {tbs * n} responses do not divide "
            f"over {gpus}; change one of them"
        )
    tp = OmegaConf.select(cfg, "actor_rollout_ref.rollout.tensor_model_parallel_size") or 1
    if isinstance(tp, int) and tp > 0 and n_gpus % tp:
        raise UserError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide {gpus}; pick a divisor"
        )
    actor = cfg.actor_rollout_ref.actor
    if actor.use_dynamic_bsz:
        return out
    mini = _pos_int(cfg, "actor_rollout_ref.actor.ppo_mini_batch_size")
    if mini > tbs or tbs % mini:
        raise UserError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} must divide data.train_batch_size={tbs} "
            f"(each step is train_batch_size x n = {tbs * n} responses in mini-batches of {mini} x n = {mini * n})"
        )
    sp = OmegaConf.select(cfg, "actor_rollout_ref.actor.ulysses_sequence_parallel_size") or 1
    dp = n_gpus // sp if isinstance(sp, int) and sp > 0 and n_gpus % sp == 0 else n_gpus
    if (mini * n) % dp:
        raise UserError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size x rollout.n = {mini} x {n} = {mini * n} does not divide over "
            f"{dp} data-parallel ranks ({gpus}); change the mini-batch size"
        )
    micro = actor.ppo_micro_batch_size_per_gpu
    if isinstance(micro, int) and not isinstance(micro, bool) and micro > 0 and (mini * n // dp) % micro:
        raise UserError(
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro} must divide the per-GPU mini-batch "
            f"{mini * n // dp} (ppo_mini_batch_size x rollout.n / {dp} ranks)"
        )
    out.update(ppo_mini_batch_size=mini, steps_per_batch=tbs // mini)
    return out


def run_verl_validate(cfg, ppo_utils) -> None:
    """verl's own ``validate_config``; its prints become this module's log records, each at the level its text
    gives (stdout ends with the step's JSON summary; and in an Airflow task raw stderr is filed as ERROR, which made
    verl's "All configuration checks passed successfully!" read as an error)."""
    from hydra.errors import InstantiationException  # verl builds its dataclasses through hydra.instantiate
    from verl.utils.config import validate_config

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            validate_config(
                config=cfg,
                use_reference_policy=ppo_utils.need_reference_policy(cfg),
                use_critic=ppo_utils.need_critic(cfg),
            )
    except (
        AssertionError,
        ValueError,
        TypeError,
        KeyError,
        AttributeError,
        RuntimeError,
        InstantiationException,
    ) as exc:
        msg = " ".join(str(exc).split()) or exc.__class__.__name__
        raise UserError(f"verl's validate_config rejected the config: {msg[:400]}") from None
    finally:
        log_levels.relay(log, printed.getvalue().splitlines(), "verl: %s")


# -- staged inputs ------------------------------------------------------------------------------------


def _values(cfg, key: str) -> list[str]:
    from omegaconf import OmegaConf

    v = OmegaConf.select(cfg, key)
    if v is None:
        return []
    if OmegaConf.is_list(v):
        return [str(x) for x in OmegaConf.to_container(v, resolve=True)]
    return [str(v)]


def _find_version(store, uri: str, max_up: int = 4) -> tuple[str, dict] | None:
    """Nearest enclosing version of ``uri`` (itself or a parent prefix holding a manifest)."""
    cur = uri.rstrip("/")
    for _ in range(max_up + 1):
        manifest = store.read_manifest(cur)
        if manifest is not None:
            return cur, manifest
        parent = cur.rsplit("/", 1)[0]
        if parent == cur or parent.endswith(":/") or parent.endswith(":"):
            return None
        cur = parent
    return None


def check_staged(cfg, backend: str) -> dict:
    """Data files and model must be complete versions in the store (their manifest written)."""
    try:
        from pipeline_steps.store import open_store
    except ImportError:  # pragma: no cover - the store module is part of the project
        raise UserError("the store module is not available; run with --skip-store-check") from None
    staged = {}
    for key in DATA_KEYS + MODEL_KEYS:
        uris = _values(cfg, key)
        if not uris and key == "data.val_files":
            continue
        if not uris:
            raise UserError(f"{key} is not set; stage it (upload / stage-model step) and pass its store URI")
        for uri in uris:
            if "://" not in uri:
                if backend == "local" and Path(os.path.expanduser(uri)).exists():
                    staged.setdefault(key, []).append(uri)
                    continue
                raise UserError(
                    f"{key}={uri!r} is not a store URI; stage it with the upload / stage-model step and pass its "
                    f"file://, oss:// or gs:// URI (or run with --skip-store-check)"
                )
            store = open_store(uri)
            found = _find_version(store, uri)
            if found is None:
                raise UserError(
                    f"{key}={uri!r} is not staged: no complete version (manifest) holds it; run the upload / "
                    "stage-model step first"
                )
            version, manifest = found
            rel = uri.rstrip("/")[len(version) :].strip("/")
            names = {e.get("path") for e in manifest.get("files", [])}
            if rel and rel not in names:
                raise UserError(
                    f"{key}={uri!r}: version {version} is staged but has no file {rel!r}; check the file name"
                )
            if key in MODEL_KEYS and not rel and "config.json" not in names:
                raise UserError(f"{key}={uri!r}: staged version has no config.json, so it is not a Hugging Face model")
            staged.setdefault(key, []).append(version)
    return staged
