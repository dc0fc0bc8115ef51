"""The import graph of ``dags/``, ``operators/`` and ``pipeline_steps/`` follows the README's "Layout" table.

Pure ``ast`` over the source files (nothing of the package is imported, so this runs in well under a second):

* no two modules under dags/ operators/ pipeline_steps/ share a name (file stem or package directory; ``__init__``
  and ``__main__`` aside): a traceback, a log line or a grep names one file;
* layers (every import, module level or inside a function): ``pipeline_steps`` never imports ``operators``, ``dags``
  or Airflow; ``operators`` never imports ``dags``; library code never imports a step (``pipeline_steps.steps``) and
  no step imports another step; each ``pipeline_steps`` package imports only the packages its README row names;
  the shared modules ``pipeline_steps/*.py`` import only the standard library and each other; DAG files import no
  heavy library at module level;
* no import cycle among the modules, counting module-level imports (not those inside functions or under
  ``TYPE_CHECKING``): ``from a.b import c`` needs ``a.b`` (and ``a.b.c`` when that is a module).

Each failure names the file, the line and the rule.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TREES = ("dags", "operators", "pipeline_steps")

# The README's "may import" column for the pipeline_steps packages ("shared" = the modules pipeline_steps/*.py, which
# every package may import). The steps (pipeline_steps/steps/) may import every package, but no other step.
MAY_IMPORT = {
    "data": {"store"},
    "planning": {"training", "data", "store"},
    "training": {"data", "store", "tools", "rewards", "planning"},
    "local": {"training", "data", "evaluation", "sandbox", "tools", "planning"},
    "sandbox": set(),
    "tools": set(),
    "rewards": {"tools"},
    "rollouts": {"tools"},
    "evaluation": {"planning"},
    "store": set(),
    "diagnostics": {"training", "store", "tools"},
}
# Packages that may take only some modules of another: a run's locations (planning/layout.py, standard library only)
# are read by the code that writes and reads the run directory.
ONLY_MODULES: dict[tuple[str, str], set[str]] = {
    ("training", "planning"): {"pipeline_steps.planning.layout"},
    ("evaluation", "planning"): {"pipeline_steps.planning.layout"},
    ("local", "planning"): {"pipeline_steps.planning.layout"},
}
# Imports a shared module makes inside a function, with the reason (they stay out of the shared modules' import time).
SHARED_LAZY = {
    ("pipeline_steps/uris.py", "pipeline_steps.store"): "local_path checks a file:// URI with the store's parser",
    ("pipeline_steps/tracking_run.py", "mlflow"): "only the functions that talk to an MLflow server need it",
}
HEAVY = {"torch", "ray", "verl", "pandas", "datasets", "transformers", "vllm", "pyarrow"}  # not at DAG parse time
# Registries that light code reads by name: importing them (and whatever they import at module level) imports no
# heavy library. The dataset registry is read by the plan, the preprocessor registry by the dataset registry; the
# preprocessors themselves (pyarrow) register when the registry is first looked up.
LIGHT = {
    "pipeline_steps.data.registry": "the plan reads the dataset registry",
    "pipeline_steps.data.preprocessors": "the dataset registry checks a preprocessor's name",
    "pipeline_steps.training.sandbox_services": "the doctor and the pre-flight read the sandbox services",
    "pipeline_steps.training.cluster_section": "the RayJob rendering validates a preset's cluster section",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    return {module_name(p): p for tree in TREES for p in sorted((ROOT / tree).rglob("*.py"))}


class Import:
    def __init__(self, path: Path, line: int, target: str, names: tuple[str, ...], module_level: bool):
        self.path, self.line, self.target, self.names, self.module_level = path, line, target, names, module_level

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


@cache
def imports_of(path: Path) -> tuple[Import, ...]:
    """Every absolute import in the file; ``module_level``: runs when the module is imported."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found: list[Import] = []

    def visit(node, module_level: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(path, child.lineno, a.name, (), module_level) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # the project writes absolute imports only
                    found.append(Import(path, child.lineno, "." * child.level + (child.module or ""), (), False))
                else:
                    names = tuple(a.name for a in child.names)
                    found.append(Import(path, child.lineno, child.module, names, module_level))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child, False)
            else:
                visit(child, module_level)

    visit(tree, True)
    return tuple(found)


def targets(imp: Import, modules) -> list[str]:
    """The project modules an import needs: the module, and each imported name that is itself a module."""
    return [imp.target] + [f"{imp.target}.{n}" for n in imp.names if f"{imp.target}.{n}" in modules]


@cache
def package_of(module: str) -> str | None:
    """``pipeline_steps.X...`` -> X for a package X; None for a shared module ``pipeline_steps/*.py``."""
    parts = module.split(".")
    if len(parts) > 1 and (ROOT / "pipeline_steps" / parts[1]).is_dir():
        return parts[1]
    return None


