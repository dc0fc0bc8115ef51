"""``make demo`` as a user runs it: the whole DAG on the local profile, then nothing left running.

Real Airflow (``airflow dags test``), a real local Ray cluster on free ports, the real steps. The demo must stop the
Ray cluster it started (before: 21 processes, 2.1 GB RSS left on the fixed ports 6379 and 8265).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.budget(750)
def test_demo_runs_the_dag_and_leaves_no_ray_cluster(tmp_path):
    from scripts.demo import ray_temp_dir

    home, airflow_home = tmp_path / "demo", tmp_path / "airflow"
    env = dict(os.environ, PIPELINE_HOME=str(home), AIRFLOW_HOME=str(airflow_home))
    p = subprocess.run(
        [sys.executable, "-m", "scripts.demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "DAG run succeeded" in p.stdout
    assert "stopped the local Ray cluster the demo started" in p.stdout
    assert "run report:" in p.stdout and "exported model:" in p.stdout
    # it learns a skill that depends on the input, measured against untuned baselines printed beside it: the reward
    # rises; on the held-out split the model beats the best constant answer by a clear margin, beats the base by 10
    # points on the problems whose answer is not the most common one, and its majority answers follow the ground
    # truth (many distinct values); so the gate, collapse check included, promotes it (a fresh store)
    m = re.search(r"mean reward of steps \S+: ([0-9.]+), of steps \S+: ([0-9.]+)", p.stdout)
    assert m and float(m.group(2)) > float(m.group(1)), p.stdout[-3000:]
    held = re.search(
        r"held-out avg@\d+ .*: model ([0-9.]+)%, base ([0-9.]+)%, best constant answer .* ([0-9.]+)%", p.stdout
    )
    assert held, p.stdout[-3000:]
    model, base, constant = map(float, held.groups())
    assert model > constant + 10 and model > base, held.group(0)
    non_modal = re.search(r"problems whose answer is not .*: model ([0-9.]+)%, base ([0-9.]+)%", p.stdout)
    assert non_modal and float(non_modal.group(1)) >= float(non_modal.group(2)) + 10, p.stdout[-3000:]
    distinct = re.search(r"distinct majority answers: model (\d+), base \S+, ground truth (\d+)", p.stdout)
    assert distinct and int(distinct.group(1)) >= int(distinct.group(2)) - 2 > 1, p.stdout[-3000:]
    assert "promoted: True (promoted: avg@k" in p.stdout, p.stdout[-3000:]
    # the MLflow server: started and printed, the run linked, stopped at the end
    assert re.search(r"MLflow UI and tracking server: http://127\.0\.0\.1:\d+", p.stdout), p.stdout[-3000:]
    run_link = r"MLflow run \(web UI\): http://127\.0\.0\.1:\d+/#/experiments/\d+/runs/\w+"
    assert re.search(run_link, p.stdout), p.stdout[-3000:]
    assert "stopped the MLflow server the demo started" in p.stdout
    temp = ray_temp_dir(home)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(temp) not in ps, "a process of the demo's Ray cluster is still running"
    assert "--port=6379" not in ps and "--dashboard-port=8265" not in ps
    assert f"sqlite:///{home.resolve() / 'mlflow'}" not in ps, "the demo's MLflow server is still running"
