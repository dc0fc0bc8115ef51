"""What a user may override: the one gate between typed text (trigger form, ``--override``) and verl's Hydra config.

Hydra instantiates any mapping that carries ``_target_`` (verl's ``validate_config`` builds its dataclasses that
way, in the Airflow worker), so a user-typed ``{_target_: builtins.open, ...}`` would call any importable function.
User overrides therefore may not contain:

* a special key (``_target_``, ``_args_``, ``_partial_``, ``_recursive_``, ``_convert_``, or any ``_name_``) at
  any depth of the key path or of the value;
* an interpolation or resolver (``${...}``, e.g. ``${oc.env:AWS_SECRET_ACCESS_KEY}`` copying a worker secret into
  the config) anywhere in the value;
* a ``hydra.*`` key, or a deletion (``~key``);
* a key the pipeline derives (data files, model path, checkpoint directory, resume): the message says what sets it;
* from the trigger form (:func:`check_form`), any key outside the reviewed table of
  :mod:`pipeline_steps.training.form_keys` (an allow-list with each key's type and range; no path, no ``ray_kwargs``,
  no ``trust_remote_code``): anything else belongs in a preset. A key that names code verl imports (a reward
  function's file, a tool or agent-loop config listing classes, a module, a class) is refused first with a message
  of its own: pre-flight imports a reward file in the Airflow worker and verl imports all of them in the training pods
  (a ``pkg:<package>/<path>`` file an installed package ships passes that check, and a preset may name it);
* from the trigger form with a model typed into it (:func:`check_form_model`), a preset's ``trust_remote_code``.
  (``--override`` on a step's command line is typed by someone with a shell.)

Presets (packaged, or a deployment's own directory) pass the same checks except the derived-key one.
"""

from __future__ import annotations

import re

from pipeline_steps.errors import UserError

SPECIAL_KEY = re.compile(r"^_[A-Za-z0-9]*_$")
# verl keys the pipeline sets itself, and what sets them
PIPELINE_KEYS = {
    "data.train_files": "the pipeline (the training splits of the datasets chosen in the form or preset)",
    "data.val_files": "the pipeline (the validation splits of the preset's datasets)",
    "actor_rollout_ref.model.path": "the pipeline (the model staged by stage_model; choose it with the form's model)",
    "trainer.default_local_dir": "the pipeline (the run's checkpoint directory under the store's runs/ area)",
    "trainer.resume_mode": "the pipeline (a retried attempt resumes from the run's last checkpoint)",
    "trainer.resume_from_path": "the pipeline (a retried attempt resumes from the run's last checkpoint)",
}

# verl keys whose value is code to import: a file (a user may name a shipped ``pkg:`` one) or a module/class name
CODE_FILE_KEYS = {
    "reward.custom_reward_function.path",
    "custom_reward_function.path",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path",
    "actor_rollout_ref.rollout.multi_turn.function_tool_path",
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path",
    "actor_rollout_ref.rollout.agent.agent_loop_config_path",
    "actor_rollout_ref.rollout.agent.custom_async_server.path",
    "data.tool_config_path",
    "data.function_tool_path",
    "data.custom_cls.path",
    "reward.reward_manager.module.path",
    "reward_model.reward_loop_module_path",
    "trainer.v1.sampler.custom_sampler.path",
}
CODE_NAME_KEYS = {
    "actor_rollout_ref.model.external_lib",
    "critic.model.external_lib",
    "reward_model.model.external_lib",
    "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module",
    "reward_model.reward_loop_class_name",
    "trainer.checkpoint_callback_class",
}


def _check_code_key(bare: str, value, source: str) -> None:
    if value is None:
        return
    if bare in CODE_NAME_KEYS:
        raise UserError(
            f"{source}: {bare!r} names a module or class that verl would import; set it in a preset "
            "(a deployment's presets directory), not in a run's overrides"
        )
    if bare not in CODE_FILE_KEYS:
        return
    if not (isinstance(value, str) and value.startswith("pkg:")):
        raise UserError(
            f"{source}: {bare!r} names code that would run in the worker and the training pods; choose a file the "
            "package ships (pkg:...) or set it in a preset (a deployment's presets directory)"
        )
    from pipeline_steps.tools import resolve_config_path

    try:  # a shipped file exists in an installed package (ours, or a deployment's installed beside it)
        resolve_config_path(value)
    except UserError as exc:
        raise UserError(
            f"{source}: {bare!r} is not a file the package or the deployment ships ({exc}); choose an existing "
            "pkg: file or set it in a preset (a deployment's presets directory)"
        ) from None


