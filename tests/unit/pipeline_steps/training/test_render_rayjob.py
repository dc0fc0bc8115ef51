"""RayJob rendering: every render validates against the KubeRay v1.7.0 CRD schema (../shared/kuberay, real
jsonschema), keeps k8s/templates/rayjob.yaml's structure, and quotes every entrypoint argument so that a real
/bin/sh (what Ray's job supervisor runs the entrypoint with) hands verl exactly the argv we meant.
No Kubernetes API server runs here: the CRD's openAPIV3Schema is the stand-in for its validation.
Set REGEN_EXAMPLES=1 to rewrite k8s/examples/ after an intended change."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from pipeline_steps.errors import UserError
from pipeline_steps.training import cluster_section, experiment, sandbox_services
from pipeline_steps.training import rayjob_manifest as render_rayjob
from pipeline_steps.training.mounts import MountMap
from pipeline_steps.training.rayjob_manifest import build_rayjob, label_value, rayjob_name
from tests.helpers.k8s_api_stand_in import kuberay_validation_error
from tests.helpers.render import ACK, EXAMPLES, GKE, RUN, derived, render

ROOT = Path(__file__).resolve().parents[4]
CRD = ROOT / "k8s" / "crds" / "ray.io_rayjobs.v1.7.0.yaml"
NASTY = [
    "it's",
    'say "hi"',
    "a; rm -rf / ; b",
    "$(touch /tmp/pwned)",
    "`id`",
    # "${" is refused before rendering (tests/unit/pipeline_steps/training/test_hostile_overrides.py)
    "$HOME $(HOME) {HOME}",
    "line1\nline2",
    "back\\slash\\",
    "tab\there & | > < * ?",
    "",
]


# What a deployment sets (Helm values): the image it built, by digest. Presets name no image.
TRAIN_IMAGE = "registry.example.com/verl-grpo-train@sha256:" + "0" * 64


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in (
        cluster_section.SERVICE_ACCOUNT_ENV,
        "PIPELINE_MOUNTS",
        sandbox_services.SANDBOX_DOMAIN_ENV,
        sandbox_services.SANDBOX_SERVICES_ENV,
        "PIPELINE_RAY_AUTH_SECRET",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(cluster_section.IMAGE_ENV, TRAIN_IMAGE)


@pytest.fixture(scope="module")
def crd_schema():
    if not CRD.is_file():
        pytest.skip(f"{CRD} is absent (reference material beside the repository); cannot validate against the CRD")
    doc = yaml.safe_load(CRD.read_text())
    version = next(v for v in doc["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def validate(job, schema):
    jsonschema.Draft7Validator(schema).validate(job)  # raises with the failing path


def shape(obj):
    """Key structure: dicts by key, lists by their first element."""
    if isinstance(obj, dict):
        return {k: shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [shape(obj[0])] if obj else []
    return type(obj).__name__ if not isinstance(obj, (int, float)) or isinstance(obj, bool) else "number"


@pytest.mark.parametrize("preset,mounts,bucket,dataset", EXAMPLES)
def test_every_preset_renders_a_valid_rayjob(preset, mounts, bucket, dataset, crd_schema):
    exp, job = render(preset, mounts, bucket, dataset)
    validate(job, crd_schema)
    assert kuberay_validation_error(job) is None  # and KubeRay's controller accepts it (validation.go)
    group = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    cluster = exp.spec["cluster"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == cluster["nnodes"]
    worker = group["template"]["spec"]
    assert worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == cluster["gpus_per_node"]
    assert worker["tolerations"] == cluster["tolerations"]
    assert worker["nodeSelector"] == cluster["node_selector"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["containers"][0]["volumeMounts"]
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in json.dumps(head)
    assert job["spec"]["activeDeadlineSeconds"] == cluster["active_deadline_seconds"]
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    assert job["spec"]["ttlSecondsAfterFinished"] == cluster["ttl_seconds_after_finished"]
    assert "deletionStrategy" not in job["spec"]  # cannot be combined with shutdownAfterJobFinishes


@pytest.mark.parametrize("preset,mounts,bucket,dataset", EXAMPLES)
def test_committed_examples_equal_fresh_renders(preset, mounts, bucket, dataset):
    path = ROOT / "k8s" / "examples" / f"rayjob-{preset}.yaml"
    _, job = render(preset, mounts, bucket, dataset)
    text = render_rayjob.to_yaml(job)
    if os.environ.get("REGEN_EXAMPLES"):
        path.write_text(text)
    assert path.read_text() == text, f"{path} drifted from the renderer; run REGEN_EXAMPLES=1 pytest {__file__}"


def test_render_keeps_the_template_structure():
    template = render_rayjob.load_template()
    _, job = render(mounts=GKE, bucket="gs://verl-store")
    for group in (job["spec"]["rayClusterSpec"]["headGroupSpec"], *job["spec"]["rayClusterSpec"]["workerGroupSpecs"]):
        group["template"]["spec"]["containers"][0].pop("securityContext", None)  # a preset option, not the template's
    want, got = shape(template), shape(job)
    # filled lists that are empty in the template gain their element structure; everything else is equal
    for path in (
        ("spec", "rayClusterSpec", "headGroupSpec", "template", "spec", "containers", 0, "env"),
        ("spec", "rayClusterSpec", "headGroupSpec", "template", "spec", "containers", 0, "volumeMounts"),
        ("spec", "rayClusterSpec", "headGroupSpec", "template", "spec", "volumes"),
        ("spec", "rayClusterSpec", "workerGroupSpecs", 0, "template", "spec", "containers", 0, "env"),
        ("spec", "rayClusterSpec", "workerGroupSpecs", 0, "template", "spec", "tolerations"),
        ("spec", "rayClusterSpec", "headGroupSpec", "template", "metadata", "annotations"),
        ("spec", "rayClusterSpec", "workerGroupSpecs", 0, "template", "metadata", "annotations"),
        ("spec", "rayClusterSpec", "workerGroupSpecs", 0, "template", "spec", "nodeSelector"),
        ("metadata", "annotations"),
    ):
        a, b = want, got
        for p in path[:-1]:
            a, b = a[p], b[p]
        a[path[-1]] = b[path[-1]] = None
    assert got == want
    # and the fixed parts of the template come through unchanged
    assert job["spec"]["submissionMode"] == template["spec"]["submissionMode"] == "HTTPMode"
    assert job["spec"]["backoffLimit"] == template["spec"]["backoffLimit"]
    tmpl_ports = template["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    assert job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"] == tmpl_ports


def _fake_python(tmp_path: Path) -> dict:
    """A `python3` on PATH that prints its argv as JSON: stands in for the interpreter, not for the shell."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")


