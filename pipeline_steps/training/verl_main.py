"""The cluster's training entrypoint: verl's ``main_ppo``, unchanged, with the metrics history kept across attempts
and the MLflow run recorded beside the checkpoints.

``python3 -m pipeline_steps.training.verl_main <Hydra overrides>`` runs ``verl.trainer.main_ppo`` with the same
arguments. verl's ``FileLogger`` opens ``$VERL_FILE_LOGGER_PATH`` for writing, so a retried RayJob attempt (which
resumes from the last checkpoint) would erase every earlier step from the log that progress and the report read.
Here the lines of the steps the checkpoint holds are written back right after verl opens the file; lines of later
steps are dropped, because those steps run again.

MLflow (``trainer.logger`` with mlflow, ``$MLFLOW_TRACKING_URI`` set): verl's ``Tracking`` starts its run inside the
trainer's Ray actor, where the driver cannot see it. So the driver starts the run first, named as verl names it
(experiment ``trainer.project_name``, run ``trainer.experiment_name``; a resumed attempt continues the run recorded
beside the checkpoints), writes ``<trainer.default_local_dir>/mlflow_run.json`` (the CPU trainer's record, read by
the train task, the report and export), and hands the id to the actors as ``$MLFLOW_RUN_ID`` in the runtime env of
``main_ppo``'s ``ray.init`` (verl's ``get_ppo_ray_runtime_env``), which verl's ``Tracking`` attaches to.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import sys
from pathlib import Path

import yaml

from pipeline_steps import atomic, library_env, metrics_log, tracking_run
from pipeline_steps.constants import CHECKPOINT_TRACKER
from pipeline_steps.planning.layout import RunLayout

log = logging.getLogger(__name__)


def tracker_step(directory) -> int:
    """The step of the latest checkpoint in ``directory`` (0 without one)."""
    try:
        text = (Path(str(directory)) / CHECKPOINT_TRACKER).read_text().strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0


def checkpointed_step(argv: list[str]) -> int:
    """The step of the checkpoint a resumed run starts from (0 without one), read from ``trainer.default_local_dir``."""
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key.lstrip("+") == "trainer.default_local_dir":
            return tracker_step(yaml.safe_load(value))  # the renderer writes values as Hydra/YAML scalars ("...")
    return 0


def keep_history(argv: list[str]) -> None:
    """Make verl's FileLogger start from the history of the checkpointed steps instead of an empty file."""
    path = os.environ.get(library_env.VERL_FILE_LOGGER_PATH)
    if not path:
        return
    history = metrics_log.history_through(path, checkpointed_step(argv))
    if not history:
        return
    from verl.utils.tracking import FileLogger

    opened = FileLogger.__init__

    def __init__(self, *args, **kwargs):
        opened(self, *args, **kwargs)  # verl truncates the file here
        if os.path.abspath(self.filepath) == os.path.abspath(path):
            self.fp.write(history)

    FileLogger.__init__ = __init__


def mlflow_run(config) -> dict | None:
    """Start (or continue) the MLflow run verl will log to and record it beside the checkpoints.

    :param config: verl's composed config (``trainer.logger``, ``project_name``, ``experiment_name``,
        ``default_local_dir``)
    :returns: the record, or None when the run does not log to MLflow or the server cannot be reached (verl then
        tries by itself, and nothing is recorded)
    """
    trainer = config.trainer
    if "mlflow" not in tracking_run.loggers(trainer.get("logger")):
        return None
    uri = os.environ.get(library_env.MLFLOW_TRACKING_URI)
    if not uri:
        log.warning("trainer.logger has mlflow but MLFLOW_TRACKING_URI is not set: verl logs into the pod only")
        return None
    layout = RunLayout.for_checkpoints(str(trainer.default_local_dir))
    ckpt, run_file = Path(layout.checkpoints), Path(layout.mlflow_record)
    # a resumed attempt continues its run; an attempt that restarts from step 1 starts a new one (as the CPU trainer)
    previous = os.environ.get(library_env.MLFLOW_RUN_ID)
    if not previous and tracker_step(ckpt) > 0:
        previous = (tracking_run.read(run_file) or {}).get("run_id")
    try:
        run = tracking_run.start_run(
            uri, str(trainer.get("project_name") or "verl"), str(trainer.get("experiment_name") or "run"), previous
        )
    except Exception as exc:  # the server is away or refuses the credentials: training goes on, as verl's does
        log.warning("could not start an MLflow run at %s: %s", uri, str(exc).splitlines()[0][:300] if str(exc) else exc)
        return None
    atomic.write_json(run_file, run)
    log.info("MLflow run %s (%s), recorded in %s", run["run_id"], run["url"] or uri, run_file)
    return run


def record_mlflow_run() -> None:
    """Have ``main_ppo``'s ``ray.init`` start the MLflow run (:func:`mlflow_run`) and give its id to every actor.

    ``main_ppo`` builds the runtime env of its ``ray.init`` with ``verl.trainer.constants_ppo.get_ppo_ray_runtime_env``
    (config in hand); ``$MLFLOW_RUN_ID`` joins its ``env_vars``. Ray merges them with the RayJob's own runtime env
    (``MLFLOW_TRACKING_URI`` is there, never ``MLFLOW_RUN_ID``, so the keys do not clash).
    """
    from verl.trainer import constants_ppo

    original = constants_ppo.get_ppo_ray_runtime_env

    def get_ppo_ray_runtime_env(config=None):
        env = original(config)
        run = mlflow_run(config) if config is not None else None
        if run:
            env.setdefault("env_vars", {})[library_env.MLFLOW_RUN_ID] = run["run_id"]
        return env

    constants_ppo.get_ppo_ray_runtime_env = get_ppo_ray_runtime_env
    main_ppo = sys.modules.get("verl.trainer.main_ppo")
    if main_ppo is not None:  # imported already: its name is bound
        main_ppo.get_ppo_ray_runtime_env = get_ppo_ray_runtime_env


PKG_KEYS = ("multi_turn.tool_config_path", "custom_reward_function.path", "agent.agent_loop_config_path")


def resolve_tool_config(argv: list[str]) -> list[str]:
    """``pkg:...`` (a file shipped in an installed package) as the image's file path, for the keys that name a
    file verl reads: ``multi_turn.tool_config_path``, ``custom_reward_function.path`` and
    ``agent.agent_loop_config_path`` (verl's agent-loop registration)."""
    from pipeline_steps.tools import PKG, resolve_config_path

    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key.lstrip("+").endswith(PKG_KEYS):
            text = yaml.safe_load(value)
            if isinstance(text, str) and text.startswith(PKG):
                arg = f"{key}={json.dumps(resolve_config_path(text))}"
        out.append(arg)
    return out


def main(argv: list[str]) -> None:
    argv = resolve_tool_config(argv)
    keep_history(argv)
    record_mlflow_run()
    sys.argv = ["verl.trainer.main_ppo", *argv]
    runpy.run_module("verl.trainer.main_ppo", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
