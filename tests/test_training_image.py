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

import ast
import importlib.metadata as md
import importlib.util
import re
import shlex
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "k8s" / "docker"
PRESETS = ROOT / "pipeline_steps" / "training" / "presets"
# what the base image builds for its CUDA: installing the image's requirements must not replace any of them
BASE_PINNED = {"torch", "vllm", "ray", "numpy", "protobuf", "transformers"}


def cluster_presets() -> list[tuple[str, dict]]:
    out = []
    for p in sorted(PRESETS.glob("*.yaml")):
        spec = yaml.safe_load(p.read_text())
        if spec.get("backend") == "cluster":
            out.append((spec["name"], spec))
    return out


def _logical_lines(text: str) -> list[str]:
    return re.sub(r"\\\n", " ", text).splitlines()


def dockerfile_installs(dockerfile: Path) -> tuple[set[str], list[str]]:
    """Distribution names the Dockerfile pip-installs (beyond the project itself), and its ``-r`` files."""
    text = dockerfile.read_text()
    copies = {}  # image path -> repository path
    for line in _logical_lines(text):
        m = re.match(r"^COPY\s+(\S+)\s+(\S+)\s*$", line)
        if m:
            copies[m.group(2)] = m.group(1)
    names, req_files = set(), []
    for line in _logical_lines(text):
        if not line.startswith("RUN "):
            continue
        for cmd in line[4:].split("&&"):
            argv = shlex.split(cmd)
            if argv[:2] != ["pip", "install"]:
                continue
            args, i = argv[2:], 0
            while i < len(args):
                a = args[i]
                if a in ("-r", "--requirement"):
                    req_files.append(copies.get(args[i + 1], args[i + 1]))
                    i += 2
                    continue
                if a in ("-c", "--constraint"):
                    i += 2
                    continue
                if not a.startswith("-") and not a.startswith("/"):
                    names.add(canonicalize_name(Requirement(a).name))
                i += 1
    for rel in req_files:
        for line in (ROOT / rel).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                names.add(canonicalize_name(Requirement(line).name))
    return names, req_files


def base_packages() -> set[str]:
    lines = (DOCKER / "base-image-packages.txt").read_text().splitlines()
    return {canonicalize_name(x.strip()) for x in lines if x.strip() and not x.startswith("#")}


def closure(names: set[str]) -> set[str]:
    """``names`` with their dependencies (no extras), from the installed metadata; unknown names stay as they are."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue  # e.g. vllm, flash-attn: not installable on this CPU machine, present in the base anyway
        for r in requires:
            req = Requirement(r)
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            todo.append(canonicalize_name(req.name))
    return seen


def _imports(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def _source(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec and spec.origin and spec.origin.endswith(".py") else None


def _top_level_imports(module: str) -> set[str]:
    """The module's import statements outside functions (what importing it runs)."""
    path = _source(module)
    if path is None:
        return set()
    tree = ast.parse(path.read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Try, ast.If)):
            out |= _imports(node)
    return out


@cache
def project_imports(module: str) -> frozenset[str]:
    """Every module ``module`` (a pipeline_steps module or a file path) imports, following pipeline_steps modules.

    A worklist with a seen set: pipeline_steps modules may import each other in a cycle.
    """
    out, seen, todo = set(), {module}, [module]
    while todo:
        current = todo.pop()
        path = Path(current) if current.endswith(".py") else _source(current)
        for name in _imports(ast.parse(path.read_text())):
            if name.split(".")[0] != "pipeline_steps":
                out.add(name)
            elif name not in seen and _source(name):
                seen.add(name)
                todo.append(name)
    return frozenset(out)


@cache
def logger_backend_imports() -> dict[str, set[str]]:
    """verl's tracking.py: for each ``if "<backend>" in ...:`` branch, what it imports (and the classes it builds)."""
    path = _source("verl.utils.tracking")
    tree = ast.parse(path.read_text())
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)):
            continue
        left = node.test.left
        is_in = isinstance(node.test.ops[0], ast.In)
        if not (is_in and isinstance(left, ast.Constant) and isinstance(left.value, str)):
            continue
        body = ast.Module(body=node.body, type_ignores=[])
        mods = _imports(body)
        for call in ast.walk(body):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in defs:
                mods |= _imports(defs[call.func.id])
        # one level into a submodule of another package (torch.utils.tensorboard imports tensorboard)
        for m in list(mods):
            if "." in m and m.split(".")[0] != "verl":
                mods |= {x for x in _top_level_imports(m) if x.split(".")[0] != m.split(".")[0]}
        out.setdefault(left.value, set()).update(mods)
    return out


def _verl_source(relative: str) -> Path:
    return Path(list(importlib.util.find_spec("verl").submodule_search_locations)[0]) / relative


