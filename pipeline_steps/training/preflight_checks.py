"""Pre-flight on CPU: fail a bad experiment in seconds, before any GPU is asked for.

``python -m pipeline_steps preflight --experiment FILE [--override KEY=VALUE ...]``

Composes verl's own Hydra config (``verl.trainer.config/ppo_trainer``) with the
preset and the overrides, runs verl's own ``validate_config``, and adds what that
misses: unknown advantage estimator / policy loss / rollout engine (verl's own
registries), required keys left unset, values of the wrong type (checked against
verl's generated default config), batch sizes that do not divide over the GPUs,
a run whose memory cannot fit the backend (:func:`check_memory`: the local machine's
memory, or the preset's GPUs), and data files or a model that are not staged in the store.

Every failure is a :class:`UserError` whose one line names the key.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
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


def preflight(exp: Experiment, *, check_store: bool = True, store_credentials: dict | None = None) -> dict:
    """Validate ``exp`` as verl would on the cluster; raise UserError naming the first bad key.

    :param exp: the loaded experiment (preset + derived keys + user overrides)
    :param check_store: also check that data files and model are staged (manifest present)
    :param store_credentials: handed to the store clients (:func:`pipeline_steps.store.open_store`); none: the
        environment's
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
    memory = check_memory(exp, cfg, backend)  # before any CPU or GPU is committed: a run that cannot fit, refused
    check_exportable(cfg)
    run_verl_validate(cfg, ppo_utils)
    from pipeline_steps.tools.tool_config_check import check_agent_loops, check_multi_turn  # verl and the classes named
    from pipeline_steps.training.sandbox_services import sandbox_service_capacity

    # with the code tool's sandboxes at once against the service's capacity (the cluster's: from the registry)
    service = None if backend == "local" else sandbox_service_capacity(exp.spec.get("cluster"))
    tools = check_multi_turn(cfg, backend, service)
    tools.update(check_agent_loops(cfg))  # a preset's own agent loops (agent_loop_config_path)
    from pipeline_steps.rewards.reward_check import check_reward_function

    tools.update(check_reward_function(cfg))  # a user reward is imported and called on a sample row
    from pipeline_steps.rewards.reward_check import check_group_reward

    tools.update(check_group_reward(cfg, backend))
    staged = check_staged(cfg, backend, store_credentials) if check_store else {}
    if check_store:  # the staged files are there: image rows through verl's own dataset with the staged processor
        tools.update(check_multimodal_data(cfg, store_credentials))
    return {
        "experiment": exp.name,
        "digest": exp.digest(),
        "backend": backend,
        "adv_estimator": str(cfg.algorithm.adv_estimator),
        "rollout": str(cfg.actor_rollout_ref.rollout.name),
        **batch,
        "memory": memory,
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


# -- memory -------------------------------------------------------------------------------------------

# What a step's batch holds per token at the least, on every backend: verl's DataProto of the step (input ids,
# attention mask, position ids, responses, response mask as int64; old and reference log-probs, advantages, returns,
# token scores as float32) is 9 tensors of 4 to 8 bytes per token of train_batch_size x n x (prompt + response).
BATCH_BYTES_PER_TOKEN = 64
# Training states per model parameter with Adam: weights, gradients and the two moments (fp32 on the CPU trainer;
# bf16 weights and gradients with fp32 master weights and moments under FSDP: 2 + 2 + 4 + 4 + 4 = 16 on GPUs).
STATE_BYTES_PER_PARAM = 16
OFFLOADED_BYTES_PER_PARAM = 4  # optimizer states offloaded to the host: bf16 weights and gradients stay on the GPUs
# A GPU's memory when the preset does not say (cluster.gpu_memory_gb): the 80 GB of the A100/H100/H800 class the
# guides' presets run on. A preset on smaller GPUs (or larger: B200 192) sets its own figure.
DEFAULT_GPU_MEMORY_GB = 80
GB = 1024**3
_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)([BbMm])$")


