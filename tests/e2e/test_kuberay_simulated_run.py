"""The whole kuberay path in one DAG run (issue 13 item 4): ``airflow dags test`` with ``backend=kuberay`` against
the Kubernetes API stand-in, whose controller runs every RayJob's real entrypoint as its pod would
(:class:`tests.helpers.k8s_api_stand_in.PodRunner`: ``/bin/sh -c`` on the rendered entrypoint, the container's env,
secrets by reference, the job's runtime env, the bucket mount path ``/mnt/store`` mapped onto the local store).

Swapped, because they cannot run here: the trainer module (``pipeline_steps.training.verl_main`` -> the CPU trainer
``tests.helpers.cpu_main_ppo``, which takes the same Hydra overrides) and evaluate's vLLM generator (``--generator
vllm`` -> ``hf``). Everything else runs as in the pods: argv quoting, env, mounts, ``resume_mode``, the checkpoint
directory, the step summaries written through the mount and read back by the operator, export's upload and promotion.
The metrics history kept across the killed attempt is the CPU trainer's doing here (it replaces the entrypoint
module); the real entrypoint's history keeping is tested with verl's own FileLogger in
tests/unit/pipeline_steps/training/test_verl_main.py. The preset is a cluster-shaped copy of ``local_tiny`` (1 node x 1
GPU) so that CPU training finishes in seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from tests.helpers.k8s_api_stand_in import PodRunner, StandIn

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
MOUNT = "/mnt/store"
NS = "training"
MLFLOW_SECRET = "mlflow-tracking"


# The first attempt waits in step 2's reward once step 1 is logged, until the test has killed it: a CPU step of the
# tiny model takes ~0.1 s, shorter than the kill's poll, so without the wait the kill could land after any step.
HOLDING_REWARD = """
import json, os, time


def _step_1_logged():
    try:
        with open(os.environ.get("VERL_FILE_LOGGER_PATH", "")) as f:
            return any(json.loads(line).get("step", 0) >= 1 for line in f if line.strip())
    except (OSError, ValueError):
        return False


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    while os.path.exists({hold!r}) and _step_1_logged():
        open({hold!r} + ".reached", "w").close()  # step 1 is logged and checkpointed: step 2 is under way
        time.sleep(0.05)
    return float(len(set(solution_str)) % 3)  # differs within a group, so the update is not zero
