"""The local Ray backend for real: a local Ray cluster started and stopped by this module
(``ray start --head`` on 127.0.0.1, free ports, a private temp dir), Ray's
``JobSubmissionClient``, and the ``train-local`` step running GRPO on the tiny model
inside Ray jobs. Nothing is mocked.

Covers: submit + status polling to SUCCEEDED with verl's checkpoint layout and metrics;
re-submitting the same id attaches instead of submitting twice; shell metacharacters in
an argument stay inside it; stopping a job mid-run and starting a new attempt on the same
run directory resumes from the checkpoint; shutdown leaves no Ray process behind.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers.train_local_runs import REQUIRED_METRICS, VARIED_REWARD, write_gsm8k_parquet

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids_using(temp_dir: str) -> list[int]:
    """Processes whose command line mentions our cluster's temp dir (verification only)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if temp_dir.encode() in (p / "cmdline").read_bytes():
                    out.append(int(p.name))
            except OSError:
                pass
    return out


@pytest.fixture(scope="module")
def cluster():
    from pipeline_steps.local import ray_cluster as local_ray

    saved = os.environ.pop("RAY_ADDRESS", None)
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray puts Unix sockets here
    try:
        address = local_ray.ensure_cluster(
            port=_free_port(), dashboard_port=_free_port(), num_cpus=1, temp_dir=temp_dir
        )
        # a second call finds the same cluster instead of starting another
        assert local_ray.ensure_cluster(temp_dir=temp_dir) == address
        yield {"address": address, "temp_dir": temp_dir}
    finally:
        assert local_ray.shutdown_cluster(temp_dir=temp_dir)
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved
    deadline = time.monotonic() + 30
    while _pids_using(temp_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _pids_using(temp_dir) == [], "Ray processes survived shutdown_cluster"
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_model):
    d = tmp_path_factory.mktemp("ray_assets")
    reward = d / "varied_reward.py"
    reward.write_text(VARIED_REWARD)
    return {"model": tiny_model, "train": write_gsm8k_parquet(d / "train.parquet"), "reward": reward, "dir": d}


def _argv(assets, out: Path, steps: int, reward: Path | None = None) -> list[str]:
    from pipeline_steps.local import ray_cluster as local_ray

    return local_ray.job_argv(
        None,
        "train-local",
        "--experiment",
        "local_tiny",
        "--train-files",
        str(assets["train"]),
        "--model-path",
        str(assets["model"]),
        "--output-dir",
        str(out),
        "--override",
        f"trainer.total_training_steps={steps}",
        "--override",
        "trainer.save_freq=1",
        "--override",
        f"reward.custom_reward_function.path={reward or assets['reward']}",
    )


HOLDING_REWARD = (
    VARIED_REWARD.replace("def compute_score(", "def _varied(")
    + """
import os, time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # after the first checkpoint, wait while the test's HOLD file exists: the job is stopped here, mid-run
    while os.path.exists({hold!r}) and os.path.exists({tracker!r}):
        time.sleep(0.1)
    return _varied(data_source, solution_str, ground_truth, extra_info)
"""
)


ENV = {"PIPELINE_LOG_LEVEL": "INFO"}


def _jobs_with_id(address, submission_id) -> int:
    from pipeline_steps.local import ray_cluster

    # the module's client: it sends the cluster's token (a bare JobSubmissionClient is refused)
    return sum(1 for j in ray_cluster._client(address).list_jobs() if j.submission_id == submission_id)


def test_submit_poll_attach_and_quoting(cluster, assets):
    from pipeline_steps.local import grpo_cpu
    from pipeline_steps.local import ray_cluster as local_ray

    address = cluster["address"]
    # a hostile-looking (but legal) directory name: it must arrive as one argument, never run
    out = assets["dir"] / "run;$(touch PWNED)`touch PWNED2`'q\"x"
    sid = "pipeline-test-train-1"
    assert local_ray.submit_or_attach(address, sid, _argv(assets, out, 2), env=ENV) == sid
    # a retried worker with the same id attaches
    assert local_ray.submit_or_attach(address, sid, _argv(assets, out, 2), env=ENV) == sid
    seen = set()
    deadline = time.monotonic() + 300
    while (s := local_ray.status(address, sid)) not in local_ray.TERMINAL:
        seen.add(s)
        assert time.monotonic() < deadline, "job did not finish in time"
        time.sleep(1)
    logs = local_ray.logs(address, sid)
    assert s == "SUCCEEDED", logs[-3000:]
    assert seen <= {"PENDING", "RUNNING"}
    assert _jobs_with_id(address, sid) == 1
    assert (
        local_ray.submit_or_attach(address, sid, _argv(assets, out, 2), env=ENV) == sid
    )  # attach to the succeeded job
    assert _jobs_with_id(address, sid) == 1

    assert out.is_dir(), "the output dir must be used verbatim"
    for bad in ("PWNED", "PWNED2"):
        assert not (assets["dir"] / bad).exists() and not (ROOT / bad).exists()
    summary = json.loads(logs.strip().splitlines()[-1])
    assert summary["ok"] and summary["last_step"] == 2
    assert (out / "checkpoints/latest_checkpointed_iteration.txt").read_text() == "2"
    assert (out / "checkpoints/global_step_2/actor/model_world_size_1_rank_0.pt").is_file()
    assert (out / "checkpoints/global_step_2/actor/huggingface/config.json").is_file()
    lines = grpo_cpu.read_metrics(out / "metrics.jsonl")
    assert [x["step"] for x in lines] == [1, 2]
    assert all(k in lines[-1]["data"] for k in REQUIRED_METRICS)


