"""Every manifest under k8s/ is checked: core kinds with kubernetes-validate (strict) at a pinned Kubernetes
version, RayJobs against the KubeRay v1.7.0 CRD schema (../shared/kuberay), each cloud overlay built with
`kubectl kustomize` (offline, no cluster) and its output validated, RBAC exactly as the operator needs,
and no literal secret anywhere. No API server runs here: the published schemas are the stand-in for its
admission checks; CSI drivers, Kueue's own CRD and the Helm chart's schema are checked on paper."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "k8s"
CRD = ROOT / "k8s" / "crds" / "ray.io_rayjobs.v1.7.0.yaml"
KUBE_VERSION = "1.33.0"  # pinned: a version both ACK and GKE offer
OVERLAYS = ["ack", "gke"]
KUSTOMIZE_FILES = {"kustomization.yaml"}
NOT_MANIFESTS = {
    *(K8S / "airflow").glob("values*.yaml"),  # Helm values (and each cloud's on top), not Kubernetes objects
    K8S / "overlays" / "ack" / "node-pools.yaml",  # node shapes the presets are sized for (test_presets_fit_cluster)
    K8S / "overlays" / "gke" / "node-pools.yaml",
}

# Shapes of real credentials (and of assignments that carry one); a hit anywhere under k8s/ fails.
SECRET_PATTERNS = [
    (r"AKIA[0-9A-Z]{16}", "AWS access key id"),
    (r"LTAI[0-9A-Za-z]{12,30}", "Alibaba Cloud AccessKey id"),
    (r"\bhf_[A-Za-z0-9]{30,}", "Hugging Face token"),
    (r"gh[pousr]_[A-Za-z0-9]{36,}", "GitHub token"),
    (r"AIza[0-9A-Za-z_-]{35}", "Google API key"),
    (r"-----BEGIN [A-Z ]*PRIVATE KEY-----", "private key"),
    (r"\"private_key\"\s*:", "service-account key file"),
    (
        r"(?i)(password|passwd|secret|token|akSecret|access_?key(_id)?|api_?key)\s*[:=]\s*[\"']?[A-Za-z0-9/+_=.-]{16,}",
        "credential assignment",
    ),
]


def manifest_files():
    return sorted(p for p in K8S.rglob("*.yaml") if p.name not in KUSTOMIZE_FILES and p not in NOT_MANIFESTS)


def docs_of(path: Path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def crd_schema():
    if not CRD.is_file():
        pytest.skip(f"{CRD} is absent (reference material beside the repository); cannot validate RayJobs")
    doc = yaml.safe_load(CRD.read_text())
    return next(v for v in doc["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]


def validate_doc(doc: dict, crd_schema, where: str):
    kind = doc.get("kind")
    if kind == "RayJob":
        jsonschema.Draft7Validator(crd_schema).validate(doc)
    elif kind == "LocalQueue":  # Kueue's CRD is not vendored here: the fields the guide relies on
        assert doc["apiVersion"] == "kueue.x-k8s.io/v1beta1" and doc["spec"]["clusterQueue"], where
    elif kind == "SandboxSet":  # OpenKruise agents' CRD is not vendored: its fields as seed 000 uses them, and the
        # pod template validated as a real PodTemplateSpec
        assert doc["apiVersion"] == "agents.kruise.io/v1alpha1" and isinstance(doc["spec"]["replicas"], int), where
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": doc["spec"]["template"],
        }
        kubernetes_validate.validate(template, KUBE_VERSION, strict=True)
    else:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.slow  # about 9 s of CPU: every manifest against its schema
def test_every_manifest_validates(crd_schema):
    files = manifest_files()
    kinds = set()
    for f in files:
        for doc in docs_of(f):
            validate_doc(doc, crd_schema, str(f))
            kinds.add(doc["kind"])
    assert {
        "Namespace",
        "Role",
        "RoleBinding",
        "PersistentVolume",
        "PersistentVolumeClaim",
        "ServiceAccount",
        "RayJob",
        "LocalQueue",
        "SandboxSet",
        "NetworkPolicy",
    } <= kinds


def test_a_broken_manifest_is_caught(crd_schema):
    pv = docs_of(K8S / "overlays/gke/pv-pvc-gcs.yaml")[0]
    pv["spec"]["accessModes"] = "ReadWriteMany"  # a string where a list belongs
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_doc(pv, crd_schema, "pv")
    job = docs_of(K8S / "examples/rayjob-gspo.yaml")[0]
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate_doc(job, crd_schema, "rayjob")


@pytest.fixture(scope="module")
def kubectl():
    exe = shutil.which("kubectl")
    if not exe:
        pytest.skip("kubectl is not installed; the overlays' kustomize build is unchecked")
    return exe


def build(kubectl, path: Path) -> list[dict]:
    p = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return [d for d in yaml.safe_load_all(p.stdout) if d]


@pytest.mark.parametrize("cloud", OVERLAYS)
def test_overlay_builds_validates_and_backs_its_mounts(cloud, kubectl, crd_schema):
    docs = build(kubectl, K8S / "overlays" / cloud)
    for doc in docs:
        validate_doc(doc, crd_schema, cloud)
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[(d["metadata"].get("namespace"), d["metadata"]["name"])] = d
    # the claims the renderer mounts (this overlay's mounts.json) exist, bound to a PV of the right CSI driver
    mounts = json.loads((K8S / "overlays" / cloud / "mounts.json").read_text())
    driver = {"ack": "ossplugin.csi.alibabacloud.com", "gke": "gcsfuse.csi.storage.gke.io"}[cloud]
    for m in mounts:
        pvc = by_kind["PersistentVolumeClaim"][("verl-pipeline", m["claim"])]
        pv = by_kind["PersistentVolume"][(None, pvc["spec"]["volumeName"])]
        assert pv["spec"]["csi"]["driver"] == driver
        assert "ReadWriteMany" in pv["spec"]["accessModes"] and pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    # the service account the presets run Ray pods as is created by the overlay
    assert ("verl-pipeline", "verl-ray") in by_kind["ServiceAccount"]
    if cloud == "ack":  # the ossfs credentials come from a Secret by name, created by hand
        ref = pv["spec"]["csi"]["nodePublishSecretRef"]
        assert ref == {"name": "oss-credentials", "namespace": "verl-pipeline"}
        assert "Secret" not in by_kind
        # seed 000's otherOpts, without its request-logging options (-o dbglevel=debug -o curldbg)
        opts = pv["spec"]["csi"]["volumeAttributes"]["otherOpts"]
        assert opts.split() == "-o umask=022 -o max_stat_cache_size=100000 -o allow_other".split()
    else:
        # seed 004's PersistentVolume, option for option
        assert pv["spec"]["mountOptions"] == GKE_GUIDE_MOUNT_OPTIONS
        assert pv["spec"]["csi"]["volumeAttributes"] == {
            "skipCSIBucketAccessCheck": "true",
            "gcsfuseMetadataPrefetchOnMount": "true",
        }
        assert mounts[0]["podAnnotations"] == {"gke-gcsfuse/volumes": "true"}


GKE_GUIDE_MOUNT_OPTIONS = [
    "implicit-dirs",
    "metadata-cache:negative-ttl-secs:0",
    "metadata-cache:ttl-secs:0",
    "metadata-cache:stat-cache-max-size-mb:-1",
    "metadata-cache:type-cache-max-size-mb:-1",
    "file-cache:max-size-mb:-1",
    "file-cache:cache-file-for-range-read:true",
    "file-cache:enable-parallel-downloads:true",
    "read_ahead_kb=1024",
    "write:enable-streaming-writes:true",
    "write:global-max-blocks:200000",
]


def test_kueue_component_adds_the_local_queue(kubectl, tmp_path, crd_schema):
    overlay = tmp_path / "with-kueue"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(K8S / "base", overlay)],
                "components": [os.path.relpath(K8S / "components" / "kueue", overlay)],
            }
        )
    )
    p = subprocess.run(
        [kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    docs = [d for d in yaml.safe_load_all(p.stdout) if d]
    queues = [d for d in docs if d["kind"] == "LocalQueue"]
    assert [q["metadata"]["name"] for q in queues] == ["verl-gpu"]
    for d in docs:
        validate_doc(d, crd_schema, "kueue")


def test_sandbox_component_on_the_ack_overlay(kubectl, tmp_path, crd_schema):
    """ACK with the optional sandbox component: the SandboxSet the code tool's template names, the Ray pods' egress to
    sandbox-manager, and sandboxes without egress."""
    overlay = tmp_path / "ack-with-sandbox"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(K8S / "overlays" / "ack", overlay)],
                "components": [os.path.relpath(K8S / "components" / "sandbox", overlay)],
            }
        )
    )
    p = subprocess.run(
        [kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    docs = [d for d in yaml.safe_load_all(p.stdout) if d]
    for d in docs:
        validate_doc(d, crd_schema, "ack+sandbox")
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    tool = yaml.safe_load((ROOT / "pipeline_steps/tools/code_sandbox.yaml").read_text())["tools"][0]["config"]
    sandbox_set = by_name[("SandboxSet", tool["e2b_template"])]  # sandbox-manager serves a SandboxSet as a template
    assert sandbox_set["metadata"]["annotations"]["e2b.agents.kruise.io/should-init-envd"] == "true"
    ray = by_name[("NetworkPolicy", "ray-egress-sandbox-manager")]
    assert ray["metadata"]["namespace"] == "verl-pipeline"
    assert ray["spec"]["podSelector"] == {"matchLabels": {"ray.io/is-ray-node": "yes"}}  # KubeRay's label on Ray pods
    to_manager = [
        r
        for r in ray["spec"]["egress"]
        if any(t.get("podSelector", {}).get("matchLabels") == {"component": "sandbox-manager"} for t in r["to"])
    ]
    assert to_manager and {"protocol": "TCP", "port": 7788} in to_manager[0]["ports"]
    closed = by_name[("NetworkPolicy", "sandboxes-no-egress")]
    assert closed["metadata"]["namespace"] == sandbox_set["metadata"]["namespace"]
    assert closed["spec"]["policyTypes"] == ["Egress"] and not closed["spec"].get("egress")


def test_rbac_is_one_role_per_component():
    """A Role and a RoleBinding per component, namespaced, each binding its component's account only (what each Role
    grants is checked against the code's calls by tests/unit/k8s/test_rbac_grants.py)."""
    docs = docs_of(K8S / "base" / "rbac.yaml")
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Role"}
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert {d["kind"] for d in docs} == {"Role", "RoleBinding"}  # namespaced only: no ClusterRole anywhere
    values = yaml.safe_load((K8S / "airflow" / "values.yaml").read_text())
    airflow_ns = values["config"]["kubernetes_executor"]["namespace"]
    bound = {}
    for b in bindings:
        assert b["roleRef"]["kind"] == "Role" and b["roleRef"]["name"] in roles
        assert len(b["subjects"]) == 1, b["metadata"]["name"]
        (s,) = b["subjects"]
        bound[(s["namespace"], s["name"])] = b["roleRef"]["name"]
    # the workers (operators) and the triggerer (deferred tasks' triggers); tests/unit/k8s/test_airflow_rbac.py derives
    # the names from the Helm chart's own rules
    accounts = [(airflow_ns, values[c]["serviceAccount"]["name"]) for c in ("workers", "triggerer")]
    assert sorted(bound) == sorted(accounts)
    assert len(set(bound.values())) == 2, "each component has a Role of its own"
    for role in roles.values():
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], role["metadata"]["name"]
            assert "watch" not in rule["verbs"] and "pods" not in rule["resources"], role["metadata"]["name"]


