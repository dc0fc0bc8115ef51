"""The pipeline's settings (issue 25, item 2): one module defines every ``PIPELINE_*`` variable, with one default
(the home had two: ~/.verl-grpo-pipeline and ./.demo) and one prefix (the old ``VERL_PIPELINE_*`` names still work,
with a warning); code reads them only through it; docs/settings.md lists exactly them."""

from __future__ import annotations

import ast
import logging
import re
import sys
from pathlib import Path

import pytest

from pipeline_steps import settings


def test_every_reader_of_the_home_agrees_when_it_is_unset(monkeypatch, tmp_path):
    from pipeline_steps.local import mlflow_server
    from pipeline_steps.planning import plan
    from pipeline_steps.store import mirror

    for var in ("PIPELINE_HOME", "PIPELINE_STORE_URI", "PIPELINE_MIRROR_DIR", "PIPELINE_MLFLOW_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # a relative default (./.demo) would land here
    home = Path(tmp_path) / ".verl-grpo-pipeline"
    assert plan.default_store() == f"file://{home / 'store'}"
    assert mirror.root() == home / "work" / "mirror"
    assert mlflow_server.server_dir() == home / "mlflow"
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "elsewhere"))
    assert mlflow_server.server_dir() == tmp_path / "elsewhere" / "mlflow"
    assert plan.default_store() == f"file://{tmp_path / 'elsewhere' / 'store'}"


# --- one settings module (issue 25, item 2) ------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[3]
SCANNED = ("pipeline_steps", "operators", "dags", "scripts")
OURS = re.compile(r"\b(?:VERL_)?PIPELINE_[A-Z0-9_]*[A-Z0-9]\b")  # the project's prefixes, old and new
OLD = {s.old: s.name for s in settings.SETTINGS.values() if s.old}
# names in the deployment files that are no setting: a shell variable of an example
NOT_SETTINGS = {"PIPELINE_STORE_CONNECTION": "k8s/secrets/README.md: a shell variable holding the connection JSON"}


def _sources() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))}


def _constants(trees) -> dict[str, set[str]]:
    """Every ``NAME = "..."`` and ``NAME = settings.X`` in the scanned code, by name (a reader may use either)."""
    found: dict[str, set[str]] = {k: {v} for k, v in vars(settings).items() if isinstance(v, str) and k.isupper()}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for value in _values(node.value, found):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            found.setdefault(target.id, set()).add(value)
    return found


def _values(node, constants) -> set[str]:
    """The strings an expression may stand for: a literal, a module constant, ``settings.X``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Name):
        return constants.get(node.id, set())
    if isinstance(node, ast.Attribute):
        return constants.get(node.attr, set())
    return set()


def _is_environ(node) -> bool:
    if isinstance(node, ast.IfExp):
        return _is_environ(node.body) or _is_environ(node.orelse)
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _env_reads(tree, constants):
    """(line, name) of each read of a variable: ``os.environ.get/pop/setdefault(K)``, ``os.getenv(K)``,
    ``os.environ[K]``, ``K in os.environ``, and ``<mapping>.get(K)`` of a project name on any mapping; a name is
    ours when it has our prefix or is the old name of a setting."""
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if f.attr == "getenv" or (f.attr in ("get", "pop", "setdefault") and _is_environ(f.value)):
                key = node.args[0]
            elif f.attr == "get" and not (isinstance(f.value, ast.Name) and f.value.id == "settings"):
                key = node.args[0]  # a child's env dict or a copy of os.environ: still a read of the name
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getenv" and node.args:
            key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            key = node.left if _is_environ(node.comparators[0]) else None
        for name in _values(key, constants) if key is not None else ():
            if OURS.fullmatch(name) or name in OLD:
                yield node.lineno, name


def _settings_calls(tree, constants):
    """(line, name) of each ``settings.get*(K)`` / ``settings.is_set(K)`` with a name we can resolve."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "settings"
            and (node.func.attr.startswith("get") or node.func.attr == "is_set")
            and node.args
        ):
            for name in _values(node.args[0], constants):
                yield node.lineno, name


def test_code_reads_the_pipelines_variables_only_through_settings_and_only_defined_ones():
    trees = _sources()
    constants = _constants(trees)
    direct, undefined, read = [], [], set()
    for path, tree in trees.items():
        rel = path.relative_to(ROOT).as_posix()
        if rel == "pipeline_steps/settings.py":
            continue
        direct += [f"{rel}:{line}: reads ${name} itself" for line, name in _env_reads(tree, constants)]
        for line, name in _settings_calls(tree, constants):
            read.add(name)
            if name not in settings.SETTINGS:
                undefined.append(f"{rel}:{line}: settings.get of {name!r}, which settings.py does not define")
        for node in ast.walk(tree):  # any string naming a variable of ours: help texts, docstrings, a child's env
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for name in OURS.findall(node.value):
                    if name not in settings.SETTINGS:
                        undefined.append(f"{rel}:{node.lineno}: ${name} is no setting of settings.py")
    assert not direct, "read these through pipeline_steps.settings:\n" + "\n".join(direct)
    assert not undefined, "define these in pipeline_steps/settings.py (or use the new name):\n" + "\n".join(undefined)
    assert len(read) >= 30, sorted(read)  # the scan finds the readers (38 settings are read through settings.get)


