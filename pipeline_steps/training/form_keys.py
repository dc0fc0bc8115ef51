"""The verl keys a trigger form (or the REST API's ``conf``, which the same ``plan`` task reads) may set: one reviewed
table, each key with its type and range. Every other verl key comes only from a preset file, which the deployment
reviews and owns (the packaged presets, or its own directory in ``$PIPELINE_PRESETS_DIR``).

Why an allow-list: a form value lands in verl's Hydra config, and from there in the RayJob's entrypoint that every
GPU pod runs. A deny-list missed ``ray_kwargs.ray_init.runtime_env.py_executable`` (a shell command on every pod:
Ray starts its workers with ``bash -c "exec <py_executable> ..."``), ``runtime_env.pip``,
``worker_process_setup_hook``, ``env_vars.LD_PRELOAD``, ``ray_init.address``, ``timeline_json_file``, the
``*_data_dir`` dumps that write anywhere, ``trust_remote_code`` and ``critic.model.path``. What the form may change is
what a user tunes between runs of a reviewed preset:

* hyperparameters: learning rate and its schedule, KL and entropy coefficients, clip ratios, loss aggregation,
  advantage estimator and policy loss (names checked against verl's registries by pre-flight), mini-batch sizes;
* lengths: prompt and response lengths, turns, tool-answer length, image pixel limits;
* sampling: temperature, top-p, top-k, rollouts per prompt, and the same for validation (``val_kwargs.*``);
* cadence: checkpoint and validation frequency, training steps and epochs;
* logging: which of the deployment's loggers (local ones only), project and experiment names (short, path-safe);
* cluster shape: nodes and GPUs per node (the form's own fields set them too).

Refused with a one-line message naming the key and where it may be set instead (a preset): any key not in
:data:`KEYS`, and with a message of its own, a path (``*_dir``, ``*_path``, ``*_file``), ``ray_kwargs.*`` and
``trust_remote_code``. Standard library only: the DAG builds its form schema from this table at parse time.
"""

from __future__ import annotations

import dataclasses
import math
import re

from pipeline_steps.errors import UserError

WHERE_INSTEAD = "set it in a preset (a YAML file under $PIPELINE_PRESETS_DIR, which the deployment reviews)"
NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # path-safe: verl's loggers use project/experiment names as directories
REGISTRY_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"  # an entry of one of verl's registries (pre-flight checks which)
# the loggers a form may pick: the deployment's own (its MLflow server, files beside the run); wandb, swanlab, ...
# send the run to a third-party service with the deployment's keys, so a preset chooses them
LOGGERS = ("console", "file", "mlflow", "tensorboard")
MAX_LENGTH = 131072  # tokens: prompt or response, the longest context current open models take
MAX_STEPS = 1_000_000
MAX_BATCH = 65536


@dataclasses.dataclass(frozen=True)
class Key:
    """What one verl key may hold when it comes from the form.

    :param group: hyperparameters, lengths, sampling, cadence, logging or cluster (for the docs and the refusal).
    :param kind: ``number``, ``integer``, ``boolean``, ``choice`` (one of ``choices``), ``name`` (a string matching
        ``pattern``, at most ``max_length`` characters) or ``list`` (of ``choices``, at most ``max_length`` items).
    :param minimum: the smallest value (``exclusive``: the value must be above it).
    :param maximum: the largest value.
    :param nullable: ``null`` is allowed (verl's "unset").
    """

    group: str
    kind: str
    minimum: float | None = None
    maximum: float | None = None
    exclusive: bool = False
    choices: tuple = ()
    pattern: str = ""
    max_length: int = 0
    nullable: bool = False

    def describe(self) -> str:
        if self.kind in ("number", "integer"):
            low = f"> {_shown(self.minimum)}" if self.exclusive else f">= {_shown(self.minimum)}"
            return f"{'an integer' if self.kind == 'integer' else 'a number'} {low} and <= {_shown(self.maximum)}"
        if self.kind == "boolean":
            return "true or false"
        if self.kind == "choice":
            return "one of " + ", ".join(map(str, self.choices))
        if self.kind == "list":
            return f"a list of at most {self.max_length} of " + ", ".join(self.choices)
        return f"a name of at most {self.max_length} characters (letters, digits, '_', '.', '-')"

    def json_schema(self) -> dict:
        """The form's JSON schema keywords for this key (null allowed: an empty field keeps the preset's value)."""
        if self.kind in ("number", "integer"):
            low = {"exclusiveMinimum": self.minimum} if self.exclusive else {"minimum": self.minimum}
            return {"type": ["null", self.kind], **low, "maximum": self.maximum}
        if self.kind == "boolean":
            return {"type": ["null", "boolean"]}
        if self.kind == "choice":
            return {"type": ["null", "string"], "enum": [None, *self.choices]}
        if self.kind == "list":
            return {"type": ["null", "array"], "items": {"enum": list(self.choices)}, "maxItems": self.max_length}
        return {"type": ["null", "string"], "pattern": self.pattern, "maxLength": self.max_length}

    def fits(self, value) -> bool:
        if value is None:
            return self.nullable
        if self.kind in ("number", "integer"):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return False
            if self.kind == "integer" and not isinstance(value, int):
                return False
            if not math.isfinite(value):
                return False
            low_ok = value > self.minimum if self.exclusive else value >= self.minimum
            return low_ok and value <= self.maximum
        if self.kind == "boolean":
            return isinstance(value, bool)
        if self.kind == "choice":
            return isinstance(value, str) and value in self.choices
        if self.kind == "list":
            items = value if isinstance(value, (list, tuple)) else None
            return (
                items is not None
                and 0 < len(items) <= self.max_length
                and all(isinstance(x, str) and x in self.choices for x in items)
            )
        return isinstance(value, str) and len(value) <= self.max_length and bool(re.fullmatch(self.pattern, value))