def test_helm_values_take_secrets_by_name_only():
    values = yaml.safe_load((K8S / "airflow" / "values.yaml").read_text())
    assert values["executor"] in ("KubernetesExecutor", "CeleryExecutor")
    for s in values["secret"]:
        assert set(s) == {"envName", "secretName", "secretKey"}
    for e in yaml.safe_load(values.get("extraEnv") or "[]"):
        assert set(e) == {"name", "valueFrom"} and set(e["valueFrom"]) == {"secretKeyRef"}, e
    secretish = re.compile(r"TOKEN|SECRET|PASSWORD|KEY", re.I)
    for e in values["env"]:
        # a variable naming a Secret (PIPELINE_RAY_AUTH_SECRET: a Secret's name, a DNS label) holds no secret
        names_a_secret = e["name"].endswith("_SECRET") and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", e["value"])
        assert names_a_secret or not secretish.search(e["name"]), f"{e['name']} must come from a Secret"
    mounts = json.loads(next(e["value"] for e in values["env"] if e["name"] == "PIPELINE_MOUNTS"))
    assert mounts == json.loads((K8S / "overlays/ack/mounts.json").read_text())


def test_dockerfiles_pin_what_the_project_pins():
    req = (ROOT / "requirements.txt").read_text()
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", req, re.M))
    airflow = (K8S / "docker" / "Dockerfile.airflow").read_text()
    # the base by digest only (the build refuses a base without one): tests/unit/k8s/test_image_builds.py
    assert f"apache/airflow:{pins['apache-airflow']}-python3.11@sha256:*) ;;" in airflow
    assert "-c /opt/airflow/project/constraints.txt" in airflow and "whl/cpu" in airflow
    train = (K8S / "docker" / "Dockerfile.train").read_text()
    # the base only by digest (a build with a tag fails), and the image checks the verl version the lock pins
    assert re.search(r"^ARG VERL_IMAGE$", train, re.M) and "FROM ${VERL_IMAGE}" in train
    assert "*@sha256:*) ;;" in train and "exit 1" in train
    assert f"verl=={pins['verl']}" in train and f"assert v == '{pins['verl']}'" in train
    assert not re.search(r"^FROM \S+:(latest|\S*\.latest)\b", train + airflow, re.M)


