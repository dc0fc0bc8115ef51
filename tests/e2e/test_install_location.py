"""The package works wherever it is installed: what the Airflow image and the training image rely on.

Builds the wheel, installs it (no dependencies) into a fresh virtual environment whose only other entry on the
path is the test venv's site-packages (the dependencies; the checkout's editable finder there is not processed),
then, from a working directory outside the repository, imports both DAG files from a copied dags folder and runs
``preflight`` and ``render-rayjob`` for a cluster preset. Presets, the RayJob template and the offline Hub
fixtures must come from the installed package's data.
"""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "k8s" / "crds" / "ray.io_rayjobs.v1.7.0.yaml"
pytestmark = pytest.mark.slow  # builds a wheel and installs it into a fresh venv: about 30 s of CPU


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("install")
    build = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp / "dist"), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next((tmp / "dist").glob("verl_grpo_pipeline-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    fresh_site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (fresh_site / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, timeout=300
    )
    # a clean build tree does not leave files behind in the checkout
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    work = tmp / "elsewhere"
    shutil.copytree(ROOT / "dags", work / "dags", ignore=shutil.ignore_patterns("__pycache__"))
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": str(tmp),
        "AIRFLOW_HOME": str(tmp / "airflow"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(work / "dags"),
    }
    return {"py": str(py), "work": work, "env": env, "site": fresh_site}


def run(inst, *args, timeout=300):
    return subprocess.run(
        [inst["py"], *args], cwd=inst["work"], env=inst["env"], capture_output=True, text=True, timeout=timeout
    )


def test_package_and_its_data_come_from_the_install_not_the_checkout(installed):
    p = run(
        installed,
        "-c",
        textwrap.dedent("""
        import json, pipeline_steps, operators
        from pipeline_steps.training import experiment
        from pipeline_steps.training import rayjob_manifest as rayjob
        from pipeline_steps.local import offline_hub
        from pipeline_steps.tools import resolve_config_path
        hub = sorted(p.name for p in offline_hub.FIXTURES.iterdir())
        loops = resolve_config_path("pkg:pipeline_steps.rollouts/mcp_math_loop.yaml")
        print(json.dumps({"pkg": pipeline_steps.__file__, "ops": operators.__file__, "loops": loops,
                          "presets": experiment.preset_names(), "template": str(rayjob.TEMPLATE), "hub": hub}))
    """),
    )
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for key in ("pkg", "ops", "template", "loops"):
        assert got[key].startswith(str(installed["site"])), (key, got[key])
        assert not got[key].startswith(str(ROOT))
    assert {"local_tiny", "gsm8k_qwen2_5_3b", "dapo_qwen3_4b"} <= set(got["presets"])
    assert {"openai", "Maxwell-Jia"} <= set(got["hub"])


def test_both_dag_files_import_from_a_copied_dags_folder(installed):
    p = run(
        installed,
        "-c",
        textwrap.dedent("""
        import json
        from airflow.dag_processing.dagbag import DagBag
        bag = DagBag(dag_folder="dags")
        print(json.dumps({"dags": sorted(bag.dag_ids), "errors": {k: v[:300] for k, v in bag.import_errors.items()}}))
    """),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["errors"] == {}
    assert got["dags"] == ["verl_doctor", "verl_evaluate_model", "verl_grpo_pipeline"]


def test_preflight_and_render_rayjob_run_from_the_install(installed):
    p = run(installed, "-m", "pipeline_steps", "preflight", "--experiment", "gsm8k_qwen2_5_3b", "--skip-store-check")
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1])["ok"] is True
    mounts = (ROOT / "k8s/overlays/ack/mounts.json").read_text()
    installed = dict(
        installed, env=dict(installed["env"], PIPELINE_TRAIN_IMAGE="registry.example.com/t@sha256:" + "0" * 64)
    )
    p = run(
        installed,
        "-m",
        "pipeline_steps",
        "render-rayjob",
        "--experiment",
        "gsm8k_qwen2_5_3b",
        "--output",
        "rayjob.yaml",
        "--checkpoint-uri",
        "oss://verl-store/runs/x/checkpoints",
        "--mounts",
        mounts,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    job = yaml.safe_load((installed["work"] / "rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and "pipeline_steps.training.verl_main" in job["spec"]["entrypoint"]
    from tests.helpers.k8s_api_stand_in import _validator

    errors = [e.message for e in _validator(str(CRD)).iter_errors(job)]
    assert errors == []


def test_a_deployment_preset_directory_shadows_and_extends(installed, tmp_path):
    packaged = (ROOT / "pipeline_steps/training/presets/local_tiny.yaml").read_text()
    assert "  actor_rollout_ref.rollout.n: 4\n" in packaged
    (tmp_path / "team_preset.yaml").write_text(packaged)  # extends: a new name
    # shadows: the deployment's local_tiny, with rollout n 8 instead of the packaged 4
    (tmp_path / "local_tiny.yaml").write_text(packaged.replace("rollout.n: 4\n", "rollout.n: 8\n"))
    env = dict(installed["env"], PIPELINE_PRESETS_DIR=str(tmp_path))
    for name, rollout_n in (("team_preset", 4), ("local_tiny", 8)):
        p = subprocess.run(
            [installed["py"], "-m", "pipeline_steps", "preflight", "--experiment", name, "--skip-store-check"],
            cwd=installed["work"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        assert json.loads(p.stdout.strip().splitlines()[-1])["rollout_n"] == rollout_n, name
    p = subprocess.run(
        [installed["py"], "-m", "pipeline_steps", "preflight", "--experiment", "no_such_preset"],
        cwd=installed["work"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2 and "team_preset" in p.stderr and "local_tiny" in p.stderr