def violations() -> list[str]:
    modules = sources()
    errors: list[str] = []
    for mod, path in modules.items():
        rel = str(path.relative_to(ROOT))
        top = mod.split(".")[0]
        is_step = mod.startswith("pipeline_steps.steps.")
        pkg = package_of(mod) if top == "pipeline_steps" else None
        shared = top == "pipeline_steps" and pkg is None
        for imp in imports_of(path):
            t = imp.target
            if t.startswith("."):
                errors.append(f"{imp.where()}: relative import {t!r} [absolute imports only]")
                continue
            t_top = t.split(".")[0]
            if t_top == "dags" and top != "dags":
                errors.append(f"{imp.where()}: imports {t} [nothing imports a DAG file]")
            if top == "pipeline_steps" and t_top in ("operators", "dags", "airflow"):
                errors.append(f"{imp.where()}: imports {t} [pipeline_steps never imports operators, dags or Airflow]")
            if top == "dags" and imp.module_level and t_top in HEAVY:
                errors.append(f"{imp.where()}: imports {t} at module level [DAG files parse without {t_top}]")
            if top != "pipeline_steps":
                continue
            for target in targets(imp, modules):
                if target.startswith("pipeline_steps.steps.") or (target == "pipeline_steps.steps" and imp.names):
                    if is_step and target != mod:
                        errors.append(f"{imp.where()}: imports {target} [no step module imports another step]")
                    elif not is_step and mod != "pipeline_steps.cli":
                        errors.append(f"{imp.where()}: imports {target} [library code never imports a step]")
            if shared:
                if t_top == "pipeline_steps":
                    for other in sorted({package_of(x) for x in targets(imp, modules)} - {None}):
                        if (rel, f"pipeline_steps.{other}") not in SHARED_LAZY or imp.module_level:
                            errors.append(
                                f"{imp.where()}: imports pipeline_steps.{other} [shared modules pipeline_steps/*.py "
                                "import only the standard library and each other]"
                            )
                elif t_top not in sys.stdlib_module_names and ((rel, t_top) not in SHARED_LAZY or imp.module_level):
                    errors.append(
                        f"{imp.where()}: imports {t} [shared modules pipeline_steps/*.py import only the standard "
                        "library and each other]"
                    )
                continue
            if pkg and pkg != "steps" and t_top == "pipeline_steps":
                allowed = MAY_IMPORT.get(pkg, set())
                for other in sorted({package_of(x) for x in targets(imp, modules)} - {None, pkg, "steps"}):
                    only = ONLY_MODULES.get((pkg, other))
                    if other not in allowed:
                        errors.append(
                            f"{imp.where()}: imports {t} [pipeline_steps/{pkg}/ may import "
                            f"{', '.join(sorted(allowed)) or 'no other package'} and the shared modules "
                            "(README, Layout)]"
                        )
                    elif only and not only & set(targets(imp, modules)):
                        errors.append(
                            f"{imp.where()}: imports {t} [pipeline_steps/{pkg}/ may take only "
                            f"{', '.join(sorted(only))} from pipeline_steps/{other}/ (README, Layout)]"
                        )
    return errors


def test_no_two_modules_share_a_name():
    seen: dict[str, list[str]] = defaultdict(list)
    for tree in TREES:
        for p in sorted((ROOT / tree).rglob("*.py")):
            rel = str(p.relative_to(ROOT))
            if p.name == "__init__.py":
                seen[p.parent.name].append(rel)  # the package's own name
            elif p.name != "__main__.py":
                seen[p.stem].append(rel)
    clashes = [f"{' and '.join(p)}: same name {name!r} [no two modules share a name]" for name, p in seen.items()]
    clashes = [c for c, paths in zip(clashes, seen.values()) if len(paths) > 1]
    assert not clashes, "\n".join(clashes)


def test_layers():
    packages = {p.parent.name for p in (ROOT / "pipeline_steps").glob("*/__init__.py")} - {"steps"}
    errors = [
        f"pipeline_steps/{p}/: no 'may import' entry [every package has a README Layout row]"
        for p in sorted(packages - set(MAY_IMPORT))
    ]
    errors += violations()
    assert not errors, "\n".join(errors)


def test_no_import_cycle_at_module_level():
    modules = sources()
    graph: dict[str, list[tuple[str, str]]] = {}
    for mod, path in modules.items():
        edges = []
        for imp in imports_of(path):
            if imp.module_level:
                edges += [(t, imp.where()) for t in targets(imp, modules) if t in modules and t != mod]
        graph[mod] = edges
    cycles: list[str] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []
    wheres: list[str] = []  # wheres[i]: the line where stack[i] imports stack[i + 1]

    def walk(mod: str):
        state[mod] = 1
        stack.append(mod)
        for target, where in graph[mod]:
            if state.get(target) == 1:
                i = stack.index(target)
                ring = [f"{m} ({w})" for m, w in zip(stack[i:], wheres[i:] + [where])]
                cycles.append(" -> ".join(ring + [target]) + " [no import cycle among module-level imports]")
            elif target not in state:
                wheres.append(where)
                walk(target)
                wheres.pop()
        stack.pop()
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            walk(mod)
    assert not cycles, "\n".join(cycles)


def test_registries_import_no_heavy_library():
    """Each LIGHT module, and every project module it imports at module level, imports nothing of HEAVY."""
    modules = sources()
    errors = []
    for light, why in LIGHT.items():
        assert light in modules, f"{light}: no such module [LIGHT names a module]"
        seen, todo = set(), [light]
        while todo:
            mod = todo.pop()
            if mod in seen:
                continue
            seen.add(mod)
            for imp in imports_of(modules[mod]):
                if not imp.module_level:
                    continue
                if imp.target.split(".")[0] in HEAVY:
                    errors.append(f"{imp.where()}: imports {imp.target} at module level [{light}: {why}]")
                todo += [t for t in targets(imp, modules) if t in modules]
    assert not errors, "\n".join(errors)