def test_stop_mid_run_then_new_attempt_resumes(cluster, assets):
    from pipeline_steps.local import grpo_cpu
    from pipeline_steps.local import ray_cluster as local_ray

    address = cluster["address"]
    out = assets["dir"] / "resume_run"
    steps = 3
    tracker = out / "checkpoints" / "latest_checkpointed_iteration.txt"
    hold = assets["dir"] / "hold"
    hold.touch()
    reward = assets["dir"] / "holding_reward.py"
    reward.write_text(HOLDING_REWARD.format(hold=str(hold), tracker=str(tracker)))
    first = "pipeline-test-resume-try1"
    local_ray.submit_or_attach(address, first, _argv(assets, out, steps, reward), env=ENV)
    deadline = time.monotonic() + 300
    while not tracker.exists():
        assert local_ray.status(address, first) in local_ray.LIVE, local_ray.logs(address, first)[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert local_ray.stop(address, first)
    assert local_ray.wait(address, first, timeout=60, poll=0.5) == "STOPPED"
    stopped_at = int(tracker.read_text())
    assert stopped_at == 1, "the job must be stopped mid-run, held after its first checkpoint"
    # the failed attempt's id is spent: re-submitting it is refused, not duplicated
    with pytest.raises(local_ray.JobAlreadyFinishedError):
        local_ray.submit_or_attach(address, first, _argv(assets, out, steps, reward), env=ENV)

    hold.unlink()
    second = "pipeline-test-resume-try2"
    local_ray.submit_or_attach(address, second, _argv(assets, out, steps, reward), env=ENV)
    final = local_ray.wait(address, second, timeout=300)
    logs = local_ray.logs(address, second)
    assert final == "SUCCEEDED", logs[-3000:]
    summary = json.loads(logs.strip().splitlines()[-1])
    assert summary["resumed_from_step"] == stopped_at and summary["last_step"] == steps
    assert "resumed from" in logs
    assert [x["step"] for x in grpo_cpu.read_metrics(out / "metrics.jsonl")] == list(range(1, steps + 1))
    assert tracker.read_text() == str(steps)


def test_unknown_job_id(cluster):
    from pipeline_steps.local import ray_cluster as local_ray

    with pytest.raises(local_ray.JobNotFoundError):
        local_ray.status(cluster["address"], "pipeline-test-no-such-job")


def test_a_job_whose_step_exits_2_fails_its_task_without_retry(cluster):
    """A step's bad input (exit 2: e.g. the CPU trainer's allocation the settings cannot fit) ends the local job
    FAILED; the trigger reads the exit code from Ray's own message, and the task fails without retries, as the same
    input fails the same way (exit 1, a transient fault, stays retryable)."""
    import asyncio
    import sys

    from airflow.sdk.exceptions import AirflowFailException

    from operators.backends import complete
    from operators.failures import JobFailed
    from operators.triggers.local_ray import LocalRayJobTrigger
    from pipeline_steps.local import ray_cluster as local_ray

    for code, raised in ((2, AirflowFailException), (1, JobFailed)):
        sid = f"pipeline-test-exit-{code}-{time.time_ns()}"
        local_ray.submit_or_attach(cluster["address"], sid, [sys.executable, "-c", f"raise SystemExit({code})"])
        assert local_ray.wait(cluster["address"], sid, timeout=120) == "FAILED"
        trigger = LocalRayJobTrigger(cluster["address"], sid, poll_interval=0.2)

        async def first_event():
            async for event in trigger.run():
                return event.payload

        event = asyncio.run(first_event())
        assert event.get("exit_code") == code, event
        with pytest.raises(raised) as info:
            complete(None, None, event)
        assert ("bad input: not retried" in str(info.value)) == (code == 2)
