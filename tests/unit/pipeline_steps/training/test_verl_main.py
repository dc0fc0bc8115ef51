"""The cluster's training entrypoint keeps the metrics history across RayJob attempts (issue 13 item 5).

verl's own ``FileLogger`` (the real class) truncates ``$VERL_FILE_LOGGER_PATH`` when it opens it; a retried attempt
resumes from the last checkpoint, so before this entrypoint the progress and the report lost every earlier step.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline_steps.training import verl_main


def _log(path, steps, torn=False):
    lines = [json.dumps({"step": s, "data": {"critic/score/mean": s / 10}}) for s in steps]
    path.write_text("\n".join(lines) + "\n" + ('{"step": 9, "da' if torn else ""))


def test_a_resumed_attempt_keeps_the_checkpointed_steps_and_drops_the_rest(tmp_path, monkeypatch):
    from verl.utils.tracking import FileLogger

    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    metrics = tmp_path / "metrics.jsonl"
    _log(metrics, [1, 2, 3, 4, 5], torn=True)  # the killed attempt got to step 5, checkpointed at 3
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(metrics))
    monkeypatch.setattr(FileLogger, "__init__", FileLogger.__init__)  # restored after the test
    verl_main.keep_history(["algorithm.adv_estimator=grpo", f'trainer.default_local_dir="{ckpt}"'])
    logger = FileLogger("project", "experiment")  # what verl's Tracking does in the new attempt
    logger.log({"critic/score/mean": 0.4}, step=4)
    logger.finish()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_no_checkpoint_means_a_fresh_log(tmp_path, monkeypatch):
    from verl.utils.tracking import FileLogger

    metrics = tmp_path / "metrics.jsonl"
    _log(metrics, [1, 2])  # an attempt that died before its first checkpoint: those steps run again
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(metrics))
    monkeypatch.setattr(FileLogger, "__init__", FileLogger.__init__)
    verl_main.keep_history([f"trainer.default_local_dir={tmp_path / 'none'}"])
    FileLogger("p", "e").finish()
    assert metrics.read_text() == ""


@pytest.mark.slow  # about 9 s of CPU: verl's main_ppo in a subprocess
def test_the_entrypoint_hands_its_arguments_to_verls_main_ppo(tmp_path):
    """Hydra's ``--cfg job`` makes verl's own main_ppo print the composed config and exit: the overrides arrive."""
    p = subprocess.run(
        [sys.executable, "-m", "pipeline_steps.training.verl_main", "--cfg", "job", "trainer.total_epochs=7"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "total_epochs: 7" in p.stdout