def _walk(value, path: str):
    """Yield (where, key-or-None, string-or-None) for every mapping key and string in ``value``."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield f"{path}.{k}", str(k), None
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}[{i}]")
    elif isinstance(value, str):
        yield path, None, value


def check(key: str, value, source: str, *, user: bool = True) -> None:
    """Raise UserError (one line naming ``source`` and the key) when ``key=value`` may not be applied.

    :param key: the dotted key as typed, with any ``+``/``++`` prefix.
    :param value: the parsed value (scalar, list or mapping).
    :param source: where it came from, for the message (``--override``, ``verl_overrides``, a preset file).
    :param user: typed by a user (derived keys are refused too), or from a preset.
    """
    bare = key.lstrip("+")
    if key.startswith("~"):
        raise UserError(f"{source}: deleting a key ({key!r}) is not allowed; override its value instead")
    if bare == "hydra" or bare.startswith("hydra."):
        raise UserError(f"{source}: {bare!r} is Hydra's own configuration, not verl's; it cannot be overridden here")
    for part in bare.split("."):
        if SPECIAL_KEY.match(part):
            raise UserError(
                f"{source}: key {bare!r} contains {part!r}, a Hydra instantiation key; "
                "such keys are refused because they would run code in the worker"
            )
    if user and bare in PIPELINE_KEYS:
        raise UserError(f"{source}: {bare!r} is set by {PIPELINE_KEYS[bare]}; remove this override")
    for where, k, s in _walk(value, bare):
        if k is not None and SPECIAL_KEY.match(k):
            raise UserError(
                f"{source}: the value of {bare!r} holds the key {k!r} (at {where}), a Hydra instantiation key; "
                "such keys are refused because they would run code in the worker"
            )
        if s is not None and ("${" in s or "_target_" in s):
            what = "an interpolation/resolver (${...})" if "${" in s else "'_target_'"
            raise UserError(f"{source}: the value of {bare!r} contains {what} (at {where}); write the literal value")


def check_form(key: str, value, source: str) -> None:
    """What the trigger form (and the REST API's ``conf``) may set beyond :func:`check`: only the keys of the reviewed
    table :data:`pipeline_steps.training.form_keys.KEYS`, each within its type and range; never a path, ``ray_kwargs``
    or ``trust_remote_code``. Code for verl to import is named as such first (at any depth of the value)."""
    from pipeline_steps.training import form_keys

    bare = key.lstrip("+")
    _check_code_key(bare, value, source)
    for where, k, s in _walk(value, bare):
        if s is not None and where != bare:  # a mapping value can hold a code key too
            _check_code_key(where, s, source)
    form_keys.check(key, value, source)


TRUST_REMOTE_CODE = "trust_remote_code"


def check_form_model(verl: dict, form_model: str | None, preset_model: str | None, source: str) -> None:
    """A preset may trust its own model's repository code (``*.trust_remote_code: true``), never a model typed into
    the form: that would run the typed repository's code on the worker and every training pod.

    :param verl: the run's verl overrides (the preset's map and the form's).
    :param form_model: the model typed into the form (None: the preset's own model).
    :param preset_model: the preset's model (``model.source``).
    :param source: the preset, for the message.
    """
    if not form_model or form_model == preset_model:
        return
    for key, value in verl.items():
        bare = str(key).lstrip("+")
        if bare.rsplit(".", 1)[-1] == TRUST_REMOTE_CODE and value not in (False, None, "false", "False", 0):
            raise UserError(
                f"model {form_model!r} typed into the form: {source} sets {bare}={value!r} for its own model "
                f"({preset_model}), which would run {form_model}'s repository code on the training pods; choose the "
                "preset's model, or a preset made for this model (under $PIPELINE_PRESETS_DIR)"
            )