def _params_from_name(name: str) -> float | None:
    """A parameter count from a model's name or staged path (``Qwen2.5-3B-Instruct`` -> 3e9, ``Qwen3-30B-A3B`` ->
    30e9, ``.../models/Qwen/Qwen2.5-3B-Instruct/main`` -> 3e9: only what follows the store's ``models/``)."""
    name = name.split("/models/", 1)[-1]
    for part in re.split(r"[-_/]", name):
        m = _SIZE_RE.match(part)
        if m:
            return float(m.group(1)) * (1e9 if m.group(2) in "Bb" else 1e6)
    return None


def _config_json(path: str) -> dict | None:
    """A model directory's ``config.json`` when it is on this machine (a path or a file:// URI), else None."""
    import json

    from pipeline_steps.uris import strip_file_scheme

    if "://" in path and not path.startswith("file://"):
        return None
    try:
        return json.loads((Path(os.path.expanduser(strip_file_scheme(path))) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def _params_from_config(config: dict) -> float | None:
    """Parameters of a decoder model from its config.json (embeddings, attention, MLP of every layer)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    try:
        vocab, hidden, layers = int(text["vocab_size"]), int(text["hidden_size"]), int(text["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        return None
    inter = int(text.get("intermediate_size") or 4 * hidden)
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    return float(vocab * hidden * (1 if tied else 2) + layers * (4 * hidden * hidden + 3 * hidden * inter))


def model_size(exp: Experiment, cfg) -> tuple[float, str]:
    """The model's parameter count and where it came from: its config.json when the model is on this machine, else
    the size in its name (the staged model's path names the model the run trains, the form's or the preset's), else 0
    (unknown: the estimate counts the batch only)."""
    from omegaconf import OmegaConf

    derived = "actor_rollout_ref.model.path" in exp.verl  # else verl's placeholder default, not this run's model
    path = str(OmegaConf.select(cfg, "actor_rollout_ref.model.path") or "") if derived else ""
    config = _config_json(path) if path else None
    if config is not None:
        params = _params_from_config(config)
        if params:
            return params, f"{path}/config.json"
    model = exp.spec.get("model") or {}
    for name in (path, str(model.get("source") or model.get("repo_id") or "")):
        params = _params_from_name(name) if name else None
        if params:
            return params, f"the name {name.rstrip('/').split('/models/')[-1]}"
    return 0.0, "unknown (the estimate counts the batch only)"


def machine_memory() -> tuple[int, str]:
    """This machine's memory for the local backend: MemTotal (/proc/meminfo), or a lower cgroup limit (v1 or v2)."""
    total, where = 0, "MemTotal"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = int(Path(limit_file).read_text().strip())
        except (OSError, ValueError):  # absent, or "max"
            continue
        if 0 < limit < total:
            total, where = limit, f"the cgroup limit ({limit_file})"
    return total, where


def _int_at(cfg, key: str) -> int:
    from omegaconf import OmegaConf

    v = OmegaConf.select(cfg, key)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else 0


def check_memory(exp: Experiment, cfg, backend: str) -> dict:
    """Estimate what the run needs at least and refuse it in one line, naming the setting to lower, when that cannot
    fit the backend: the local machine's memory, or the preset's GPUs (nodes x GPUs per node x
    ``cluster.gpu_memory_gb``, default :data:`DEFAULT_GPU_MEMORY_GB`).

    The estimate is a floor, so a refusal is certain rather than a guess: the step's batch (train_batch_size x n x
    (prompt + response) tokens at :data:`BATCH_BYTES_PER_TOKEN`) and the model's training states (parameters x
    :data:`STATE_BYTES_PER_PARAM`; a reference copy on the CPU trainer; less with optimizer offload on GPUs), plus on
    the CPU trainer, when the model's config.json is on this machine, the generation's KV cache and one micro-batch's
    logits. Activations, the rollout engine's cache and fragmentation come on top.
    """
    tbs, n = _int_at(cfg, "data.train_batch_size"), _int_at(cfg, "actor_rollout_ref.rollout.n")
    prompt = _int_at(cfg, "actor_rollout_ref.rollout.prompt_length") or _int_at(cfg, "data.max_prompt_length")
    response = _int_at(cfg, "actor_rollout_ref.rollout.response_length") or _int_at(cfg, "data.max_response_length")
    prompt_key = (
        "actor_rollout_ref.rollout.prompt_length"
        if "actor_rollout_ref.rollout.prompt_length" in exp.verl
        else "data.max_prompt_length"
    )
    response_key = (
        "actor_rollout_ref.rollout.response_length"
        if "actor_rollout_ref.rollout.response_length" in exp.verl
        else "data.max_response_length"
    )
    tokens = tbs * n * (prompt + response)
    batch_bytes = tokens * BATCH_BYTES_PER_TOKEN
    params, params_from = model_size(exp, cfg)
    local = backend == "local"
    actor = cfg.actor_rollout_ref.actor
    if local:
        per_param = STATE_BYTES_PER_PARAM + (4 if actor.use_kl_loss or cfg.algorithm.use_kl_in_reward else 0)
    else:
        offload = bool(actor.fsdp_config.get("optimizer_offload"))
        per_param = OFFLOADED_BYTES_PER_PARAM if offload else STATE_BYTES_PER_PARAM
    model_bytes = int(params * per_param)
    extra = 0
    if local:  # the CPU trainer: the generation's KV cache (fp32) and one micro-batch's logits, from the model config
        from omegaconf import OmegaConf

        path = str(OmegaConf.select(cfg, "actor_rollout_ref.model.path") or "")
        config = _config_json(path) if "actor_rollout_ref.model.path" in exp.verl else None
        if config:
            try:
                layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
                heads = int(config.get("num_attention_heads") or 1)
                kv = int(config.get("num_key_value_heads") or heads) * (hidden // heads)
                micro = min(tbs * n, _int_at(cfg, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu") or tbs * n)
                extra = tokens * 2 * layers * kv * 4 + micro * (prompt + response) * int(config["vocab_size"]) * 4 * 3
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                extra = 0
    need = batch_bytes + model_bytes + extra
    if local:
        budget, where = machine_memory()
        budget_text = f"this machine's {budget / GB:.1f} GB ({where})"
    else:
        cluster = exp.spec.get("cluster") or {}
        per_gpu = float(cluster.get("gpu_memory_gb") or DEFAULT_GPU_MEMORY_GB)
        gpus = _int_at(cfg, "trainer.nnodes") * _int_at(cfg, "trainer.n_gpus_per_node")
        budget = int(gpus * per_gpu * GB)
        source = "cluster.gpu_memory_gb" if cluster.get("gpu_memory_gb") else "the default per GPU"
        budget_text = f"the {gpus} GPUs' {budget / GB:,.0f} GB ({per_gpu:g} GB each: {source})"
    summary = {
        "estimate_gb": round(need / GB, 2),
        "budget_gb": round(budget / GB, 1),
        "tokens_per_step": tokens,
        "model_parameters": params,
        "model_size_from": params_from,
    }
    if need <= budget:
        return summary
    if model_bytes > batch_bytes + extra:
        fix = "choose a smaller model, or " + (
            "the kuberay backend" if local else "more GPUs (trainer.nnodes, trainer.n_gpus_per_node)"
        )
    elif tbs * n > prompt + response:
        fix = "lower data.train_batch_size or actor_rollout_ref.rollout.n"
    else:
        fix = "lower " + (response_key if response >= prompt else prompt_key)
    model_text = f"a {params / 1e9:.3g}B-parameter model" if params else "the model (size unknown, not counted)"
    raise UserError(
        f"memory: data.train_batch_size x actor_rollout_ref.rollout.n x ({prompt_key} + {response_key}) = {tbs} x {n} "
        f"x ({prompt} + {response}) = {tokens:,} tokens and {model_text} need at least "
        f"{need / GB:,.1f} GB, more than {budget_text}; {fix}"
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


def check_staged(cfg, backend: str, credentials: dict | None = None) -> dict:
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
            store = open_store(uri, credentials)
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


# -- image rows through verl's RLHFDataset with the staged processor -------------------------------------------------
MM_SAMPLE_ROWS = 64  # rows of each data file put through verl's dataset (its filter runs the processor on every one)
PROCESSOR_FILES = re.compile(
    r"^(config\.json|generation_config\.json|preprocessor_config\.json|processor_config\.json|video_preprocessor"
    r"_config\.json|chat_template\.(json|jinja)|tokenizer(_config)?\.json|special_tokens_map\.json|added_tokens\.json"
    r"|vocab\.json|merges\.txt|tokenizer\.model)$"
)


def _local_copy(uri: str, rels: list[str], dest: Path, credentials: dict | None = None) -> Path:
    """``uri`` (a store URI or a local path) as a local directory holding ``rels`` (read from the store)."""
    if "://" not in uri:
        return Path(os.path.expanduser(uri))
    from pipeline_steps.store import open_store

    store = open_store(uri, credentials)
    dest.mkdir(parents=True, exist_ok=True)
    for rel in rels:
        data = store.read_bytes(f"{uri.rstrip('/')}/{rel}" if rel else uri)
        if data is None:
            raise UserError(f"{uri}/{rel}: not readable from the store; stage it again")
        target = dest / (rel or Path(uri).name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return dest


def _image_rows(path: Path, image_key: str, limit: int):
    """The first ``limit`` rows of a parquet file if any of them has images under ``image_key``, else None."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception:  # not parquet: not this check's business (verl's loader and the store check say so)
        return None
    if image_key not in pf.schema_arrow.names:
        return None
    rows = []
    for batch in pf.iter_batches(batch_size=limit):
        rows.extend(batch.to_pylist())
        if len(rows) >= limit:
            break
    rows = rows[:limit]
    return rows if any(r.get(image_key) for r in rows) else None


def _row_problem(dataset, row: dict, max_len: int) -> str | None:
    """Why verl's prompt-length filter would drop ``row``: the processing error it swallows, or the length."""
    import copy as copy_mod

    try:
        messages = dataset._build_messages(copy_mod.deepcopy(row), key=dataset.prompt_key)
        raw = dataset.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        images, videos, audios = dataset._process_multi_modal_info(messages, dataset.image_patch_size, dataset.config)
        from verl.utils.tokenizer import build_multimodal_processor_inputs

        ids = build_multimodal_processor_inputs(
            dataset.processor,
            text=[raw],
            images=images,
            videos=videos,
            audio=audios,
            mm_processor_kwargs=dataset.mm_processor_kwargs,
        )["input_ids"][0]
    except Exception as exc:
        return f"processing failed ({exc.__class__.__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})"
    return f"{len(ids)} tokens > data.max_prompt_length={max_len}" if len(ids) > max_len else None


def check_multimodal_data(cfg, credentials: dict | None = None) -> dict:
    """Image rows put through verl's own ``RLHFDataset`` with the staged model's processor, as the cluster's job will.

    verl hides two failures there: ``hf_processor`` returns None on any error with only a warning (the job then stops
    at "processor is needed to process multimodal data", or trains without the images), and its prompt-length filter
    drops every row whose processing fails as if it were too long, silently. Both are refused here in one line naming
    the cause. Only the processor's files and the first :data:`MM_SAMPLE_ROWS` rows of each file are read."""
    import tempfile

    from omegaconf import OmegaConf

    image_key = str(OmegaConf.select(cfg, "data.image_key") or "images")
    model_uri = _values(cfg, "actor_rollout_ref.model.path")
    files = [(key, uri) for key in DATA_KEYS for uri in _values(cfg, key)]
    if not model_uri or not files:
        return {}
    with tempfile.TemporaryDirectory(prefix="preflight-mm-") as tmp:
        samples = []
        for i, (key, uri) in enumerate(files):
            local = _local_copy(uri, [""], Path(tmp) / f"data{i}", credentials)
            path = local if local.is_file() else local / Path(uri).name
            rows = _image_rows(path, image_key, MM_SAMPLE_ROWS) if path.is_file() else None
            if rows:
                samples.append((key, uri, rows))
        if not samples:
            return {}
        uri = model_uri[0]
        if "://" in uri:
            from pipeline_steps.store import open_store

            found = _find_version(open_store(uri, credentials), uri)
            names = [e.get("path") for e in (found[1].get("files", []) if found else [])]
            wanted = [n for n in names if PROCESSOR_FILES.match(n or "")]
            model_dir = _local_copy(uri, wanted, Path(tmp) / "model", credentials)
        else:
            model_dir = _local_copy(uri, [], Path(tmp))
        return _check_rows_through_rlhfdataset(cfg, str(model_dir), uri, samples, Path(tmp))


def _check_rows_through_rlhfdataset(cfg, model_dir: str, model_uri: str, samples, tmp: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from omegaconf import OmegaConf, open_dict

    with _verl_quiet():
        from verl.utils import hf_processor, hf_tokenizer
        from verl.utils.dataset.rl_dataset import RLHFDataset

        trust = bool(OmegaConf.select(cfg, "actor_rollout_ref.model.trust_remote_code") or False)
        processor = hf_processor(model_dir, trust_remote_code=trust)
    key0, uri0, _ = samples[0]
    if processor is None:  # verl said only "Failed to create processor" (a warning) or nothing (a text tokenizer)
        try:
            from transformers import AutoProcessor

            got = AutoProcessor.from_pretrained(model_dir, trust_remote_code=trust)
            cause = f"it loads as {type(got).__name__}, a text tokenizer with no image processor"
        except Exception as exc:
            cause = f"{exc.__class__.__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        raise UserError(
            f"actor_rollout_ref.model.path={model_uri}: its processor did not load ({cause}), so verl's hf_processor "
            f"returns None and the image rows of {key0}={uri0} cannot reach the model; stage a model whose "
            "preprocessor_config.json and processor files load with transformers' AutoProcessor"
        )
    tokenizer = hf_tokenizer(model_dir, trust_remote_code=trust)
    data_cfg = OmegaConf.merge(cfg.data, {})  # a copy; the composed config is a struct, which refuses new keys
    with open_dict(data_cfg):
        data_cfg.merge_with({"filter_overlong_prompts_workers": None, "cache_dir": str(tmp / "cache")})
    max_len = int(data_cfg.get("max_prompt_length", 1024))
    checked = {}
    for n, (key, uri, rows) in enumerate(samples):
        path = tmp / f"sample{n}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        with _verl_quiet():
            dataset = RLHFDataset(data_files=[str(path)], tokenizer=tokenizer, config=data_cfg, processor=processor)
        if len(dataset) < len(rows):
            lost = len(rows) - len(dataset)
            first = next(
                ((i, why) for i, r in enumerate(rows) if (why := _row_problem(dataset, r, max_len)) is not None),
                (0, "cause not found"),
            )
            raise UserError(
                f"{key}={uri}: verl's prompt-length filter (data.filter_overlong_prompts) drops {lost} of the first "
                f"{len(rows)} rows; row {first[0]}: {first[1]}"
            )
        checked[key] = len(rows)
    return {"multimodal_rows_checked": checked, "processor": type(processor).__name__}


@contextlib.contextmanager
def _verl_quiet():
    """verl's dataset prints progress and tracebacks to stdout: kept out of the step's one-line JSON output."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield
