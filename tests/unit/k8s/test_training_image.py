"""The training image has every module the cluster presets' pods import (issue 24, fault 1).

No Docker daemon runs here, so the image is not built. Instead the test reads what ``k8s/docker/Dockerfile.train``
installs (its ``pip install`` arguments, following ``-r`` files it COPYs in), adds what its base image carries
(``k8s/docker/base-image-packages.txt``, taken from verl's own build files) and every dependency of both as pip would
resolve them (from the installed packages' metadata), and checks the result against the modules each cluster
preset's pods import. Those imports are found in the sources that run there, not listed by hand: verl's own
``verl/utils/tracking.py`` for each ``trainer.logger`` backend (following one level into the module it imports, e.g.
``torch.utils.tensorboard`` -> ``tensorboard``), each tool class of the preset's tool config, the reward file, the
pipeline's cluster steps (evaluate, export), verl's scorer for each of the preset's datasets (the branch of
``default_compute_score`` its data_source takes: geometry3k's imports ``mathruler``) and, for a preset whose model reads
images, verl's multimodal data path (``RLHFDataset`` and its vision helpers: ``qwen_vl_utils``, ``PIL``). The old
Dockerfile (no mlflow, e2b, e2b-code-interpreter, mcp) fails; so does one without qwen-vl-utils for the VL presets.
"""

from __future__ import annotations

import re
import shlex

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers.image_scan import (
    DOCKER,
    ROOT,
    base_packages,
    closure,
    cluster_presets,
    distribution_of,
    dockerfile_installs,
    logger_backend_imports,
    logical_lines,
    pod_imports,
    project_imports,
    scorer_imports,
)

# what the base image builds for its CUDA: installing the image's requirements must not replace any of them
BASE_PINNED = {"torch", "vllm", "ray", "numpy", "protobuf", "transformers"}


def test_scorer_and_multimodal_scans_read_verl():
    """The scans see what verl imports lazily (else the check below would pass on an empty set)."""
    assert "mathruler.grader" in scorer_imports("hiyouga/geometry3k")
    assert not {m for m in scorer_imports("openai/gsm8k") if distribution_of(m)}  # the standard library only
    vl = dict(cluster_presets())["geo3k_qwen2_5_vl_7b"]
    imports = pod_imports(vl)
    assert "qwen_vl_utils" in imports["verl utils/dataset/rl_dataset.py"]
    assert "PIL" in {m.split(".")[0] for m in imports["verl utils/dataset/rl_dataset.py"]}
    assert "verl utils/dataset/rl_dataset.py" not in pod_imports(dict(cluster_presets())["gsm8k_qwen2_5_3b"])


def test_backend_scan_reads_verl_tracking():
    """The scan sees verl's unguarded mlflow import and tensorboard through torch (else the check below is empty)."""
    backends = logger_backend_imports()
    assert "mlflow" in backends["mlflow"]
    assert "tensorboard" in {m.split(".")[0] for m in backends["tensorboard"]}


@pytest.mark.parametrize("name,spec", cluster_presets(), ids=[n for n, _ in cluster_presets()])
def test_image_has_what_each_cluster_preset_imports(name, spec):
    installed, _ = dockerfile_installs(DOCKER / "Dockerfile.train")
    available = closure(base_packages() | installed)
    missing = []
    for where, modules in sorted(pod_imports(spec).items()):
        for module in sorted(modules):
            dist = distribution_of(module)
            if dist and dist not in available:
                missing.append(f"{where}: import {module} (distribution {dist})")
    assert not missing, f"{name}: the training image lacks\n" + "\n".join(missing)


@pytest.mark.parametrize("config", ["code_sandbox.yaml", "mcp_tool.yaml"])
def test_image_has_every_shipped_tools_sdk(config):
    """The tool configs a preset may switch to (the MCP route of guide 000 is set in the form) are covered too."""
    from importlib.resources import files

    installed, _ = dockerfile_installs(DOCKER / "Dockerfile.train")
    available = closure(base_packages() | installed)
    cfg = yaml.safe_load((files("pipeline_steps.tools") / config).read_text())
    for tool in cfg["tools"]:
        modules = project_imports(tool["class_name"].rsplit(".", 1)[0])
        missing = sorted(m for m in modules if distribution_of(m) and distribution_of(m) not in available)
        assert not missing, f"{config}: the training image lacks {missing}"


# What turns a geometry3k row into model inputs and a reward: the figure's fetch and resize (qwen-vl-utils), its
# decoder (Pillow) and the geo3k scorer's grader (mathruler). The base has them at whatever version its build day
# resolved; pinned here so a rebuilt base cannot change a VL preset's inputs or scores.
VL_PINNED = {"qwen-vl-utils", "pillow", "mathruler"}


def test_the_vl_presets_data_path_and_scorer_are_pinned_by_the_image():
    installed, req_files = dockerfile_installs(DOCKER / "Dockerfile.train")
    pinned = {
        canonicalize_name(Requirement(line).name)
        for rel in req_files
        for line in (x.split("#", 1)[0].strip() for x in (ROOT / rel).read_text().splitlines())
        if line and any(s.operator == "==" for s in Requirement(line).specifier)
    }
    vl = [(n, s) for n, s in cluster_presets() if "image" in ((s.get("model") or {}).get("modalities") or [])]
    assert {n for n, _ in vl} >= {"geo3k_qwen2_5_vl_7b", "geo3k_qwen2_5_vl_3b"}
    for name, spec in vl:  # the list names what these pods really import (it cannot go stale)
        dists = {distribution_of(m) for modules in pod_imports(spec).values() for m in modules}
        assert VL_PINNED <= dists, f"{name}: imports none of {sorted(VL_PINNED - dists)}"
    assert VL_PINNED <= pinned, f"Dockerfile.train leaves {sorted(VL_PINNED - pinned)} to the base's unpinned build"


def test_image_requirements_are_pinned_to_the_lock_and_keep_the_base_builds():
    lock = {
        canonicalize_name(n): v
        for n, v in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "constraints.txt").read_text(), re.M)
    }
    text = (DOCKER / "Dockerfile.train").read_text()
    _, req_files = dockerfile_installs(DOCKER / "Dockerfile.train")
    assert req_files, "Dockerfile.train installs its additions from one requirements file"
    for rel in req_files:
        for line in (ROOT / rel).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            req = Requirement(line)
            name = canonicalize_name(req.name)
            pins = [s.version for s in req.specifier if s.operator == "=="]
            assert pins, f"{rel}: {line} is not pinned (name==version)"
            assert lock.get(name) == pins[0], f"{rel}: {line} differs from constraints.txt ({lock.get(name)})"
            assert name not in BASE_PINNED, f"{rel}: {name} is the base image's own build; do not reinstall it"
    # the whole lock as constraints would move numpy / protobuf / transformers off the base's versions: the only
    # constraints file is the one k8s/docker/lock_against_base.py makes from the base's own pip freeze (base first)
    for line in [x for x in logical_lines(text) if x.startswith("RUN ") and "pip install" in x]:
        for cmd in line.split("&&"):
            argv = shlex.split(cmd.removeprefix("RUN "))
            if argv[:2] == ["pip", "install"] and {"-c", "--constraint"} & set(argv):
                i = argv.index("-c") if "-c" in argv else argv.index("--constraint")
                assert argv[i + 1] == "/opt/verl-grpo/train-constraints.txt", f"Dockerfile.train: {cmd.strip()}"
