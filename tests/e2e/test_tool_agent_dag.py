"""The whole ``verl_grpo_pipeline`` DAG with the local tool-agent preset: ``airflow dags test`` on the local profile
(as ``make demo`` runs it) with ``{"experiment": "local_tiny_tool_agent", "smoke": true}``.

It proves the plumbing, not learning: the dataset step writes ``tool_agent`` rows (system prompt naming the tool,
``agent_name``, ``tools_kwargs``), the trainer starts the local sandbox server itself (no ``E2B_*`` endpoint set) and
rolls out through verl's ``ToolAgentLoop``, the step's trajectories land in ``rollouts/<step>.jsonl`` of the run
directory and the report has its Trajectories section. The randomly initialised tiny model practically never writes
a well-formed ``<tool_call>``, so whether the tool is actually called is not asserted here;
tests/e2e/test_agent_grpo_cpu.py scripts a call and checks the sandbox's answer reaches the trajectory.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.airflow_cli import dags_test

pytestmark = [
    pytest.mark.needs_root(reason="the local sandbox server needs root (uids, namespaces)"),
    pytest.mark.slow,
]


@pytest.mark.timeout(1500)
def test_tool_agent_preset_runs_the_dag(tmp_path):
    import pyarrow.parquet as pq

    from scripts.local_profile import newest_run, prepare, ray_temp_dir, stop_services, task_states, xcom

    home, airflow_home = tmp_path / "pipeline", tmp_path / "airflow"
    env = prepare(home, airflow_home)
    for k in ("E2B_DOMAIN", "E2B_API_URL", "E2B_API_KEY", "E2B_SANDBOX_URL"):
        env.pop(k, None)  # no sandbox service configured: the trainer must start the local one
    airflow = str(Path(sys.executable).with_name("airflow"))
    try:
        conf = {"experiment": "local_tiny_tool_agent", "smoke": True}
        rc = dags_test(airflow, "verl_grpo_pipeline", conf, env, tmp_path / "pipeline.log")
        log = (tmp_path / "pipeline.log").read_text()
        assert rc == 0, log[-6000:]
        db = airflow_home / "airflow.db"
        run_id = newest_run(db, "verl_grpo_pipeline")
        states = task_states(db, run_id)
        # export is skipped when the gate does not promote (the tiny model rarely beats its base); all else succeeds
        assert states and all(s == "success" for t, s in states.items() if t != "export[-1]"), states

        # the uploaded training rows are tool agent rows
        upload = [u for u in xcom(db, run_id, "upload_dataset") if u["role"] == "train"][0]["upload"]
        train = Path(upload["uri"].removeprefix("file://")) / "train.parquet"
        rows = pq.read_table(train).to_pylist()
        assert rows and all(r["agent_name"] == "tool_agent" for r in rows), rows[:1]
        assert rows[0]["prompt"][0]["role"] == "system" and "code_interpreter" in rows[0]["prompt"][0]["content"]
        assert "code_interpreter" in rows[0]["extra_info"]["tools_kwargs"], rows[0]["extra_info"]

        # the trainer started (and stopped) the local sandbox server
        # the training job's own log (Ray keeps the driver's output in the local cluster's directory)
        drivers = sorted((ray_temp_dir(home) / "session_latest" / "logs").glob("job-driver-*train*.log"))
        job_log = "".join(p.read_text(errors="replace") for p in drivers)
        assert "started the local sandbox server for the code tool" in job_log, (drivers, job_log[-3000:])
        dumps = sorted((home / "store").glob("runs/*/*/rollouts/*.jsonl"))  # runs/<experiment>/<run>/ in the store
        assert [p.name for p in dumps] == ["1.jsonl"], dumps  # smoke: one training step
        samples = [json.loads(line) for line in dumps[0].read_text().splitlines()]
        assert len(samples) == 2 * 4, len(samples)  # data.train_batch_size 2, rollout.n 4
        assert all("num_turns" in s and "turns" in s and s["turns"][0]["role"] == "assistant" for s in samples)

        report = xcom(db, run_id, "report")[0]["report"]
        md = Path(report["report"].removeprefix("file://")).read_text()
        assert "## Trajectories" in md, md[:2000]
        port = re.search(r"started the local sandbox server for the code tool: http://[\w.]+:(\d+)", job_log)
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert f"sandbox-server --port {port.group(1)}" not in ps, "the local sandbox server outlived the training step"
    finally:
        stop_services(home)  # the local Ray cluster and MLflow server the run started
