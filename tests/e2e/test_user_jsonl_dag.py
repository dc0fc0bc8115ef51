"""A user's own JSONL files chosen in the trigger form, through the whole ``verl_grpo_pipeline`` DAG (``airflow dags
test`` on the local profile, as ``make demo`` runs it): ``{"experiment": "local_tiny", "smoke": true, "train_jsonl":
..., "validation_jsonl": ...}`` with two files in a ``file://`` store. (The README's example, the offline Hub's
``hf://datasets/pipeline-local/chat-jsonl/data/{train,validation}.jsonl``, passed this test too; it is a parameter
left out of ``make test`` to keep the suite under 40 minutes: tests/unit/pipeline_steps/data/test_user_jsonl.py runs Hub
files, pinned and unpinned, through the same download and preprocess steps.)

The files go through download (versioned by their content, or by the Hub commit current at the run's logical date),
preprocess (train and validation splits, rollout_extra a struct) and upload (a dataset version in the store, emitted
as an Asset named like the registry datasets'); the training run trains on the train split instead of the preset's
gsm8k and validates on the validation split.

The same run shows the plan made once (issue 25): run under :mod:`tests.helpers.count_plan_calls`, it reads its preset,
resolves its backend and turns its form (the files and a learning rate) into verl overrides once each, in the
``plan`` task; every later task reads the plan (XCom, and ``plan.json`` in the run directory, which the lineage
matches). One whole-DAG run serves both checks: each costs minutes of make test's two cores.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import sys
from pathlib import Path

import pytest

from tests.helpers.airflow_cli import dags_test
from tests.helpers.count_plan_calls import assert_launched_as_planned

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _write(path: Path, items) -> bytes:
    lines = [
        json.dumps(
            {
                "messages": [{"role": "user", "content": f"What is the largest of {a}, {b} and {c}? Answer: N"}],
                "rollout_extra": {"solution": str(max(a, b, c)), "digits": [a, b, c]},
            }
        )
        for a, b, c in items
    ]
    path.write_text("\n".join(lines) + "\n")
    return path.read_bytes()


HUB = "hf://datasets/pipeline-local/chat-jsonl/data"


@pytest.mark.budget(900)  # 408 s in make test at a load average of 10
@pytest.mark.parametrize("where", ["store"])  # "hub": see the module's docstring
def test_jsonl_files_chosen_in_the_form_train_and_validate_in_a_run_planned_once(where, tmp_path):
    import pyarrow.parquet as pq

    from scripts.local_profile import newest_run, prepare, stop_services, task_states, xcom

    home, airflow_home = tmp_path / "pipeline", tmp_path / "airflow"
    env = prepare(home, airflow_home)
    user = tmp_path / "user"
    user.mkdir()
    train = _write(user / "my_arith.jsonl", [(i % 10, (3 * i) % 10, (7 * i) % 10) for i in range(20)])
    val = _write(user / "my_arith_val.jsonl", [(i, 9 - i, 4) for i in range(6)])
    if where == "store":
        files = {
            "train_jsonl": f"file://{user / 'my_arith.jsonl'}",
            "validation_jsonl": f"file://{user / 'my_arith_val.jsonl'}",
        }
        name = "my_arith"
        # the version is the files' content: sha256 over split name and each file's sha256
        h = hashlib.sha256()
        for split, data in (("train", train), ("validation", val)):
            h.update(f"{split}\0{hashlib.sha256(data).hexdigest()}\0".encode())
        revision = h.hexdigest()[:16]
        first_val = {"digits": [0, 9, 4], "solution": "9"}
    else:  # the README's example: unpinned, so the repository's newest commit at the run's logical date
        files = {"train_jsonl": f"{HUB}/train.jsonl", "validation_jsonl": f"{HUB}/validation.jsonl"}
        name = "chat-jsonl"
        index = json.loads((home / "hf-cache" / "revision-index" / "pipeline-local--chat-jsonl.json").read_text())
        revision = index[-1]["commit"]
        first_val = None
    conf = {"experiment": "local_tiny", "smoke": True, "learning_rate": 1e-5, **files}
    counts_file = tmp_path / "counts.json"
    env["PIPELINE_CALL_COUNTS"] = str(counts_file)
    try:
        rc = dags_test(
            [sys.executable, "-m", "tests.helpers.count_plan_calls"],
            "verl_grpo_pipeline",
            conf,
            env,
            tmp_path / "pipeline.log",
        )
        log = (tmp_path / "pipeline.log").read_text()
        assert rc == 0, log[-6000:]
        db = airflow_home / "airflow.db"
        run_id = newest_run(db)
        states = task_states(db, run_id)
        assert states and all(s == "success" for t, s in states.items() if t != "export[-1]"), states

        uploads = {u["dataset"]: u for u in xcom(db, run_id, "upload_dataset")}
        assert set(uploads) == {name, "aime2024"}, uploads.keys()  # the form's file instead of gsm8k
        mine = uploads[name]
        assert mine["role"] == "train" and mine["download"]["commit"] == revision
        content = mine["preprocess"]["content_hash"]
        assert mine["upload"]["uri"] == f"file://{home / 'store'}/datasets/{name}/{revision}/{content[:16]}"
        with sqlite3.connect(db) as c:
            assets = {a for (a,) in c.execute("SELECT name FROM asset")}
        assert f"{name}@{revision[:7]} ({content[:7]})" in assets, assets

        # trained on its train split, validated on its validation split
        inputs = {k: xcom(db, run_id, "collect_inputs", k)[0] for k in ("train_files", "val_files")}
        base = mine["upload"]["uri"]
        assert inputs == {"train_files": [f"{base}/train.parquet"], "val_files": [f"{base}/validation.parquet"]}
        rows = pq.read_table(base.removeprefix("file://") + "/validation.parquet").to_pylist()
        assert len(rows) == (6 if where == "store" else 8)  # smoke: at most 8 rows per split
        extra = rows[0]["extra_info"]["rollout_extra"]
        assert (
            isinstance(extra, dict)
            and extra == (first_val or extra)
            and set(extra) == ({"digits", "solution"} if first_val else {"symbols", "solution"})
        )
        metrics = [
            json.loads(x) for p in (home / "store").glob("runs/*/*/metrics.jsonl") for x in p.read_text().splitlines()
        ]
        val_keys = {k for m in metrics for k in m["data"] if k.startswith("val-core/math_dapo/")}
        assert val_keys, [sorted(m["data"]) for m in metrics][:1]
        assert any("critic/score/mean" in m["data"] for m in metrics)  # and a training step ran

        # planned once: the preset read, the backend resolved and the overrides computed in the plan task only
        recorded = json.loads(counts_file.read_text())
        assert recorded["counts"] == {"preset_loads": 1, "backend_resolutions": 1, "overrides_computations": 1}, (
            recorded
        )
        plan = xcom(db, run_id, "plan", "run")[0]
        run_dir = Path(plan["run_dir"].removeprefix("file://"))
        assert json.loads((run_dir / "plan.json").read_text()) == plan
        assert plan["backend"] == "local" and plan["overrides"][0] == "actor_rollout_ref.actor.optim.lr=1e-05"
        # every step ran the argv the plan recorded (placeholders filled in from upstream results only)
        assert_launched_as_planned(plan, recorded)
        lineage = json.loads((run_dir / "lineage.json").read_text())
        assert lineage["experiment"]["preset_sha256"] == plan["preset_sha256"]
        assert lineage["experiment"]["overrides"] == plan["overrides"]
    finally:
        stop_services(home)