@pytest.mark.parametrize("preset,mounts,bucket,dataset", EXAMPLES)
def test_every_rayjob_requires_ray_token_auth(preset, mounts, bucket, dataset, crd_schema, monkeypatch):
    _, job = render(preset, mounts, bucket, dataset)
    assert job["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token"}  # KubeRay generates the token Secret
    monkeypatch.setenv("PIPELINE_RAY_AUTH_SECRET", "ray-token")
    _, job = render(preset, mounts, bucket, dataset)
    validate(job, crd_schema)
    assert job["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token", "secretName": "ray-token"}
    # the CRD checks these fields (a misspelt mode would be refused by the API server)
    job["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "tokens"
    with pytest.raises(jsonschema.ValidationError):
        validate(job, crd_schema)
    monkeypatch.setenv("PIPELINE_RAY_AUTH_SECRET", "Not A Name")
    with pytest.raises(UserError, match="PIPELINE_RAY_AUTH_SECRET"):
        render(preset, mounts, bucket, dataset)


def test_untrusted_values_cannot_leave_their_argument(tmp_path, crd_schema):
    overrides = [f"trainer.experiment_name={NASTY[0]}"] + [f"+extra.k{i}={v}" for i, v in enumerate(NASTY)]
    exp, job = render(overrides=overrides)
    validate(job, crd_schema)
    entry = job["spec"]["entrypoint"]
    argv = shlex.split(entry)
    assert argv[:3] == ["python3", "-m", "pipeline_steps.training.verl_main"]
    # the real shell Ray's job supervisor uses (subprocess(..., shell=True) -> /bin/sh -c) gives the same argv
    env = _fake_python(tmp_path)
    out = subprocess.run(["/bin/sh", "-c", entry], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == argv[1:]
    assert not Path("/tmp/pwned").exists()
    # ... and every value arrives as one Hydra override that Hydra's own parser reads back as the user's string
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for i, v in enumerate(NASTY):
        [arg] = [a for a in argv if a.startswith(f"+extra.k{i}=")]
        assert parser.parse_override(arg).value() == v, arg
    [name] = [a for a in argv if a.startswith("trainer.experiment_name=")]
    assert parser.parse_override(name).value() == NASTY[0]


def test_store_uris_map_to_the_mount_and_resume_is_forced():
    exp, job = render(
        pipeline={"trainer.resume_mode": "disable", "trainer.default_local_dir": "oss://verl-store/elsewhere/ckpt"}
    )
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python3", "-m", "pipeline_steps.training.verl_main"]
    kv = dict(a.split("=", 1) for a in argv[3:])
    assert kv["trainer.resume_mode"] == '"auto"'  # a retry always resumes from the last checkpoint
    assert kv["trainer.default_local_dir"] == '"/mnt/store/elsewhere/ckpt"'
    assert argv[-3:] == [
        'trainer.default_local_dir="/mnt/store/elsewhere/ckpt"',
        'trainer.resume_mode="auto"',
        'trainer.rollout_data_dir="/mnt/store/elsewhere/rollouts"',  # beside metrics.jsonl: the report reads it
    ]
    assert kv["data.train_files"] == '["/mnt/store/datasets/gsm8k/rev1/0123abcd/train.parquet"]'
    assert kv["actor_rollout_ref.model.path"] == '"/mnt/store/models/Qwen/Qwen2.5-3B-Instruct/main"'
    env_vars = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert env_vars["VERL_FILE_LOGGER_PATH"] == "/mnt/store/elsewhere/metrics.jsonl"
    pod = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert {"name": "verl-store", "persistentVolumeClaim": {"claimName": "verl-store", "readOnly": False}} in pod[
        "volumes"
    ]
    assert {"name": "verl-store", "mountPath": "/mnt/store", "readOnly": False} in pod["containers"][0]["volumeMounts"]
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert head["volumes"] == [v for v in pod["volumes"] if v["name"] != "dshm"]


def test_a_presets_own_rollout_data_dir_wins():
    _, job = render(overrides=["trainer.rollout_data_dir=oss://verl-store/mine/rollouts"])
    argv = shlex.split(job["spec"]["entrypoint"])
    assert [a for a in argv if a.startswith("trainer.rollout_data_dir=")] == [
        'trainer.rollout_data_dir="/mnt/store/mine/rollouts"'
    ]


def test_gcs_fuse_mount_annotates_the_pods():
    _, job = render(mounts=GKE, bucket="gs://verl-store")
    for tpl in (
        job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"],
        job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"],
    ):
        assert tpl["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}
        assert tpl["spec"]["serviceAccountName"] == "verl-ray"


def test_name_job_id_and_labels_are_deterministic_and_valid(crd_schema):
    _, a = render()
    _, b = render()
    assert a == b
    name = a["metadata"]["name"]
    assert a["spec"]["jobId"] == name == rayjob_name("verl_grpo_pipeline", RUN, "train", "train")
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 47
    labels = a["metadata"]["labels"]
    assert labels["dag_id"] == "verl_grpo_pipeline" and labels["task_id"] == "train"
    assert labels["run_id"] == label_value(RUN) != RUN  # ':' and '+' are not allowed in label values
    assert a["metadata"]["annotations"]["verl-grpo-pipeline/run-id"] == RUN
    assert "kueue.x-k8s.io/queue-name" not in labels
    _, other_run = render(run_id=RUN + "x")
    _, other_task = render(task_id="train_2")
    _, evaluate = render(job_kind="evaluate", entrypoint=["python3", "-m", "pipeline_steps", "evaluate"])
    names = {name, other_run["metadata"]["name"], other_task["metadata"]["name"], evaluate["metadata"]["name"]}
    assert len(names) == 4


@pytest.mark.parametrize(
    "ids",
    [
        ("d" * 250, "r" * 250, "t" * 250, "train"),
        ("__", "::", "..", "9-evaluate"),
        ("DAG With Spaces", "scheduled__2026-01-01T00:00:00+00:00", "group.task", "EVAL"),
    ],
)
def test_names_and_labels_for_awkward_ids(ids):
    name = rayjob_name(*ids)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 47
    for value in ids:
        lv = label_value(value)
        assert len(lv) <= 63 and re.fullmatch(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?", lv)
        assert lv, value


def test_kueue_queue_label_and_evaluate_entrypoint(crd_schema):
    exp = experiment.load("gspo", derived=derived("gs://verl-store", "gspo", "gsm8k"))
    exp.spec["cluster"]["kueue_queue"] = "verl-gpu"
    argv = ["python3", "-m", "pipeline_steps", "evaluate", "--model", "/mnt/store/x y", "--note", "$(id);`id`"]
    job = build_rayjob(
        exp, dag_id="d", run_id="r", task_id="evaluate", mounts=GKE, entrypoint=argv, job_kind="evaluate"
    )
    validate(job, crd_schema)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "verl-gpu"
    assert job["metadata"]["labels"]["app.kubernetes.io/component"] == "evaluate"
    assert shlex.split(job["spec"]["entrypoint"]) == argv
    assert "VERL_FILE_LOGGER_PATH" not in job["spec"]["runtimeEnvYAML"]


def test_secrets_only_by_reference():
    exp = experiment.load("gsm8k_qwen2_5_3b", derived=derived("oss://verl-store", "gsm8k_qwen2_5_3b", "gsm8k"))
    exp.spec["cluster"]["env"] = {}
    exp.spec["cluster"]["secrets"] = [
        {"env": "HF_TOKEN", "secret": "hf-token", "key": "token", "optional": True},
        {"env": "OSS_ACCESS_KEY_SECRET", "secret": "oss-credentials", "key": "akSecret"},
    ]
    job = build_rayjob(exp, dag_id="d", run_id="r", task_id="t", mounts=ACK)
    for group in (job["spec"]["rayClusterSpec"]["headGroupSpec"], job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]):
        env = group["template"]["spec"]["containers"][0]["env"]
        assert [e["name"] for e in env] == ["HF_TOKEN", "OSS_ACCESS_KEY_SECRET"]
        assert all(set(e) == {"name", "valueFrom"} and "secretKeyRef" in e["valueFrom"] for e in env)
    exp.spec["cluster"]["secrets"] = [{"env": "HF_TOKEN", "value": "hf_abc"}]
    with pytest.raises(UserError, match=r"cluster.secrets\[0\]"):
        build_rayjob(exp, dag_id="d", run_id="r", task_id="t", mounts=ACK)
    exp.spec["cluster"]["secrets"] = []
    exp.spec["cluster"]["env"] = {"WANDB_API_KEY": "abc"}
    with pytest.raises(UserError, match="cluster.env.WANDB_API_KEY: looks like a secret"):
        build_rayjob(exp, dag_id="d", run_id="r", task_id="t", mounts=ACK)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"mounts": MountMap()}, r"outside every mounted bucket"),
        ({"bucket": "gs://other-bucket"}, r"gs://other-bucket.*outside every mounted bucket"),
        ({"pipeline": {"trainer.default_local_dir": "/local/ckpt"}}, r"trainer.default_local_dir='/local/ckpt'"),
        ({"overrides": ["trainer.nnodes=two"]}, r"trainer.nnodes='two': must be an integer"),
        ({"pipeline": {"data.val_files": ["oss://verl-store/../../etc/passwd"]}}, r"climbs out of its mount"),
        ({"namespace": "Bad_NS"}, r"--namespace 'Bad_NS'"),
    ],
)
def test_bad_input_is_one_line_naming_it(change, match):
    with pytest.raises(UserError, match=match) as err:
        render(**change)
    assert "\n" not in str(err.value)


