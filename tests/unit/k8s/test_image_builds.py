"""The images build reproducibly (read from the Dockerfiles; no Docker daemon runs here): every base by digest, the
build context small, the training image's extras locked against its base's own versions."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCKER = ROOT / "k8s" / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def pins() -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements.txt").read_text(), re.M))


def logical_lines(path: Path) -> list[str]:
    """Dockerfile instructions, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        if not current and line.lstrip().startswith("#"):
            continue
        current += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            out.append(current.strip())
            current = ""
    return [line for line in out if line]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_base_is_pinned_by_digest(dockerfile):
    """A FROM names an image by digest, or an ARG the build refuses unless it carries one: never a tag alone."""
    lines = logical_lines(dockerfile)
    froms = [line.split()[1] for line in lines if line.startswith("FROM ")]
    assert froms, dockerfile
    for image in froms:
        if m := re.fullmatch(r"\$\{(\w+)\}", image):
            arg = m.group(1)
            assert f"ARG {arg}" in lines, f"{dockerfile.name}: {arg} is not an ARG"
            checks = [line for line in lines if line.startswith("RUN ") and f'case "${{{arg}}}" in' in line]
            assert checks and "@sha256:*) ;;" in checks[0] and "exit 1" in checks[0], (
                f"{dockerfile.name}: the build must refuse {arg} without a digest"
            )
        else:
            assert DIGEST.search(image), f"{dockerfile.name}: FROM {image} is not pinned by digest"


def test_the_airflow_base_is_the_locked_airflow():
    text = (DOCKER / "Dockerfile.airflow").read_text()
    version = pins()["apache-airflow"]
    assert f"in apache/airflow:{version}-python3.11@sha256:*) ;;" in text
    assert f"airflow.__version__ == '{version}'" in text and "sys.version_info[:2] == (3, 11)" in text
    # no digest is invented: the one real digest is resolved by the user (docs/cluster.md says how)
    assert not re.search(r"sha256:[0-9a-f]{64}", text)
    guide = (ROOT / "docs" / "cluster.md").read_text()
    assert f"--build-arg AIRFLOW_IMAGE=apache/airflow:{version}-python3.11@sha256:" in guide


def test_the_airflow_image_has_the_remote_logging_providers():
    """oss:// remote logging needs the Alibaba provider (pinned here, it resolves against the lock); gs:// the Google
    provider, which the official base image ships. Airflow maps each scheme to its provider's log IO."""
    import airflow.config_templates.airflow_local_settings as local_settings

    text = (DOCKER / "Dockerfile.airflow").read_text()
    assert re.search(r"pip install --no-cache-dir apache-airflow-providers-alibaba==\d+\.\d+\.\d+ -c ", text)
    source = Path(local_settings.__file__).read_text()
    for scheme, module in (
        ("oss://", "airflow.providers.alibaba.cloud.log.oss_task_handler"),
        ("gs://", "airflow.providers.google.cloud.log.gcs_task_handler"),
    ):
        assert f'startswith("{scheme}")' in source and module in source
        assert f"import {module}" in text or module in text  # the build imports it, so a missing one fails there


def copy_sources(dockerfile: Path) -> list[str]:
    out = []
    for line in logical_lines(dockerfile):
        if line.startswith("COPY "):
            parts = [p for p in line.split()[1:] if not p.startswith("--")]
            out += parts[:-1]
    return out


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore matching, for the plain patterns used here (no ``!`` exceptions)."""
    for pattern in patterns:
        pattern = pattern.rstrip("/")
        candidates = [pattern, pattern.removeprefix("**/")]
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        suffixes = ["/".join(parts[i:]) for i in range(len(parts))]
        for c in candidates:
            if any(fnmatch.fnmatchcase(p, c) for p in prefixes):
                return True
            if pattern.startswith("**/") and any(fnmatch.fnmatchcase(s.split("/")[0], c) for s in suffixes):
                return True
    return False


def test_dockerignore_keeps_the_context_small_and_the_sources_in():
    patterns = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip() and line[0] != "#"
    ]
    assert not any(p.startswith("!") for p in patterns)  # ignored() does not model exceptions
    for heavy in (".venv", ".git", ".airflow", ".demo", "pipeline_steps/__pycache__/x.pyc", ".pytest_cache"):
        assert ignored(heavy, patterns), f"{heavy} would be sent as build context"
    sources = [s for d in DOCKERFILES for s in copy_sources(d)]
    needed = {"pipeline_steps", "operators", "dags", "constraints.txt", "k8s/docker/requirements-train.txt"}
    assert needed <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not ignored(source, patterns), f"{source} is copied by a Dockerfile but .dockerignore leaves it out"


def test_the_training_extras_are_installed_with_the_lock_against_the_base():
    lines = logical_lines(DOCKER / "Dockerfile.train")
    run = next(line for line in lines if "requirements-train.txt -c" in line)
    assert "-c /opt/verl-grpo/train-constraints.txt" in run and "lock_against_base.py" in run
    assert "pip freeze" in run.split("lock_against_base.py")[0]  # the base's own versions, taken in the build
    assert "k8s/docker/lock_against_base.py" in copy_sources(DOCKER / "Dockerfile.train")


def _lock():
    import importlib.util

    spec = importlib.util.spec_from_file_location("lock_against_base", DOCKER / "lock_against_base.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lock_against_base_keeps_the_base_fills_from_the_lock_and_lets_our_pins_win(tmp_path):
    lock = _lock()
    freeze = ["torch==2.9.0+cu128", "numpy==2.2.6", "Pillow==11.0.0", "vllm==0.17.0", "-e git+https://x#egg=y"]
    listed = ["# header", "torch", "vllm", "pillow", "verl"]
    requirements = ["# ours", "pillow==13.0.0", "mlflow==3.17.2"]
    project_lock = ["numpy==2.3.0", "mlflow-skinny==3.17.2", "sqlalchemy==2.0.40", "mlflow==3.17.2"]
    out = lock.lock(freeze, listed, requirements, project_lock)
    assert "numpy==2.2.6" in out and "torch==2.9.0+cu128" in out  # the base's builds stay
    assert "numpy==2.3.0" not in out  # the lock never replaces a base package
    assert "mlflow-skinny==3.17.2" in out and "sqlalchemy==2.0.40" in out  # what the base lacks: the lock's
    assert not any(line.lower().startswith(("pillow", "mlflow==")) for line in out)  # our own pins win
    with pytest.raises(SystemExit, match="lacks vllm"):
        lock.lock([line for line in freeze if not line.startswith("vllm")], listed, requirements, project_lock)
    # the real files: every package the training image installs resolves to exactly one pin or our own
    real = lock.lock(
        [f"{name}==0" for name in lock.names((DOCKER / "base-image-packages.txt").read_text().splitlines())],
        (DOCKER / "base-image-packages.txt").read_text().splitlines(),
        (DOCKER / "requirements-train.txt").read_text().splitlines(),
        (ROOT / "constraints.txt").read_text().splitlines(),
    )
    names = [lock.canonical(line.split("==")[0]) for line in real]
    assert len(names) == len(set(names))
    main = tmp_path / "c.txt"
    files = {}
    for key, lines in (("freeze", freeze), ("listed", listed), ("requirements", requirements), ("lock", project_lock)):
        files[key] = tmp_path / f"{key}.txt"
        files[key].write_text("\n".join(lines))
    args = [a for key, path in files.items() for a in (f"--{key}", str(path))] + ["--out", str(main)]
    assert lock.main(args) == 0 and main.read_text().splitlines() == out