def test_every_setting_has_one_prefix_a_doc_and_no_old_name_shadows_another():
    for s in settings.SETTINGS.values():
        assert s.name.startswith("PIPELINE_") and s.doc.strip(), s
        assert s.default is not None or s.shown, f"{s.name}: say in `shown` what a reader falls back to"
    assert set(OLD).isdisjoint(settings.SETTINGS)


def _documented() -> dict[str, str]:
    """docs/settings.md's table of the pipeline's settings: name -> its row."""
    text = (ROOT / "docs" / "settings.md").read_text()
    section = text.split("## The pipeline's settings", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `([A-Z0-9_]+)` \|", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} listed twice"
            rows[m.group(1)] = line
    return rows


def test_docs_settings_lists_every_setting_and_nothing_else():
    rows = _documented()
    missing = sorted(set(settings.SETTINGS) - set(rows))
    extra = sorted(set(rows) - set(settings.SETTINGS))
    assert not missing, f"docs/settings.md does not list {missing}"
    assert not extra, f"docs/settings.md lists {extra}, which pipeline_steps/settings.py does not define"
    for name, row in rows.items():
        s = settings.SETTINGS[name]
        shown = s.shown or f"`{s.default}`"
        assert row.split("|")[2].strip() == shown, f"docs/settings.md: {name}'s default is not {shown}: {row}"
        if s.old:
            assert f"`{s.old}`" in row, f"docs/settings.md: {name} does not name its old name {s.old}"


def test_the_deployment_files_and_docs_name_only_defined_settings():
    """README, docs, k8s and the Makefile set or name only defined settings (an old name only as the alias)."""
    files = [ROOT / "README.md", ROOT / "Makefile", *(ROOT / "docs").glob("*.md")]
    files += [p for p in (ROOT / "k8s").rglob("*") if p.suffix in (".md", ".yaml", ".yml", ".json", ".env")]
    files += list((ROOT / "pipeline_steps").rglob("*.yaml"))
    stale = []
    for path in files:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for name in OURS.findall(line):
                if name in settings.SETTINGS or name in NOT_SETTINGS:
                    continue
                if name in OLD and path.name == "settings.md":
                    continue
                stale.append(
                    f"{path.relative_to(ROOT)}:{lineno}: {name}" + (f" (now {OLD[name]})" if name in OLD else "")
                )
    assert not stale, stale


def test_an_old_name_still_works_and_warns_once_naming_the_new_one(monkeypatch, caplog, tmp_path):
    from pipeline_steps.training import experiment

    monkeypatch.setattr(settings, "_warned", set())
    for s in settings.SETTINGS.values():
        monkeypatch.delenv(s.name, raising=False)
        if s.old:
            monkeypatch.delenv(s.old, raising=False)
    assert settings.get(settings.POLL_SECONDS) == "30" and not settings.is_set(settings.POLL_SECONDS)

    monkeypatch.setenv("VERL_PIPELINE_POLL_SECONDS", "7")  # read at call time: set after import
    with caplog.at_level(logging.WARNING, logger="pipeline_steps.settings"):
        assert settings.get_float(settings.POLL_SECONDS) == 7.0 and settings.is_set(settings.POLL_SECONDS)
        assert settings.get_float(settings.POLL_SECONDS) == 7.0
    warnings = [r.getMessage() for r in caplog.records if r.name == "pipeline_steps.settings"]
    assert len(warnings) == 1, warnings
    assert "VERL_PIPELINE_POLL_SECONDS" in warnings[0] and "PIPELINE_POLL_SECONDS instead" in warnings[0]

    monkeypatch.setenv("PIPELINE_POLL_SECONDS", "3")  # the new name wins
    assert settings.get_float(settings.POLL_SECONDS) == 3.0

    (tmp_path / "mine.yaml").write_text("x: 1\n")  # a reader of the setting, through its old name
    monkeypatch.setenv("VERL_PIPELINE_PRESETS_DIR", str(tmp_path))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipeline_steps.settings"):
        assert experiment.preset_dirs()[0] == tmp_path
    assert any("PIPELINE_PRESETS_DIR instead" in r.getMessage() for r in caplog.records)

    with pytest.raises(KeyError):
        settings.get("PIPELINE_NO_SUCH_SETTING")


def test_settings_is_import_light():
    """DAG files import it: the standard library only."""
    tree = ast.parse((ROOT / "pipeline_steps" / "settings.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
