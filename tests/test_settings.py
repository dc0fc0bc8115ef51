"""One default home for the pipeline's local state, whoever asks (it had two: ~/.verl-grpo-pipeline and ./.demo)."""

from __future__ import annotations

from pathlib import Path


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
