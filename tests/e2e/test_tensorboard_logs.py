"""TensorBoard logs in guide 003's shape (``trainer.logger=['console','tensorboard']``), for real: a short CPU
training logs through verl's ``Tracking`` (its tensorboard backend, torch's ``SummaryWriter``) into the run
directory's ``tensorboard/``; the event files are read back with TensorBoard's own ``EventAccumulator`` and served by
the ``tensorboard --logdir`` command the run reports. On the cluster the RayJob gives verl the same directory on the
bucket mount as ``$TENSORBOARD_DIR``.
"""

from __future__ import annotations

import json
import math
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.helpers.render import helm_env
from tests.helpers.train_local_runs import run_cli, train_local_args

ROOT = Path(__file__).resolve().parents[2]
GUIDE_003_LOGGER = "trainer.logger=['console','tensorboard']"  # seed 003's script, verbatim


def _scalars(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
def test_guide_003_logger_writes_event_files_into_the_run_directory(assets, tmp_path):  # noqa: F811
    from pipeline_steps import metrics_log

    out = tmp_path / "run"
    args = train_local_args(assets, out, steps=3) + ["--override", GUIDE_003_LOGGER]
    proc = run_cli(*args, env={"VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl"), "TENSORBOARD_DIR": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    logdir = out / "tensorboard"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["tensorboard"] == {"uri": str(logdir), "command": f"tensorboard --logdir {logdir}"}
    assert f"tensorboard --logdir {logdir}" in proc.stderr  # the step's log says where they are
    assert list(logdir.glob("events.out.tfevents.*")), sorted(p.name for p in out.rglob("*"))
    assert not (ROOT / "tensorboard_log").exists()  # verl's default (relative to the working directory) unused

    scalars = _scalars(logdir)
    lines = metrics_log.read(out / "metrics.jsonl").by_step()  # the file logger: what progress and the report read
    assert sorted(lines) == [1, 2, 3]
    assert sorted(scalars["critic/score/mean"]) == [1, 2, 3]  # one point per training step
    for name in ("critic/score/mean", "actor/pg_loss", "actor/entropy", "response_length/mean", "timing_s/step"):
        for step, value in scalars[name].items():
            want = float(lines[step][name])
            assert math.isclose(value, want, rel_tol=1e-6, abs_tol=1e-6), (name, step, value, want)  # float32
    assert {k for data in lines.values() for k in data} == set(scalars)  # the same names as the file logger

    report = run_cli("report", "--run-dir", str(out))  # the run's report says where the logs are and how to look
    assert report.returncode == 0, report.stderr[-3000:]
    md = (out / "report" / "report.md").read_text()
    assert f"| TensorBoard logs | `{logdir}`: `tensorboard --logdir {logdir}` |" in md


@pytest.mark.slow
def test_the_reported_command_serves_the_scalars(assets, tmp_path):  # noqa: F811
    """The ``tensorboard --logdir`` command the run reports, as a user runs it: its HTTP API serves the steps."""
    out = tmp_path / "run"
    args = train_local_args(assets, out, steps=2) + ["--override", GUIDE_003_LOGGER]
    proc = run_cli(*args, env={"VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    command = json.loads(proc.stdout.strip().splitlines()[-1])["tensorboard"]["command"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = str(Path(sys.executable).with_name("tensorboard"))
    argv = [exe, *shlex.split(command)[1:], "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run=.&tag=critic/score/mean"
    try:
        deadline, points = time.monotonic() + 90, None
        while time.monotonic() < deadline and not points:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    points = json.loads(r.read())  # [[wall_time, step, value], ...]
            except OSError:
                time.sleep(0.5)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert points and [p[1] for p in points] == [1, 2], points


@pytest.mark.slow
def test_without_the_tensorboard_logger_no_event_files(assets, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    args = train_local_args(assets, out, steps=1) + ["--override", "trainer.logger=['console']"]
    proc = run_cli(*args, env={"VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["tensorboard"] is None
    assert not (out / "tensorboard").exists()


def _render(preset: str, overrides=()):
    from pipeline_steps.training import experiment
    from pipeline_steps.training.mounts import MountMap
    from pipeline_steps.training.rayjob_manifest import build_rayjob

    ckpt = f"oss://verl-store/runs/{preset}/manual__1/checkpoints"  # the plan's run directory layout
    exp = experiment.load(preset, list(overrides), derived={"trainer.default_local_dir": ckpt})
    mounts = MountMap.from_config(json.loads((ROOT / "k8s/overlays/ack/mounts.json").read_text()))
    job = build_rayjob(exp, dag_id="d", run_id="manual__1", task_id="train", mounts=mounts)
    return job, ckpt


def test_the_guide_003_preset_logs_to_tensorboard_in_the_run_directory_on_the_cluster(monkeypatch):
    monkeypatch.setenv("PIPELINE_TRAIN_IMAGE", "registry.local/verl@sha256:" + "0" * 64)
    # the deployment's sandbox services (the preset names ags-shanghai), as the shipped Helm values map them
    for name, value in helm_env("PIPELINE_SANDBOX_SERVICES").items():
        monkeypatch.setenv(name, value)
    job, ckpt = _render("dapo_retool_qwen3_4b")
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    pod_ckpt = json.loads(job["spec"]["entrypoint"].split("trainer.default_local_dir=", 1)[1].split("'")[0])
    assert env["TENSORBOARD_DIR"] == pod_ckpt[: -len("checkpoints")] + "tensorboard"  # beside checkpoints/
    assert env["VERL_FILE_LOGGER_PATH"] == pod_ckpt[: -len("checkpoints")] + "metrics.jsonl"
    assert '\'trainer.logger=["console","file","tensorboard"]\'' in job["spec"]["entrypoint"]
    assert job["metadata"]["annotations"]["verl-grpo-pipeline/tensorboard-uri"] == ckpt[: -len("checkpoints")] + (
        "tensorboard"
    )

    job, _ = _render("dapo_retool_qwen3_4b", ["trainer.logger=['console','file']"])  # the form turned it off
    assert "TENSORBOARD_DIR" not in yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert "verl-grpo-pipeline/tensorboard-uri" not in job["metadata"]["annotations"]
