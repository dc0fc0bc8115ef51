"""`make demo`: run the whole DAG once on the bundled local profile and say where everything went.

Local profile: SQLite Airflow metadata in ./.airflow, a local object store (file://) in ./.demo/store, an offline
Hugging Face cache built from the shipped fixtures, a local Ray cluster, and the tiny locally built model.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def local_profile_env(home: Path) -> dict[str, str]:
    """Environment for the embedded default; tests use the same function."""
    return {
        "PIPELINE_HOME": str(home),
        "PIPELINE_STORE_URI": f"file://{home / 'store'}",
        "HF_HUB_CACHE": str(home / "hf-cache"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
    }


def prepare(home: Path, airflow_home: Path) -> dict[str, str]:
    from pipeline_steps import local_hub

    env = dict(os.environ, **local_profile_env(home), AIRFLOW_HOME=str(airflow_home))
    local_hub.build_cache(ROOT / "tests" / "fixtures" / "hub", home / "hf-cache")
    airflow = str(Path(sys.executable).with_name("airflow"))
    subprocess.run([airflow, "db", "migrate"], env=env, check=True, stdout=subprocess.DEVNULL)
    subprocess.run([airflow, "pools", "set", "gpu", "8", "GPUs on the training cluster"], env=env, check=True, stdout=subprocess.DEVNULL)
    return env


def main() -> int:
    home = Path(os.environ.get("PIPELINE_HOME") or ROOT / ".demo")
    airflow_home = Path(os.environ.get("AIRFLOW_HOME") or ROOT / ".airflow")
    env = prepare(home, airflow_home)
    conf = {"experiment": "local_tiny", "backend": "local", "datasets": ["gsm8k"], "prepare_datasets": ["dapo_math", "geometry3k"]}
    logical = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    airflow = str(Path(sys.executable).with_name("airflow"))
    print(f"running verl_grpo_pipeline on the local profile (AIRFLOW_HOME={airflow_home}) ...", flush=True)
    rc = subprocess.run([airflow, "dags", "test", "verl_grpo_pipeline", logical, "--conf", json.dumps(conf)], env=env).returncode
    store = home / "store"
    print("\noutputs:")
    for label, sub in [("datasets", "datasets"), ("staged models", "models"), ("runs (checkpoints, metrics, eval, report)", "runs"),
                       ("exported models", "models/exported")]:
        path = store / sub
        print(f"  {label:45s} {path}{'' if path.exists() else '  (not produced)'}")
    print(f"  {'work dir (snapshots, processed parquet)':45s} {home / 'work'}")
    print(f"\nDAG run {'succeeded' if rc == 0 else 'FAILED (exit %d): see the task logs above' % rc}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
