"""The suite's layout rule (tests/README.md): no module under tests/ imports a test module (a ``test_*`` module in
any folder: ``tests.unit.dags.test_dag``) or ``tests.conftest``, at module level or inside a function. Shared
builders, constants and fixtures live in tests/helpers/; a test module imports from there, and uses the shared fixtures
(registered by ``pytest_plugins`` in tests/conftest.py) by name. Importing a test module would run its module-level
code and collect nothing new, and a fixture imported from one is a second copy of it."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]


def _module_of(path: Path, root: Path) -> str:
    """``tests/helpers/step_cli.py`` -> ``tests.helpers.step_cli`` (a package's ``__init__`` names the package)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(path: Path, root: Path, node: ast.AST) -> list[str]:
    """The absolute module names an import statement brings in (relative imports resolved against ``path``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = _module_of(path, root).split(".")
        if path.name != "__init__.py":
            package.pop()  # a module's package
        package = package[: len(package) - (node.level - 1)] if node.level > 1 else package
        base = ".".join([*package, base] if base else package)
    if _forbidden(base):
        return [base]
    # ``from tests import test_x`` and ``from . import conftest`` name the module in the imported names
    return [f"{base}.{alias.name}" for alias in node.names]


def _forbidden(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[0] == "tests" and any(p.startswith("test_") or p == "conftest" for p in parts[1:])


def violations(root: Path = TESTS) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):  # every import, module level or inside a function or class
            bad = sorted({name for name in _imported(path, root, node) if _forbidden(name)})
            if bad:
                rel = path.relative_to(root.parent)
                found.append(f"{rel}:{node.lineno}: imports {', '.join(bad)}")
    return found


def test_no_test_module_imports_another_test_module_or_conftest():
    found = violations()
    assert not found, (
        "test modules must not import other test modules or conftest.py; move what they share into tests/helpers/ "
        "(a fixture: also into conftest.py's pytest_plugins):\n" + "\n".join(found)
    )


def test_the_check_sees_every_form_of_import(tmp_path):
    """The forms the check must catch, written into a scratch tree laid out like tests/."""
    pkg = tmp_path / "tests"
    (pkg / "helpers").mkdir(parents=True)
    (pkg / "helpers" / "ok.py").write_text("from tests.helpers import steps\nimport tests.helpers.render\n")
    (pkg / "test_a.py").write_text(
        "from tests.test_b import x\n"
        "import tests.conftest\n"
        "def f():\n"
        "    from tests import test_c\n"
        "    from .conftest import run_step\n"
        "    from . import test_d\n"
    )
    (pkg / "helpers" / "deep.py").write_text("from ..test_e import y\n")
    (pkg / "unit" / "dags").mkdir(parents=True)  # test modules in the folders under tests/ too
    (pkg / "unit" / "dags" / "test_f.py").write_text(
        "from tests.e2e.test_g import z\n"
        "from ...e2e import test_h\n"
        "from .test_i import w\n"
        "from tests.unit import dags\n"
    )
    found = violations(pkg)
    assert found == [
        "tests/helpers/deep.py:1: imports tests.test_e",
        "tests/test_a.py:1: imports tests.test_b",
        "tests/test_a.py:2: imports tests.conftest",
        "tests/test_a.py:4: imports tests.test_c",
        "tests/test_a.py:5: imports tests.conftest",
        "tests/test_a.py:6: imports tests.test_d",
        "tests/unit/dags/test_f.py:1: imports tests.e2e.test_g",
        "tests/unit/dags/test_f.py:2: imports tests.e2e.test_h",
        "tests/unit/dags/test_f.py:3: imports tests.unit.dags.test_i",
    ], found