def test_cli_writes_the_rayjob_and_rejects_bad_input(tmp_path, crd_schema):
    out = tmp_path / "rayjob.yaml"
    env = dict(os.environ, PIPELINE_MOUNTS=(ROOT / "k8s/overlays/ack/mounts.json").read_text())
    base = [
        sys.executable,
        "-m",
        "pipeline_steps",
        "render-rayjob",
        "--experiment",
        "gsm8k_qwen2_5_3b",
        "--output",
        str(out),
        "--checkpoint-uri",
        "oss://verl-store/runs/x/checkpoints",
        "--namespace",
        "verl-pipeline",
    ]
    p = subprocess.run(
        base + ["--override", "trainer.experiment_name=a'b$(id)"], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    job = yaml.safe_load(out.read_text())
    validate(job, crd_schema)
    assert summary["name"] == job["metadata"]["name"] and summary["replicas"] == 1
    assert 'trainer.experiment_name="a\'b$(id)"' in shlex.split(job["spec"]["entrypoint"])
    out.unlink()
    p = subprocess.run(
        base + ["--override", "data.train_files=gs://not-mounted/x.parquet"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "data.train_files" in p.stderr and "gs://not-mounted" in p.stderr
    assert not out.exists()  # no partial output that looks complete
    p = subprocess.run(
        base + ["--mounts", "@/nonexistent/mounts.json"], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 2 and "--mounts '@/nonexistent/mounts.json': file not found" in p.stderr


# -- MountMap -------------------------------------------------------------------------------------------


def test_mountmap_longest_prefix_and_forms(monkeypatch):
    mm = MountMap.from_config(
        {
            "gs://bucket": {"claim": "store", "path": "/mnt/store"},
            "gs://bucket/models": {"claim": "models", "path": "/mnt/models", "readOnly": True},
        }
    )
    assert mm.to_pod_path("gs://bucket/datasets/x/train.parquet") == "/mnt/store/datasets/x/train.parquet"
    assert mm.to_pod_path("gs://bucket/models/qwen/main") == "/mnt/models/qwen/main"
    assert mm.to_pod_path("gs://bucket/modelsX/a") == "/mnt/store/modelsX/a"  # a prefix ends at a '/'
    assert mm.to_pod_path("gs://bucket") == "/mnt/store"
    assert mm.to_pod_path("/mnt/store/already/a/path") == "/mnt/store/already/a/path"
    volumes, mounts = mm.volumes()
    assert volumes == [
        {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
        {"name": "store", "persistentVolumeClaim": {"claimName": "store", "readOnly": False}},
    ]
    assert [m["mountPath"] for m in mounts] == ["/mnt/models", "/mnt/store"]
    monkeypatch.setenv(
        "PIPELINE_MOUNTS", json.dumps([{"uri": "oss://b", "claim": "c", "path": "/m", "subPath": "runs"}])
    )
    env = MountMap.from_env()
    assert env.to_pod_path("oss://b/x") == "/m/x"
    assert env.volumes()[1][0]["subPath"] == "runs"
    assert len(MountMap.from_config(None)) == 0


@pytest.mark.parametrize(
    "config,match",
    [
        ([{"uri": "bucket", "claim": "c", "path": "/m"}], r"must look like scheme://bucket"),
        ([{"uri": "gs://b", "claim": "Bad_Claim", "path": "/m"}], r"not a valid PersistentVolumeClaim name"),
        ([{"uri": "gs://b", "claim": "c", "path": "relative"}], r"normalised absolute directory"),
        ([{"uri": "gs://b", "claim": "c", "path": "/dev/shm"}], r"reserved"),
        ([{"uri": "gs://b", "claim": "c", "path": "/m", "token": "x"}], r"unknown keys \['token'\]"),
        (
            [{"uri": "gs://b", "claim": "c", "path": "/m"}, {"uri": "gs://b/", "claim": "d", "path": "/n"}],
            r"listed twice",
        ),
        ([{"uri": "gs://b", "claim": "c", "path": "/m"}, {"uri": "gs://a", "claim": "d", "path": "/m"}], r"same path"),
        ("gs://b", r"expected a list"),
    ],
)
def test_mountmap_rejects_bad_config(config, match):
    with pytest.raises(UserError, match=match):
        MountMap.from_config(config)


def test_mountmap_bad_env_and_uris(monkeypatch):
    monkeypatch.setenv("PIPELINE_MOUNTS", "{not json")
    with pytest.raises(UserError, match=r"\$PIPELINE_MOUNTS: not valid JSON"):
        MountMap.from_env()
    mm = MountMap.from_config([{"uri": "gs://b/p", "claim": "c", "path": "/m"}])
    for bad, match in [
        ("gs://b/other/x", "outside every mounted bucket"),
        ("gs://b/p/../../etc", "climbs out"),
        ("/etc/passwd", "not a store URI on a mount"),
        ("gs://b/pp", "outside every mounted bucket"),
    ]:
        with pytest.raises(UserError, match=match):
            mm.to_pod_path(bad)


LINGJUN = "node-role.alibabacloud.com/lingjun"


def test_what_the_guides_clusters_need_can_be_expressed(tmp_path, crd_schema):
    """Issue 13 item 6: a private registry (imagePullSecrets), extra tolerations (ACK's lingjun nodes), GKE's RDMA
    network annotations on the GPU pods, and NCCL/gIB settings with LD_LIBRARY_PATH in the containers (not only in
    the Ray job's runtime env: Ray's own processes start before a job's env applies)."""
    spec = yaml.safe_load(experiment.resolve_path("gsm8k_qwen2_5_3b").read_text())
    spec["cluster"].update(
        image_pull_secrets=["acr-login"],
        tolerations=[
            *spec["cluster"]["tolerations"],
            {"key": "node-role.alibabacloud.com/lingjun", "operator": "Exists"},
        ],
        worker_annotations={"networking.gke.io/default-interface": "eth0", "networking.gke.io/interfaces": "[]"},
        env={"NCCL_NET": "gIB", "LD_LIBRARY_PATH": "/usr/local/gib/lib64:/usr/local/nvidia/lib64"},
        worker_host_paths={"/usr/local/gib": "/home/kubernetes/bin/gib"},
        security_context={"runAsUser": 0},
    )
    preset = tmp_path / "custom.yaml"
    preset.write_text(yaml.safe_dump(spec))
    _, job = render(str(preset), GKE, "gs://verl-store")  # GKE's node settings render only with GKE's mounts (issue 45)
    validate(job, crd_schema)
    assert kuberay_validation_error(job) is None
    with pytest.raises(UserError, match=r"^cluster.worker_annotations networking.gke.io/\S+ \(and 2 more\) is for GKE"):
        render(str(preset))  # ACK's mounts: refused in one line
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    worker = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]
    for pod in (head, worker):
        assert pod["spec"]["imagePullSecrets"] == [{"name": "acr-login"}]
        assert pod["spec"]["containers"][0]["securityContext"] == {"runAsUser": 0}
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["NCCL_NET"] == "gIB" and env["LD_LIBRARY_PATH"].startswith("/usr/local/gib/lib64")
    assert worker["metadata"]["annotations"]["networking.gke.io/default-interface"] == "eth0"
    [host] = [v for v in worker["spec"]["volumes"] if "hostPath" in v]
    assert host["hostPath"]["path"] == "/home/kubernetes/bin/gib"
    mount = next(m for m in worker["spec"]["containers"][0]["volumeMounts"] if m["name"] == host["name"])
    assert mount == {"name": host["name"], "mountPath": "/usr/local/gib", "readOnly": True}
    assert not [v for v in head["spec"]["volumes"] if "hostPath" in v]
    assert "networking.gke.io/default-interface" not in (head["metadata"].get("annotations") or {})
    assert {"key": LINGJUN, "operator": "Exists"} in worker["spec"]["tolerations"]
    for bad, match in (
        ({"image_pull_secrets": "acr-login"}, "image_pull_secrets"),
        ({"worker_annotations": ["x"]}, "worker_annotations"),
        ({"worker_host_paths": {"/usr/local/gib": "../etc"}}, "worker_host_paths"),
    ):
        spec2 = {**spec, "cluster": {**spec["cluster"], **bad}}
        preset.write_text(yaml.safe_dump(spec2))
        with pytest.raises(UserError, match=match):
            render(str(preset))


@pytest.mark.parametrize("preset", ["gsm8k_qwen2_5_3b", "dapo_qwen3_4b"])
def test_export_jobs_on_ack_can_open_the_oss_store(preset):
    """Issue 13 item 3: export runs as a CPU RayJob and opens ``--store-root oss://...`` with the OSS SDK (its upload
    and the promotion records need conditional writes the ossfs mount cannot give), so its pod needs the AccessKey
    pair (by reference to the ossfs driver's Secret, never a value) and the region/endpoint the PV uses."""
    from operators.cluster_step import cpu_only
    from pipeline_steps.store.oss import OssStore  # noqa: F401  (the SDK these variables configure)

    exp = experiment.load(preset)
    job = cpu_only(
        build_rayjob(
            exp,
            namespace="verl-pipeline",
            mounts=ACK,
            entrypoint=["python3", "-m", "pipeline_steps", "export"],
            job_kind="export",
            dag_id="d",
            run_id=RUN,
            task_id="export",
        ),
        exp.spec["cluster"]["export"],
    )
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in head["env"]}
    for name, key in (("OSS_ACCESS_KEY_ID", "akId"), ("OSS_ACCESS_KEY_SECRET", "akSecret")):
        assert env[name] == {"name": name, "valueFrom": {"secretKeyRef": {"name": "oss-credentials", "key": key}}}
    pv = (ROOT / "k8s/overlays/ack/pv-pvc-oss.yaml").read_text()
    assert env["OSS_ENDPOINT"]["value"] in pv and env["OSS_REGION"]["value"] in env["OSS_ENDPOINT"]["value"]


@pytest.mark.parametrize(
    "image,message",
    [
        (None, "no training image: set $PIPELINE_TRAIN_IMAGE"),
        ("registry.example.com/verl-grpo-train", "a moving tag"),
        ("registry.example.com:5000/verl-grpo-train:latest", "a moving tag"),
        ("REGISTRY/verl-grpo-train@sha256:DIGEST", "sha256:<64 hex digits>"),  # the Helm values left unedited
    ],
)
def test_a_missing_or_moving_training_image_is_refused_in_one_line(monkeypatch, image, message):
    """Issue 13 item 7: presets name no image (the deployment builds and pushes its own); an unpinned one is refused."""
    if image is None:
        monkeypatch.delenv(cluster_section.IMAGE_ENV)
    else:
        monkeypatch.setenv(cluster_section.IMAGE_ENV, image)
    with pytest.raises(UserError) as e:
        render()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_exact_tag_on_a_registry_with_a_port_is_taken(monkeypatch):
    monkeypatch.setenv(cluster_section.IMAGE_ENV, "registry.example.com:5000/verl-grpo-train:0.1.0")
    _, job = render()
    pods = [job["spec"]["rayClusterSpec"]["headGroupSpec"]] + job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert {c["image"] for p in pods for c in p["template"]["spec"]["containers"]} == {
        "registry.example.com:5000/verl-grpo-train:0.1.0"
    }


def test_the_code_sandbox_service_is_the_deployments(monkeypatch):
    """A preset names its sandbox service (``cluster.sandbox_service``) and the deployment maps the name to an
    endpoint and a Secret ($PIPELINE_SANDBOX_SERVICES, Helm values); a preset naming none gets the deployment's
    default ($PIPELINE_E2B_DOMAIN). An unknown name, a run with no service, and a preset carrying its own endpoint
    or key are refused in one line at render."""
    ack, ags = "gsm8k_tool_agent_qwen2_5_3b", "dapo_retool_qwen3_4b"

    def build(preset, dataset="gsm8k", **cluster):
        exp = experiment.load(preset, derived=derived("oss://verl-store", preset, dataset))
        exp.spec["cluster"].update(cluster)
        return build_rayjob(exp, dag_id="verl_grpo_pipeline", run_id=RUN, task_id="train", mounts=ACK)

    with pytest.raises(UserError, match=r"needs its sandbox service: set \$PIPELINE_E2B_DOMAIN"):
        build(ack)
    monkeypatch.setenv(sandbox_services.SANDBOX_DOMAIN_ENV, "Not a domain!")
    with pytest.raises(UserError, match="not a domain name"):
        build(ack)
    monkeypatch.setenv(sandbox_services.SANDBOX_DOMAIN_ENV, "sandbox.team.internal")
    with pytest.raises(UserError) as refused:  # the AGS preset's service is not in this deployment
        build(ags, "dapo_math")
    assert str(refused.value) == (
        "cluster.sandbox_service='ags-shanghai': not a sandbox service of this deployment (known: none); add it to "
        "$PIPELINE_SANDBOX_SERVICES in the Helm values or name one of those"
    )
    services = {
        "ags-shanghai": {"domain": "ap-shanghai.tencentags.com", "secret": "ags-api-key"},
        "ags-singapore": {"domain": "ap-singapore.tencentags.com", "secret": "ags-sg-key", "key": "token"},
    }
    monkeypatch.setenv(sandbox_services.SANDBOX_SERVICES_ENV, json.dumps(services))
    cases = (
        (build(ack), "sandbox.team.internal", {"name": "sandbox-api-key", "key": "apiKey"}),
        (build(ags, "dapo_math"), "ap-shanghai.tencentags.com", {"name": "ags-api-key", "key": "apiKey"}),
        (
            build(ags, "dapo_math", sandbox_service="ags-singapore"),
            "ap-singapore.tencentags.com",
            {"name": "ags-sg-key", "key": "token"},
        ),
    )
    for job, domain, ref in cases:
        for pod in [job["spec"]["rayClusterSpec"]["headGroupSpec"], *job["spec"]["rayClusterSpec"]["workerGroupSpecs"]]:
            env = pod["template"]["spec"]["containers"][0]["env"]
            assert {"name": "E2B_DOMAIN", "value": domain} in env
            assert [e["valueFrom"]["secretKeyRef"] for e in env if e["name"] == "E2B_API_KEY"] == [ref]
        assert f"E2B_DOMAIN: {domain}" in job["spec"]["runtimeEnvYAML"]
    with pytest.raises(UserError, match="not a sandbox service of this deployment .known: ags-shanghai, ags-singapore"):
        build(ags, "dapo_math", sandbox_service="ags-beijing")
    with pytest.raises(UserError, match="E2B_DOMAIN / E2B_API_URL are the deployment's"):
        build(ack, env={"E2B_DOMAIN": "elsewhere.example.com"})
    with pytest.raises(UserError, match="E2B_API_KEY comes with the sandbox service"):
        build(ack, secrets=[{"env": "E2B_API_KEY", "secret": "mine", "key": "k"}])
    with pytest.raises(UserError, match="runs no code sandbox tool"):
        build("gsm8k_qwen2_5_3b", sandbox_service="ags-shanghai")
    for bad, why in (("[]", "expected a JSON object"), ('{"x": {"domain": "a.b"}}', "expected {domain, secret")):
        monkeypatch.setenv(sandbox_services.SANDBOX_SERVICES_ENV, bad)
        with pytest.raises(UserError, match=re.escape(why)):
            build(ags, "dapo_math")
    _, plain = render("gsm8k_qwen2_5_3b")  # no tool agent: no sandbox settings at all
    assert "E2B" not in json.dumps(plain)


def test_the_cluster_job_carries_a_presets_agent_loop_file_resolved_in_the_pod(tmp_path):
    """A preset's own agent loop (``agent_loop_config_path``): the RayJob's entrypoint carries ``pkg:`` as the preset
    wrote it, ``verl_main`` (what the pod runs first) turns it into the installed file, and what verl composes and
    registers from it is the shipped loop. A deployment's own path is carried unchanged: it must be in the image."""
    from importlib.resources import files

    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase
    from verl.utils.import_utils import resolve_config_path

    from pipeline_steps.training import verl_main

    key = "actor_rollout_ref.rollout.agent.agent_loop_config_path"
    shipped = "pkg:pipeline_steps.rollouts/mcp_math_loop.yaml"
    _, job = render(
        "gsm8k_tool_agent_qwen2_5_3b",
        overrides=[f"{key}={shipped}", "actor_rollout_ref.rollout.agent.default_agent_loop=mcp_math_agent"],
    )
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python3", "-m", "pipeline_steps.training.verl_main"]
    assert f'{key}="{shipped}"' in argv  # resolved where the package is installed: in the pod
    pod_argv = verl_main.resolve_tool_config(argv[3:])
    installed = str(files("pipeline_steps.rollouts") / "mcp_math_loop.yaml")
    assert f"{key}={json.dumps(installed)}" in pod_argv
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=pod_argv)
    GlobalHydra.instance().clear()
    path = cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path
    assert path == installed and cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "mcp_math_agent"
    # what verl's AgentLoopWorker does with the key
    [entry] = OmegaConf.load(resolve_config_path(path))
    assert entry.name == "mcp_math_agent"
    module, _, cls = entry._target_.rpartition(".")
    assert issubclass(getattr(__import__(module, fromlist=[cls]), cls), AgentLoopBase)

    own = tmp_path / "loops.yaml"  # a deployment's own file, named by its preset
    _, job = render("gsm8k_tool_agent_qwen2_5_3b", overrides=[f"{key}={own}"])
    argv = shlex.split(job["spec"]["entrypoint"])
    assert f"{key}={json.dumps(str(own))}" in verl_main.resolve_tool_config(argv[3:])
