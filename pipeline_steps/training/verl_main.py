"""The cluster's training entrypoint: verl's ``main_ppo``, unchanged, with the metrics history kept across attempts.

``python3 -m pipeline_steps.training.verl_main <Hydra overrides>`` runs ``verl.trainer.main_ppo`` with the same
arguments. verl's ``FileLogger`` opens ``$VERL_FILE_LOGGER_PATH`` for writing, so a retried RayJob attempt (which
resumes from the last checkpoint) would erase every earlier step from the log that progress and the report read.
Here the lines of the steps the checkpoint holds are written back right after verl opens the file; lines of later
steps are dropped, because those steps run again.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import yaml

from pipeline_steps import metrics_log
from pipeline_steps.constants import CHECKPOINT_TRACKER


def checkpointed_step(argv: list[str]) -> int:
    """The step of the checkpoint a resumed run starts from (0 without one), read from ``trainer.default_local_dir``."""
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key.lstrip("+") == "trainer.default_local_dir":
            directory = yaml.safe_load(value)  # the renderer writes values as Hydra/YAML scalars ("...")
            try:
                text = (Path(str(directory)) / CHECKPOINT_TRACKER).read_text().strip()
            except OSError:
                return 0
            return int(text) if text.isdigit() else 0
    return 0


def keep_history(argv: list[str]) -> None:
    """Make verl's FileLogger start from the history of the checkpointed steps instead of an empty file."""
    path = os.environ.get(metrics_log.ENV)
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


def resolve_tool_config(argv: list[str]) -> list[str]:
    """``multi_turn.tool_config_path=pkg:...`` (a config shipped in this package) as the image's file path."""
    from pipeline_steps.tools import PKG, resolve_config_path

    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key.lstrip("+").endswith(("multi_turn.tool_config_path", "custom_reward_function.path")):
            text = yaml.safe_load(value)
            if isinstance(text, str) and text.startswith(PKG):
                arg = f"{key}={json.dumps(resolve_config_path(text))}"
        out.append(arg)
    return out


def main(argv: list[str]) -> None:
    argv = resolve_tool_config(argv)
    keep_history(argv)
    sys.argv = ["verl.trainer.main_ppo", *argv]
    runpy.run_module("verl.trainer.main_ppo", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