"""


def _preset(directory: Path, reward: Path) -> None:
    spec = yaml.safe_load((ROOT / "pipeline_steps/training/presets/local_tiny.yaml").read_text())
    spec.update(name="tiny_cluster", backend="cluster", description="local_tiny, cluster-shaped (simulated run)")
    spec["cluster"] = {
        "nnodes": 1,
        "gpus_per_node": 1,
        "image": "registry.local/verl-grpo-train@sha256:" + "0" * 64,
        "head": {"cpu": "2", "memory": "4Gi"},
        "export": {"cpu": "2", "memory": "8Gi"},
        "worker": {"cpu": "2", "memory": "8Gi", "shm": "1Gi"},
        "service_account": "verl-ray",
        "env": {"PIPELINE_SIMULATED": "1"},
        "secrets": [{"env": "HF_TOKEN", "secret": "hf-token", "key": "token", "optional": True}],
        "mlflow_secret": MLFLOW_SECRET,  # the Secret holding the connection's login for the pods
    }
    spec["verl"].pop("trainer.n_gpus_per_node", None)  # from cluster.gpus_per_node
    spec["verl"]["trainer.experiment_name"] = "tiny_cluster"
    spec["verl"]["actor_rollout_ref.rollout.name"] = "vllm"  # what a cluster preset sets (the CPU trainer samples)
    spec["verl"]["reward.custom_reward_function.path"] = str(reward)  # a deployment preset may name its own code
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiny_cluster.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


def _step_logged(hold: Path):
    """The kill condition: the first training attempt has logged and checkpointed step 1 (the tracker advances after
    the step's line) and waits in step 2's reward; the hold is lifted as the kill is sent, so the retried attempt
    runs through."""

    def condition(env: dict) -> bool:
        if Path(f"{hold}.reached").exists():
            hold.unlink(missing_ok=True)
            return True
        return False

    return condition


@pytest.mark.budget(900)  # 436 s in make test at a load average of 10
def test_a_kuberay_run_end_to_end_with_each_rayjobs_entrypoint_executed(tmp_path, monkeypatch):
    """3 training steps; the first train pod is killed (SIGKILL, as a lost node) after step 1: KubeRay reports
    Failed/AppFailed, Airflow retries the task, a new RayJob attempt resumes from the step-1 checkpoint, and the
    metrics history keeps step 1."""
    from scripts.local_profile import newest_run, prepare, task_states, xcom

    home, airflow_home = tmp_path / "pipeline", tmp_path / "airflow"
    store = home / "store"
    pods = tmp_path / "pods"
    pods.mkdir()
    hold, reward = tmp_path / "hold", tmp_path / "holding_reward.py"
    hold.touch()
    reward.write_text(HOLDING_REWARD.format(hold=str(hold)))
    venv_bin = str(Path(sys.executable).parent)
    runner = PodRunner(
        pods,
        # the working directory: `python -m tests.helpers.cpu_main_ppo` imports the swapped trainer from the checkout
        ROOT,
        MOUNT,
        store,
        swaps=[
            # no GPU: the CPU trainer, same overrides
            ("pipeline_steps.training.verl_main", "tests.helpers.cpu_main_ppo"),
            ("--generator vllm", "--generator hf"),  # no vLLM here
        ],
        base_env={
            "PATH": f"{venv_bin}:/usr/bin:/bin",
            "HOME": str(pods),
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
        },
        kill_first=("tests.helpers.cpu_main_ppo", _step_logged(hold)),
    )
    api = StandIn(crd_file=ROOT / "k8s/crds/ray.io_rayjobs.v1.7.0.yaml", executor=runner)
    api.start()
    from pipeline_steps.local import mlflow_server

    mlflow_uri = mlflow_server.ensure_server(tmp_path / "team-mlflow")  # the team's server: connection mlflow_default
    # it wants a login (issue 46): the connection holds it, the pods get it from the Secret by reference
    creds = mlflow_server.client_env(tmp_path / "team-mlflow")
    user, password = creds["MLFLOW_TRACKING_USERNAME"], creds["MLFLOW_TRACKING_PASSWORD"]
    runner.secrets.update({(MLFLOW_SECRET, "username"): user, (MLFLOW_SECRET, "password"): password})
    try:
        kube_config = api.kube_config(tmp_path / "kubeconfig", namespace=NS)
        _preset(tmp_path / "presets", reward)
        env = prepare(home, airflow_home)
        env.update(
            {
                "AIRFLOW_CONN_KUBERNETES_DEFAULT": json.dumps(
                    {
                        "conn_type": "kubernetes",
                        "extra": {"kube_config_path": str(kube_config), "namespace": "training"},
                    }
                ),
                "PIPELINE_MOUNTS": json.dumps([{"uri": f"file://{store}", "claim": "verl-store", "path": MOUNT}]),
                "PIPELINE_PRESETS_DIR": str(tmp_path / "presets"),
                "PIPELINE_POLL_SECONDS": "1",
                "AIRFLOW_CONN_MLFLOW_DEFAULT": json.dumps(
                    {"conn_type": "http", "host": mlflow_uri, "login": user, "password": password}
                ),
            }
        )
        for name in ("MLFLOW_TRACKING_URI", *creds):
            env.pop(name, None)
        conf = {
            "experiment": "tiny_cluster",
            "backend": "kuberay",
            "datasets": ["gsm8k"],
            "smoke": True,
            "verl_overrides": ["trainer.total_training_steps=3"],
        }
        logical = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
        airflow = str(Path(sys.executable).with_name("airflow"))
        with open(tmp_path / "dag.log", "w") as f:
            subprocess.run(
                [airflow, "dags", "test", "verl_grpo_pipeline", logical, "--conf", json.dumps(conf)],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=1200,
            )
        db = airflow_home / "airflow.db"
        run_id = newest_run(db)
        states = task_states(db, run_id)
        log = (tmp_path / "dag.log").read_text()
        pod_logs = {p.name: p.read_text()[-1500:] for p in pods.glob("*.log")}
        assert all(s == "success" for t, s in states.items() if t != "export[-1]"), (states, log[-4000:], pod_logs)
        assert states["export[-1]"] in ("success", "skipped"), states

        kinds = [b["metadata"]["labels"].get("verl-grpo-pipeline/kind") or b["metadata"]["name"] for b in api.creates]
        assert len(api.creates) == 4, kinds  # train (killed), train again, evaluate, export
        killed, train, evaluate, export = runner.started
        assert runner.killed == [killed["name"]] and train["name"] != killed["name"]
        # the trainer got the rendered overrides through the real shell, with paths on the mount
        assert "trainer.resume_mode=" in train["command"] and f"{store}/runs/tiny_cluster/" in train["command"]
        assert train["env"]["VERL_FILE_LOGGER_PATH"].startswith(f"{store}/runs/tiny_cluster/")
        assert train["env"]["PIPELINE_SIMULATED"] == "1" and "HF_TOKEN" not in train["env"]  # optional, absent
        assert "pipeline_steps.cluster_entry" in evaluate["command"] and "--generator hf" in evaluate["command"]
        assert "pipeline_steps.cluster_entry" in export["command"] and " export " in export["command"]

        trained = xcom(db, run_id, "train")[0]
        assert trained["backend"] == "kuberay" and trained["checkpoint_step"] == 3, trained
        from pipeline_steps import metrics_log

        history = metrics_log.read(trained["metrics_uri"].removeprefix("file://"))
        trained_steps = [r["step"] for r in history.rows if "training/global_step" in r["data"]]
        assert trained_steps == [1, 2, 3], [r["step"] for r in history.rows]  # step 1's line survived the kill
        resumed = (pods / f"{train['name']}.log").read_text()
        assert "resumed from" in resumed and "(step 1)" in resumed, resumed[-2000:]
        ckpt = Path(trained["checkpoint_uri"].removeprefix("file://"))
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
        evaluated = xcom(db, run_id, "evaluate")[0]["evaluate"]
        assert evaluated["results"].startswith(f"file://{store}/runs/") or evaluated["results"].startswith(str(store))
        # the rendered trainer.rollout_data_dir puts each step's samples beside metrics.jsonl; the report shows them
        bare = train["command"].replace("'", "").replace('"', "")
        assert f"trainer.rollout_data_dir={store}/runs/tiny_cluster/" in bare, train["command"]
        dumps = sorted(p.name for p in (ckpt.parent / "rollouts").glob("*.jsonl"))
        assert dumps == ["1.jsonl", "2.jsonl", "3.jsonl"], dumps
        report = xcom(db, run_id, "report")[0]["report"]
        md = Path(report["report"].removeprefix("file://"))
        assert md.is_file() and "## Trajectories" in md.read_text()
        assert (store / "models" / "exported" / "tiny_cluster").is_dir()  # export ran in its pod and uploaded
        assert not list((store / "tmp" / "step-summaries").glob("*.json.tmp*"))

        # MLflow: the pods got the connection's server (a plain value) and its login (from the Secret, never a value
        # in a manifest); the run recorded beside the checkpoints (both attempts in one run) is in the train XCom, got
        # the evaluation and the model card from the export pod, and the report and the card name it
        from mlflow.tracking import MlflowClient

        assert train["env"]["MLFLOW_TRACKING_URI"] == mlflow_uri and export["env"]["MLFLOW_TRACKING_URI"] == mlflow_uri
        for pod in (train, export):
            assert (pod["env"]["MLFLOW_TRACKING_USERNAME"], pod["env"]["MLFLOW_TRACKING_PASSWORD"]) == (user, password)
        assert password not in json.dumps(api.creates)
        for k, v in creds.items():  # this process's client reads the run back
            monkeypatch.setenv(k, v)
        run = trained["mlflow"]
        assert run and run["tracking_uri"] == mlflow_uri, trained
        assert json.loads((ckpt / "mlflow_run.json").read_text()) == run
        client = MlflowClient(tracking_uri=mlflow_uri)
        assert [r.info.run_id for r in client.search_runs([run["experiment_id"]])] == [run["run_id"]]
        history = client.get_metric_history(run["run_id"], "critic/score/mean")
        assert sorted({m.step for m in history}) == [1, 2, 3]
        logged = client.get_run(run["run_id"]).data.metrics
        assert "eval/avg_at_k" in logged and "eval_base/avg_at_k" in logged and "export/promoted" in logged, logged
        assert {a.path for a in client.list_artifacts(run["run_id"])} >= {"README.md", "export.json"}
        card = client.download_artifacts(run["run_id"], "README.md", str(tmp_path / "card"))
        assert run["run_id"] in Path(card).read_text()
        assert f"| MLflow run | `{run['run_id']}` (<{run['url']}>) |" in md.read_text()
    finally:
        api.stop()
        mlflow_server.shutdown_server(tmp_path / "team-mlflow")
        from scripts.local_profile import stop_services

        stop_services(home)