def _shown(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _num(group, low, high, *, exclusive=False, nullable=False) -> Key:
    return Key(group, "number", low, high, exclusive=exclusive, nullable=nullable)


def _int(group, low, high, *, nullable=False) -> Key:
    return Key(group, "integer", low, high, nullable=nullable)


def _bool(group) -> Key:
    return Key(group, "boolean")


H, L, S, C, G, N = "hyperparameters", "lengths", "sampling", "cadence", "logging", "cluster"
A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."

# The reviewed table: verl key -> what the form may put there. Adding a key here lets every form user set it on every
# training pod; a key that names a file, a module, a command or a network address never belongs here.
KEYS: dict[str, Key] = {
    # hyperparameters
    A + "optim.lr": _num(H, 0, 1, exclusive=True),
    A + "optim.lr_warmup_steps": _int(H, -1, MAX_STEPS),  # -1: use the ratio
    A + "optim.lr_warmup_steps_ratio": _num(H, 0, 1),
    A + "optim.lr_scheduler_type": Key(H, "choice", choices=("constant", "cosine")),
    A + "optim.min_lr_ratio": _num(H, 0, 1),
    A + "optim.weight_decay": _num(H, 0, 1),
    A + "optim.clip_grad": _num(H, 0, 1000, exclusive=True),
    A + "use_kl_loss": _bool(H),
    A + "kl_loss_coef": _num(H, 0, 10),
    A + "kl_loss_type": Key(H, "choice", choices=("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")),
    A + "entropy_coeff": _num(H, 0, 1),
    A + "clip_ratio": _num(H, 0, 1),
    A + "clip_ratio_low": _num(H, 0, 1),
    A + "clip_ratio_high": _num(H, 0, 1),
    A + "clip_ratio_c": _num(H, 1, 100),
    A + "loss_agg_mode": Key(
        H, "choice", choices=("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    ),
    A + "policy_loss.loss_mode": Key(H, "name", pattern=REGISTRY_NAME_RE, max_length=64),
    A + "ppo_epochs": _int(H, 1, 64),
    A + "ppo_mini_batch_size": _int(H, 1, MAX_BATCH),
    A + "ppo_micro_batch_size_per_gpu": _int(H, 1, MAX_BATCH, nullable=True),
    A + "ppo_max_token_len_per_gpu": _int(H, 1, 16 * MAX_LENGTH),
    "algorithm.adv_estimator": Key(H, "name", pattern=REGISTRY_NAME_RE, max_length=64),
    "algorithm.use_kl_in_reward": _bool(H),
    "algorithm.kl_ctrl.kl_coef": _num(H, 0, 10),
    "algorithm.gamma": _num(H, 0, 1),
    "algorithm.lam": _num(H, 0, 1),
    "algorithm.norm_adv_by_std_in_grpo": _bool(H),
    "data.train_batch_size": _int(H, 1, MAX_BATCH),
    # lengths
    "data.max_prompt_length": _int(L, 1, MAX_LENGTH),
    "data.max_response_length": _int(L, 1, MAX_LENGTH),
    "data.filter_overlong_prompts": _bool(L),
    "data.truncation": Key(L, "choice", choices=("error", "left", "right", "middle")),
    R + "prompt_length": _int(L, 1, MAX_LENGTH),
    R + "response_length": _int(L, 1, MAX_LENGTH),
    R + "multi_turn.max_assistant_turns": _int(L, 1, 64, nullable=True),
    R + "multi_turn.max_user_turns": _int(L, 1, 64, nullable=True),
    R + "multi_turn.max_tool_response_length": _int(L, 1, MAX_LENGTH),
    "data.mm_processor_kwargs.min_pixels": _int(L, 1, 16384 * 28 * 28),
    "data.mm_processor_kwargs.max_pixels": _int(L, 1, 16384 * 28 * 28),  # the Qwen2.5-VL processor's own ceiling
    # sampling
    R + "n": _int(S, 1, 1024),
    R + "temperature": _num(S, 0, 10),
    R + "top_p": _num(S, 0, 1, exclusive=True),
    R + "top_k": _int(S, -1, 100_000),
    R + "do_sample": _bool(S),
    R + "val_kwargs.n": _int(S, 1, 1024),
    R + "val_kwargs.temperature": _num(S, 0, 10),
    R + "val_kwargs.top_p": _num(S, 0, 1, exclusive=True),
    R + "val_kwargs.top_k": _int(S, -1, 100_000),
    R + "val_kwargs.do_sample": _bool(S),
    # cadence
    "trainer.save_freq": _int(C, 1, MAX_STEPS),  # > 0: a run that saves nothing has nothing to evaluate or export
    "trainer.test_freq": _int(C, -1, MAX_STEPS),
    "trainer.total_training_steps": _int(C, 1, MAX_STEPS, nullable=True),
    "trainer.total_epochs": _int(C, 1, 10_000),
    "trainer.val_before_train": _bool(C),
    "trainer.max_actor_ckpt_to_keep": _int(C, 1, 1000, nullable=True),
    "trainer.log_val_generations": _int(C, 0, 1000),
    # logging
    "trainer.logger": Key(G, "list", choices=LOGGERS, max_length=len(LOGGERS)),
    "trainer.project_name": Key(G, "name", pattern=NAME_RE, max_length=128),
    "trainer.experiment_name": Key(G, "name", pattern=NAME_RE, max_length=128),
    # cluster shape (also the form's nnodes / gpus_per_node fields)
    "trainer.nnodes": _int(N, 1, 64),
    "trainer.n_gpus_per_node": _int(N, 1, 16),
}

PATH_SUFFIXES = ("_dir", "_path", "_file", "_files")
PATH_NAMES = {"dir", "path", "file", "files"}


def is_path_key(bare: str) -> bool:
    """A key whose value names a file or a directory (``*_dir``, ``*_path``, ``*_file``, or such a segment)."""
    return any(part in PATH_NAMES or part.endswith(PATH_SUFFIXES) for part in bare.split("."))


def check(key: str, value, source: str) -> None:
    """Raise UserError (one line: ``source``, the key, why, where to set it instead) unless the form may set
    ``key=value``.

    :param key: the key as typed (a ``+``/``++`` prefix is allowed: ``+data.mm_processor_kwargs.max_pixels``).
    :param value: the parsed value.
    :param source: where it came from, for the message.
    """
    bare = key.lstrip("+")
    if bare == "ray_kwargs" or bare.startswith("ray_kwargs."):
        raise UserError(
            f"{source}: {bare!r} configures Ray itself (the workers' interpreter, runtime env, setup hook, address, "
            f"files), which runs on every training pod; the form may not set ray_kwargs.*: {WHERE_INSTEAD}"
        )
    if bare.rsplit(".", 1)[-1] == "trust_remote_code":
        raise UserError(
            f"{source}: {bare!r} would run the model repository's own code on the worker and every training pod; the "
            f"form may not set it (for a model typed into the form, never): {WHERE_INSTEAD} for that preset's model"
        )
    if is_path_key(bare):
        raise UserError(
            f"{source}: {bare!r} names a file or directory (*_dir, *_path, *_file); the form may not set paths "
            f"(the pipeline derives the run's own): {WHERE_INSTEAD}"
        )
    rule = KEYS.get(bare)
    if rule is None:
        raise UserError(
            f"{source}: {bare!r} is not a key the form may set (its keys: hyperparameters, lengths, sampling, "
            f"cadence, logging; the table in pipeline_steps/training/form_keys.py): {WHERE_INSTEAD}"
        )
    if not rule.fits(value):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise UserError(f"{source}: {bare}={shown} is out of bounds: expected {rule.describe()}")


def override_pattern() -> str:
    """A JSON-schema ``pattern`` for one form override: ``[+[+]]KEY=VALUE`` with KEY from :data:`KEYS`."""
    keys = "|".join(re.escape(k) for k in sorted(KEYS, key=len, reverse=True))
    return rf"^\+{{0,2}}({keys})=.*$"
