"""What the training image holds and what the cluster presets' pods import, read without Docker (the scan behind
tests/unit/k8s/test_training_image.py and tests/e2e/test_training_image_install.py): the Dockerfile's ``pip install``
arguments, the base image's package list, their dependency closure from the installed metadata, and the imports of
verl's and the pipeline's sources that run in a preset's pods."""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import re
import shlex
import sys
from functools import cache
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "k8s" / "docker"
PRESETS = ROOT / "pipeline_steps" / "training" / "presets"


def cluster_presets() -> list[tuple[str, dict]]:
    out = []
    for p in sorted(PRESETS.glob("*.yaml")):
        spec = yaml.safe_load(p.read_text())
        if spec.get("backend") == "cluster":
            out.append((spec["name"], spec))
    return out


def logical_lines(text: str) -> list[str]:
    return re.sub(r"\\\n", " ", text).splitlines()


def dockerfile_installs(dockerfile: Path) -> tuple[set[str], list[str]]:
    """Distribution names the Dockerfile pip-installs (beyond the project itself), and its ``-r`` files."""
    text = dockerfile.read_text()
    copies = {}  # image path -> repository path
    for line in logical_lines(text):
        m = re.match(r"^COPY\s+(\S+)\s+(\S+)\s*$", line)
        if m:
            copies[m.group(2)] = m.group(1)
    names, req_files = set(), []
    for line in logical_lines(text):
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
    from pipeline_steps.data.preprocessors import get_preprocessor

    datasets = spec.get("datasets") or {}
    names = set(datasets.get("train") or []) | set(datasets.get("val") or [])
    names |= {(spec.get("evaluation") or {}).get("dataset")} - {None}
    out = set()
    for name in names:
        ds = registry.BUILTIN[name]
        out.add(ds.data_source or get_preprocessor(ds.preprocessor).data_source)
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