def _file_imports(path: Path, package: str) -> set[str]:
    """Every import in the file, also inside functions (verl imports qwen_vl_utils and mathruler lazily), with
    relative imports resolved against ``package``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                out.add(node.module)
            elif node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                out.update(f"{base}.{node.module or a.name}" for a in node.names)
    return out


def scorer_imports(data_source: str) -> set[str]:
    """What verl's ``default_compute_score`` imports for ``data_source``: the body of the first ``if``/``elif`` of
    verl/utils/reward_score/__init__.py whose test holds for it, and the scorer modules that body imports."""
    tree = ast.parse(_verl_source("utils/reward_score/__init__.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "default_compute_score")
    node = next(n for n in fn.body if isinstance(n, ast.If))
    while isinstance(node, ast.If):
        if eval(compile(ast.Expression(node.test), "<verl>", "eval"), {}, {"data_source": data_source}):
            body = ast.Module(body=node.body, type_ignores=[])
            mods = set()
            for sub in ast.walk(body):
                if isinstance(sub, ast.ImportFrom) and sub.level == 1:
                    mods |= {f"verl.utils.reward_score.{sub.module or a.name}" for a in sub.names}
            out = set()
            for mod in mods:
                path = _verl_source(mod.removeprefix("verl.").replace(".", "/") + ".py")
                out |= {m for m in _file_imports(path, mod.rsplit(".", 1)[0]) if not m.startswith("verl")}
            return out
        node = node.orelse[0] if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If) else None
    raise AssertionError(f"verl's default_compute_score has no branch for data_source {data_source!r}")


def data_sources(spec: dict) -> set[str]:
    """The data_source of each dataset the preset trains, validates and evaluates on (the registry's, else its
    preprocessor's), which selects verl's scorer."""
    from pipeline_steps.data import registry

    datasets = spec.get("datasets") or {}
    names = set(datasets.get("train") or []) | set(datasets.get("val") or [])
    names |= {(spec.get("evaluation") or {}).get("dataset")} - {None}
    out = set()
    for name in names:
        ds = registry.BUILTIN[name]
        module = importlib.import_module(f"pipeline_steps.data.preprocessors.{ds.preprocessor}")
        out.add(ds.data_source or module.DATA_SOURCE)
    return out


# verl 0.9.1's multimodal data path (RLHFDataset with data.image_key; its vision helpers fetch and resize the images)
MULTIMODAL_PATH = ("utils/dataset/rl_dataset.py", "utils/dataset/vision_utils.py")


def pod_imports(spec: dict) -> dict[str, set[str]]:
    """What the preset's pods import, by where the import comes from."""
    from pipeline_steps.tools import resolve_config_path

    verl = spec.get("verl") or {}
    out: dict[str, set[str]] = {}
    backends = logger_backend_imports()
    loggers = verl.get("trainer.logger") or []
    for name in [loggers] if isinstance(loggers, str) else loggers:
        out[f"trainer.logger {name}"] = set(backends.get(name, set()))
    if str(verl.get("actor_rollout_ref.rollout.multi_turn.enable", False)).lower() == "true":
        tool_config = resolve_config_path(verl["actor_rollout_ref.rollout.multi_turn.tool_config_path"])
        cfg = yaml.safe_load(Path(tool_config).read_text())
        for tool in cfg["tools"]:
            module = tool["class_name"].rsplit(".", 1)[0]
            out[f"tool {tool['class_name']}"] = set(project_imports(module))
    reward = verl.get("reward.custom_reward_function.path")
    if reward:
        out[f"reward {reward}"] = set(project_imports(resolve_config_path(reward)))
    for step in ("pipeline_steps.steps.evaluate", "pipeline_steps.steps.export", "pipeline_steps.cluster_entry"):
        out[step] = set(project_imports(step))
    for source in sorted(data_sources(spec)):
        out[f"verl scorer for {source}"] = scorer_imports(source)
    if "image" in ((spec.get("model") or {}).get("modalities") or []):
        for rel in MULTIMODAL_PATH:
            imports = _file_imports(
                _verl_source(rel), "verl." + rel.removesuffix(".py").replace("/", ".").rsplit(".", 1)[0]
            )
            out[f"verl {rel}"] = {m for m in imports if not m.startswith("verl")}
    return out


@cache
def module_distributions() -> dict[str, list[str]]:
    return md.packages_distributions()


def distribution_of(module: str) -> str | None:
    top = module.split(".")[0]
    if top in sys.stdlib_module_names or top in ("verl", "pipeline_steps", "operators"):
        return None
    dists = module_distributions().get(top)
    return canonicalize_name(dists[0]) if dists else canonicalize_name(top)


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
    # the whole lock as constraints would move numpy / protobuf / transformers off the base's versions
    for line in [x for x in _logical_lines(text) if x.startswith("RUN ") and "pip install" in x]:
        for cmd in line.split("&&"):
            argv = shlex.split(cmd.removeprefix("RUN "))
            if argv[:2] == ["pip", "install"]:
                assert not {"-c", "--constraint"} & set(argv), f"Dockerfile.train: {cmd.strip()} takes constraints"
