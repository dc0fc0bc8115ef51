"""The training image's additions install and import (issue 24): what ``tests/unit/k8s/test_training_image.py`` checks
on paper, done with pip.

No Docker daemon runs here and the base image's CUDA builds (torch, vLLM, flash-attn, the nvidia-* wheels) cannot
install on this machine. So the image is approximated from below, in a fresh venv:
``k8s/docker/requirements-train.txt``, as ``Dockerfile.train`` installs it, with pip resolving its dependencies from the
package index, minus the CUDA builds. The base image carries those, and installing them here would pull GPU wheels.

Then, in that venv, the test imports every module that a cluster preset's pods import, or a shipped tool imports, and
whose distribution comes from the file or its dependencies. The imports come from the static test's scan of verl's
sources and ours. Each must import, or fail only for want of a CUDA build (``torch``) or of a package the base
installs by name (``k8s/docker/base-image-packages.txt``: ``mathruler`` imports ``pylatexenc`` without declaring it,
and the base installs it), which the image has. It fails
the way a pod would on a pin whose wheel lacks its module, on a dependency that nothing installs, or on a module name
that is not what we think. The old image (no mlflow, e2b-code-interpreter or mcp) fails here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib.resources import files

import pytest
import yaml
from packaging.utils import canonicalize_name

from tests.helpers.image_scan import (
    DOCKER,
    base_packages,
    closure,
    cluster_presets,
    distribution_of,
    dockerfile_installs,
    pod_imports,
    project_imports,
)

# the base image's builds for its CUDA (base-image-packages.txt and what pip pulls for them): not installable here
CUDA_BUILDS = {"torch", "torchvision", "torchaudio", "triton", "vllm", "flash-attn", "xformers", "apex"}


def _cuda_build(name: str) -> bool:
    return name in CUDA_BUILDS or name.startswith(("nvidia-", "cuda-"))


# the tool configs a preset may switch to in the form (guide 000's MCP route), as the static test covers them
TOOL_CONFIGS = ("code_sandbox.yaml", "mcp_tool.yaml")

PROBE = textwrap.dedent(
    """
    import importlib, json, sys
    out = {}
    for name in sys.argv[1:]:
        try:
            importlib.import_module(name)
            out[name] = "ok"
        except ModuleNotFoundError as exc:
            out[name] = "missing " + str(exc.name)
        except Exception as exc:
            out[name] = f"error {type(exc).__name__}: {exc}"
    print(json.dumps(out))
    """
)


def _pip(venv, *args, timeout=900) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", *args], capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, f"pip {' '.join(args[:3])}: {r.stderr[-3000:]}"
    return r


@pytest.mark.slow
@pytest.mark.budget(600)
def test_the_images_additions_install_into_a_fresh_venv_and_what_the_pods_import_from_them_imports(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    requirements = DOCKER / "requirements-train.txt"
    # what pip would install for the file (a resolution only: no CUDA wheel is downloaded)
    report = tmp_path / "report.json"
    _pip(venv, "install", "--dry-run", "--quiet", "--report", str(report), "-r", str(requirements))
    resolved = {
        canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }
    # the base's CUDA builds cannot install here (and the image has them): everything else pip resolved is installed
    ours = {n: v for n, v in resolved.items() if not _cuda_build(n)}
    installed, _ = dockerfile_installs(DOCKER / "Dockerfile.train")
    assert installed - {"verl"} <= set(resolved), sorted(installed - set(resolved))
    # --no-compile: no byte-compiling of every installed file; the imports below compile what they load
    _pip(venv, "install", "--quiet", "--no-deps", "--no-compile", *[f"{n}=={v}" for n, v in sorted(ours.items())])

    # every module a cluster preset's pods import, or a shipped tool's, from a distribution the file brings
    imports = {m for _, spec in cluster_presets() for found in pod_imports(spec).values() for m in found}
    for config in TOOL_CONFIGS:
        cfg = yaml.safe_load((files("pipeline_steps.tools") / config).read_text())
        imports |= {m for tool in cfg["tools"] for m in project_imports(tool["class_name"].rsplit(".", 1)[0])}
    from_file = closure(installed - {"verl"})  # the file's distributions and their dependencies
    modules = sorted(m for m in imports if distribution_of(m) in from_file)
    must = {"mlflow", "e2b_code_interpreter", "mcp"}  # the fault: the old image had none of them
    assert must <= {m.split(".")[0] for m in modules}, modules
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c", PROBE, *modules], capture_output=True, text=True, timeout=600
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    results = json.loads(probe.stdout.strip().splitlines()[-1])
    print(json.dumps(results, indent=1))
    base = base_packages()  # what the base installs by name (not what pip pulls for it)
    failed = {}
    for module, result in results.items():
        if result == "ok":
            continue
        missing = result.removeprefix("missing ") if result.startswith("missing ") else None
        if missing and (_cuda_build(distribution_of(missing) or "") or distribution_of(missing) in base):
            continue  # the base image has it: a CUDA build (torch), or a package it installs by name (pylatexenc)
        failed[module] = result
    assert not failed, f"in a venv with the training image's additions: {failed}"
    assert {m for m, r in results.items() if r == "ok"} >= must
