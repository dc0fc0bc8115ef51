"""Independent validators over everything the deployment applies, so this class of fault stays found.

- kubernetes-validate ``--strict -k 1.33.0`` (its CLI, Kubernetes' own OpenAPI schemas shipped offline) over every
  manifest in k8s/, the cloud overlays built with ``kubectl kustomize`` (with the optional components), and the pod
  templates of every rendered RayJob (each cluster preset through tests/helpers/render.py, and the committed examples)
  and of the SandboxSet, fed as Pods: custom kinds get no check from it, their pods do.
- checkov (Kubernetes and Dockerfile frameworks) over the same manifests, the Dockerfiles and those Pods, with the short
  skip list :data:`CHECKOV_SKIPS`, each skip with its reason.

checkov's dependencies conflict with the project's lock (it pins ``tabulate<0.10``, the lock has 0.10.0), so it is not a
package of the project's venv: the test installs it from its own lock (tests/unit/k8s/checkov-requirements.txt, exact
versions, ``--no-deps``) into a venv of its own under the run's cache dir (``$PIPELINE_CACHE_DIR``), once per run and
lock, and runs its CLI from there. Each validator prints its counts: checked, skipped (with reasons), failed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # kustomize builds, every preset rendered, two validators over ~100 objects (~1 min)

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "k8s"
KUBE_VERSION = "1.33.0"  # a version both ACK and GKE offer (as tests/unit/k8s/test_k8s_manifests.py)
CHECKOV_LOCK = Path(__file__).with_name("checkov-requirements.txt")
NOT_MANIFESTS = {"kustomization.yaml", "node-pools.yaml"}  # kustomize files; node shapes the presets are sized for
# custom kinds kubernetes-validate has no schema for, and where they are checked instead
CUSTOM_KINDS = {
    "RayJob": "KubeRay's CRD schema (test_k8s_manifests.py); its head and worker pod templates are validated as Pods",
    "SandboxSet": "OpenKruise agents' CRD is not vendored; its pod template is validated as a Pod",
    "LocalQueue": "Kueue's CRD is not vendored (test_k8s_manifests.py checks its fields)",
}

# checkov checks skipped, each for a reason: kept short; a check that fails and is not here fails the test.
CHECKOV_SKIPS = {
    "CKV_K8S_15": "imagePullPolicy IfNotPresent is intended: every image is pinned by digest; Always only adds pulls",
    "CKV_K8S_21": "the default-namespace check misfires on pod templates fed as bare Pods (they carry no namespace); "
    "every real object names its namespace",
    "CKV_K8S_8": "liveness probes: Ray's head and workers are supervised by KubeRay and the RayJob's deadline; a "
    "failed probe would kill a multi-hour training step",
    "CKV_K8S_9": "readiness probes: no Service routes traffic to these pods by readiness (KubeRay's head service and "
    "sandbox-manager address pods directly)",
    "CKV_K8S_35": "secrets as files: verl, the E2B SDK and huggingface_hub read their keys from the environment only",
    "CKV_K8S_40": "high UID: the sandbox runs as the image's own user (uid 1000); Ray's images run as root",
    "CKV_K8S_43": "digests: checkov reads the manifests' <digest> placeholders as unpinned; "
    "test_every_image_in_k8s_is_pinned_by_digest_and_from_no_test_registry checks every image instead",
    "CKV2_K8S_6": "NetworkPolicy per pod: the Ray pods' egress policy ships in the optional sandbox component (its own "
    "network model on each cloud); not every namespace gets one by default",
    "CKV_K8S_22": "read-only root filesystem: Ray writes /tmp/ray and the sandbox's code writes its home; both "
    "bounded by ephemeral-storage limits",
    "CKV_K8S_23": "root: verl's CUDA images (Ray head and workers) run as root, as the guides' pods do (seed 000 "
    "runAsUser 0); the sandbox pods are non-root",
    "CKV_K8S_20": "privilege escalation on the Ray pods: left to the preset's cluster.security_context (verl's images "
    "run as root); the sandbox sets it false",
    "CKV_K8S_28": "NET_RAW on the Ray pods: as CKV_K8S_20 (cluster.security_context); the sandbox drops ALL",
    "CKV_K8S_37": "capabilities on the Ray pods: as CKV_K8S_20 (cluster.security_context); the sandbox drops ALL",
    "CKV_K8S_31": "seccomp on the Ray pods: as CKV_K8S_20 (cluster.security_context); the sandbox sets RuntimeDefault",
    "CKV_K8S_29": "pod security context on the Ray pods: as CKV_K8S_20 (cluster.security_context)",
    "CKV_K8S_30": "container security context on the Ray pods: as CKV_K8S_20 (cluster.security_context)",
    "CKV_K8S_38": "service-account token on the Ray pods: their account reads the bucket on GKE (Workload Identity "
    "needs the token); the sandbox mounts none",
    "CKV_DOCKER_2": "HEALTHCHECK: Kubernetes probes the pods (Docker's HEALTHCHECK is ignored by kubelet)",
    "CKV_DOCKER_7": "FROM ${ARG}: checkov cannot read the tag of an ARG base; the build refuses one without a digest "
    "(test_image_builds.py::test_every_base_is_pinned_by_digest)",
    "CKV_DOCKER_3": "USER in Dockerfile.train: verl's base image and the guides run the Ray pods as root",
}
# checks that may only be skipped on the Ray pods (rendered RayJobs): on the sandbox they must pass
RAY_ONLY = {
    "CKV_K8S_20",
    "CKV_K8S_28",
    "CKV_K8S_37",
    "CKV_K8S_31",
    "CKV_K8S_29",
    "CKV_K8S_30",
    "CKV_K8S_38",
    "CKV_K8S_23",
}


# -- what is validated -------------------------------------------------------------------------------------------------
def manifest_files() -> list[Path]:
    return sorted(
        p
        for p in K8S.rglob("*.yaml")
        if p.name not in NOT_MANIFESTS and p.parent != K8S / "airflow"  # k8s/airflow: Helm values
    )


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomize(tmp: Path) -> dict[str, list[dict]]:
    """Each cloud overlay built as shipped, and with the optional components on top."""
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.fail("kubectl (with kustomize) is required: apt-get install kubectl")
    builds = {}
    for cloud in ("ack", "gke"):
        targets = {f"overlay-{cloud}": K8S / "overlays" / cloud}
        with_components = tmp / f"{cloud}-with-components"
        with_components.mkdir()
        (with_components / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": [os.path.relpath(K8S / "overlays" / cloud, with_components)],
                    "components": [
                        os.path.relpath(K8S / "components" / c, with_components)
                        for c in (("kueue", "sandbox") if cloud == "ack" else ("kueue",))
                    ],
                }
            )
        )
        targets[f"overlay-{cloud}+components"] = with_components
        for name, path in targets.items():
            args = [kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(path)]
            p = subprocess.run(args, capture_output=True, text=True, timeout=120)
            assert p.returncode == 0, f"{name}: {p.stderr}"
            builds[name] = [d for d in yaml.safe_load_all(p.stdout) if d]
    return builds


def as_pod(name: str, template: dict, namespace: str | None = None) -> dict:
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    meta.update({k: v for k, v in (template.get("metadata") or {}).items() if k in ("labels", "annotations")})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


def rayjob_pods(job: dict, where: str) -> list[tuple[str, dict]]:
    cluster = job["spec"]["rayClusterSpec"]
    ns = job["metadata"].get("namespace")
    out = [(f"{where}/head", as_pod(f"{job['metadata']['name']}-head", cluster["headGroupSpec"]["template"], ns))]
    for g in cluster.get("workerGroupSpecs") or []:
        out.append(
            (f"{where}/{g['groupName']}", as_pod(f"{job['metadata']['name']}-{g['groupName']}", g["template"], ns))
        )
    return out


def rendered_rayjobs(monkeypatch) -> list[tuple[str, dict]]:
    """Every cluster preset rendered as the pipeline renders it (with its cloud's mounts), and the examples."""
    from tests.helpers.render import EXAMPLES, render

    monkeypatch.setenv("PIPELINE_TRAIN_IMAGE", "registry.example.com/verl-grpo-train@sha256:" + "0" * 64)
    jobs = [
        (f"render:{preset}", render(preset, mounts, bucket, dataset)[1]) for preset, mounts, bucket, dataset in EXAMPLES
    ]
    jobs += [(f"example:{p.name}", d) for p in sorted((K8S / "examples").glob("*.yaml")) for d in docs(p)]
    return jobs


def sandbox_pods() -> list[tuple[str, dict]]:
    out = []
    for d in docs(K8S / "components" / "sandbox" / "sandboxset.yaml"):
        if d["kind"] == "SandboxSet":
            out.append(
                (
                    f"sandboxset:{d['metadata']['name']}",
                    as_pod(d["metadata"]["name"], d["spec"]["template"], d["metadata"]["namespace"]),
                )
            )
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """{label: object} of everything validated, and the pod templates (label -> Pod)."""
    monkeypatch = pytest.MonkeyPatch()
    tmp = tmp_path_factory.mktemp("validators")
    try:
        objects = {f"{p.relative_to(ROOT)}#{i}": d for p in manifest_files() for i, d in enumerate(docs(p))}
        for name, built in kustomize(tmp).items():
            objects.update({f"{name}#{i}": d for i, d in enumerate(built)})
        pods = {}
        jobs = rendered_rayjobs(monkeypatch)
        assert len(jobs) >= 16, "every cluster preset rendered and every example"
        for where, job in jobs:
            pods.update(dict(rayjob_pods(job, where)))
        pods.update(dict(sandbox_pods()))
        assert any(k.startswith("sandboxset:") for k in pods)
        return {"objects": objects, "pods": pods, "tmp": tmp}
    finally:
        monkeypatch.undo()


def write_all(items: dict[str, dict], folder: Path) -> dict[Path, str]:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for i, (label, obj) in enumerate(sorted(items.items())):
        path = folder / f"{i:04d}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', label)[-80:]}.yaml"
        path.write_text(yaml.safe_dump(obj, sort_keys=False))
        out[path] = label
    return out


# -- kubernetes-validate -----------------------------------------------------------------------------------------------
def test_kubernetes_validate_strict(corpus):
    exe = Path(sys.executable).with_name("kubernetes-validate")
    assert exe.is_file(), "kubernetes-validate is in the test extra (pyproject.toml)"
    items = {**corpus["objects"], **{f"pod:{k}": v for k, v in corpus["pods"].items()}}
    skipped = {label: CUSTOM_KINDS[o["kind"]] for label, o in items.items() if o.get("kind") in CUSTOM_KINDS}
    unknown = {o.get("kind") for o in items.values() if "/" in str(o.get("apiVersion")) and "." in o["apiVersion"]}
    unknown -= {
        "RayJob",
        "SandboxSet",
        "LocalQueue",
        "Role",
        "RoleBinding",
        "NetworkPolicy",
        "CustomResourceDefinition",
    }
    assert not unknown, f"kinds of another API group that kubernetes-validate may not know: {unknown}"
    files = write_all({k: v for k, v in items.items() if k not in skipped}, corpus["tmp"] / "kubernetes-validate")
    p = subprocess.run(
        [str(exe), "--strict", "-k", KUBE_VERSION, *map(str, files)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = (p.stdout + p.stderr).splitlines()
    passed = [line for line in output if line.startswith("INFO ") and " passed for resource " in line]
    failed = [line for line in output if line.startswith("ERROR ")]
    print(
        f"\nkubernetes-validate --strict -k {KUBE_VERSION}: checked {len(files)} objects "
        f"({len(corpus['pods'])} of them pod templates fed as Pods): passed {len(passed)}, failed {len(failed)}, "
        f"skipped {len(skipped)}"
    )
    for reason in sorted(set(skipped.values())):
        print(f"  skipped {sum(1 for r in skipped.values() if r == reason)}: {reason}")
    for line in failed:
        print(f"  {line}")
    assert not failed and len(passed) == len(files), "\n".join(output[-40:])
    assert p.returncode == 0


def test_kubernetes_validate_catches_a_broken_pod(tmp_path):
    """The validator is live: a field of the wrong type and an unknown field both fail under --strict."""
    exe = Path(sys.executable).with_name("kubernetes-validate")
    pod = as_pod("p", {"spec": {"containers": [{"name": "c", "image": "x@sha256:" + "0" * 64}]}})
    pod["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1"}, "limts": {}}
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump(pod))
    p = subprocess.run([str(exe), "--strict", "-k", KUBE_VERSION, str(path)], capture_output=True, text=True)
    assert p.returncode != 0 and "limts" in p.stdout + p.stderr


# -- checkov -----------------------------------------------------------------------------------------------------------
def checkov_exe() -> Path:
    """checkov from its own venv under the run's cache dir (created once per run and lock, under a file lock)."""
    lock_text = CHECKOV_LOCK.read_text()
    digest = hashlib.sha256(lock_text.encode()).hexdigest()[:12]
    cache = Path(os.environ.get("PIPELINE_CACHE_DIR") or Path(tempfile.gettempdir()) / "pipeline-test-cache")
    venv = cache / "tools" / f"checkov-{digest}"
    exe = venv / "bin" / "checkov"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"checkov-{digest}.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if not (venv / ".installed").exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
            p = subprocess.run(
                [str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "-r", str(CHECKOV_LOCK)],
                capture_output=True,
                text=True,
                timeout=900,
            )
            assert p.returncode == 0, f"installing checkov from {CHECKOV_LOCK.name} failed:\n{p.stderr[-3000:]}"
            (venv / ".installed").write_text(lock_text)
    return exe


def run_checkov(folder, frameworks: list[str], select: str, checks, timeout: int, sca_scan: bool = True):
    """checkov's JSON report over ``folder`` (``select``: ``--check`` or ``--skip-check`` with ``checks``; ``{}`` when
    it reports nothing); its download of Bridgecrew's mappings is off (no network here)."""
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE"}
    if not sca_scan:
        env["CHECKOV_RUN_SCA_PACKAGE_SCAN_V2"] = "false"
    p = subprocess.run(
        [str(checkov_exe()), "-d", str(folder), "--framework", *frameworks, "-o", "json", "--quiet", "--compact"]
        + ["--skip-download", select, ",".join(sorted(checks))],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return json.loads(p.stdout) if p.stdout.strip() else {}


def test_checkov(corpus):
    folder = corpus["tmp"] / "checkov"
    files = write_all({**corpus["objects"], **{f"pod:{k}": v for k, v in corpus["pods"].items()}}, folder)
    for dockerfile in sorted((K8S / "docker").glob("Dockerfile.*")):
        target = folder / dockerfile.name.replace("Dockerfile.", "") / "Dockerfile"
        target.parent.mkdir()
        shutil.copy(dockerfile, target)
    reports = run_checkov(
        folder, ["kubernetes", "dockerfile"], "--skip-check", CHECKOV_SKIPS, timeout=900, sca_scan=False
    )
    assert reports, "checkov reported nothing"
    reports = reports if isinstance(reports, list) else [reports]
    passed = failed = skipped = 0
    failures = []
    ray_skipped_on_sandbox = []
    for report in reports:
        results = report.get("results") or {}
        summary = report.get("summary") or {}
        passed += summary.get("passed", 0)
        failed += summary.get("failed", 0)
        skipped += summary.get("skipped", 0)
        for check in results.get("failed_checks") or []:
            failures.append(
                f"{check['check_id']} {check['check_name']}: {check.get('file_path')} {check.get('resource')}"
            )
    # the Ray-only skips must not hide a fault of the sandbox: rerun those checks on the sandbox alone
    sandbox = {k: v for k, v in corpus["pods"].items() if k.startswith("sandboxset:")}
    sandbox_dir = corpus["tmp"] / "checkov-sandbox"
    write_all(sandbox, sandbox_dir)
    sandbox_report = run_checkov(sandbox_dir, ["kubernetes"], "--check", RAY_ONLY, timeout=600)

    for check in (sandbox_report.get("results") or {}).get("failed_checks") or []:
        ray_skipped_on_sandbox.append(f"{check['check_id']} {check['check_name']}")
    print(
        f"\ncheckov (kubernetes, dockerfile) over {len(files)} objects and pod templates and "
        f"{len(list((K8S / 'docker').glob('Dockerfile.*')))} Dockerfiles: checks passed {passed}, failed {failed}, "
        f"skipped {skipped} (by {len(CHECKOV_SKIPS)} check ids, each with its reason):"
    )
    for check_id, reason in sorted(CHECKOV_SKIPS.items()):
        print(f"  {check_id}: {reason}")
    sandbox_passed = (sandbox_report.get("summary") or {}).get("passed", 0)
    print(f"  the Ray-only skips on the sandbox pod: passed {sandbox_passed}, failed {len(ray_skipped_on_sandbox)}")
    assert not failures, "checkov failed checks:\n" + "\n".join(sorted(failures))
    assert not ray_skipped_on_sandbox, "the sandbox pod fails: " + ", ".join(ray_skipped_on_sandbox)
    assert sandbox_passed >= len(RAY_ONLY) - 1


# -- images anywhere in k8s/ -------------------------------------------------------------------------------------------
def _images(value) -> set[str]:
    """Every container image in an object (any pod spec, however deep: RayJob groups, SandboxSet, Pods)."""
    out = set()
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("containers", "initContainers", "ephemeralContainers") and isinstance(item, list):
                out |= {c["image"] for c in item if isinstance(c, dict) and "image" in c}
            out |= _images(item)
    elif isinstance(value, list):
        for item in value:
            out |= _images(item)
    return out


def test_every_image_in_k8s_is_pinned_by_digest_and_from_no_test_registry(corpus):
    images = set()
    for label, obj in corpus["objects"].items():
        # the CRD's schema describes images; the RayJob template's TRAINING-IMAGE is filled by the renderer, which
        # refuses a missing image or a moving tag
        if obj.get("kind") != "CustomResourceDefinition" and not label.startswith("k8s/templates/"):
            images |= _images(obj)
    images |= _images(corpus["pods"])
    assert any("e2b-code-interpreter" in i for i in images) and any("verl-grpo-train" in i for i in images)
    for image in sorted(images):
        assert "@sha256:" in image, f"{image}: pin by digest"
        assert not re.search(r"(^|[-./])test([-./0-9]|$)", image.split("@")[0]), f"{image}: a test registry"
    print(f"\n{len(images)} images, every one by digest: {sorted(images)}")