def scan(text: str) -> list[str]:
    return [what for pattern, what in SECRET_PATTERNS if re.search(pattern, text)]


def test_no_literal_secrets_anywhere():
    # a test that imports k8s/docker/lock_against_base.py leaves its bytecode there (the suite may write bytecode)
    files = [p for p in K8S.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    files += [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    files += [p for p in (ROOT / "pipeline_steps" / "training" / "presets").glob("*.yaml")]
    assert len(files) > 15 and all(f.is_file() for f in files)  # a listed file that is gone fails, not skips
    for f in files:
        if not f.exists():
            continue
        text = f.read_text()
        assert not scan(text), f"{f}: looks like a literal secret ({scan(text)})"
        if f.suffix == ".yaml":
            for doc in yaml.safe_load_all(text):
                assert not (isinstance(doc, dict) and doc.get("kind") == "Secret"), (
                    f"{f}: a Secret object; create it by hand instead"
                )


@pytest.mark.parametrize(
    "planted",
    [
        "token: hf_" + "a1B2" * 9,
        "akSecret: " + "Zx9" * 8,
        "id: LTAI" + "5tQx" * 4,
        '{"type": "service_account", "private_key": "x"}',
        "AWS_SECRET_ACCESS_KEY=" + "abcd" * 10,
    ],
)
def test_the_secret_scan_catches_planted_values(planted):
    assert scan(planted)
