"""Download step against a Hugging Face cache built from the shipped fixtures, with the real snapshot_download
running offline (HF_HUB_OFFLINE=1): no machine here reaches the Hub."""

import json

import pytest

from pipeline_steps import cli
from tests.helpers.step_cli import run_step


def step(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, json.loads(out.out.strip().splitlines()[-1]), out.err


def test_downloads_every_builtin_dataset_at_main(offline_hub, tmp_path, capsys):
    for name, repo in [
        ("gsm8k", "openai/gsm8k"),
        ("dapo_math", "BytedTsinghua-SIA/DAPO-Math-17k"),
        ("geometry3k", "hiyouga/geometry3k"),
        ("aime2024", "Maxwell-Jia/AIME_2024"),
        ("arithmetic", "pipeline-local/arithmetic"),  # generated into the cache (pipeline_steps/local/synthetic.py)
    ]:
        rc, s, _ = step(capsys, "download", "--dataset", name, "--dest", tmp_path)
        assert rc == 0, s
        newest = offline_hub["index"][repo][-1]["commit"]
        assert s["commit"] == newest and s["repo_id"] == repo
        assert (tmp_path / name / newest).is_dir()
        assert any(f.endswith(".parquet") for f in s["files"])


def test_gsm8k_keeps_only_the_main_config(offline_hub, tmp_path, capsys):
    rc, s, _ = step(capsys, "download", "--dataset", "gsm8k", "--dest", tmp_path)
    assert rc == 0 and all(not f.startswith("socratic/") for f in s["files"]), s["files"]


def test_pinned_label_and_commit_resolve_to_the_same_snapshot(offline_hub, tmp_path, capsys):
    v1 = offline_hub["index"]["Maxwell-Jia/AIME_2024"][0]["commit"]
    _, by_label, _ = step(capsys, "download", "--dataset", "aime2024", "--revision", "v1", "--dest", tmp_path)
    _, by_commit, _ = step(capsys, "download", "--dataset", "aime2024", "--revision", v1, "--dest", tmp_path)
    assert by_label["commit"] == by_commit["commit"] == v1


def test_missing_revision_is_one_line_exit_2(offline_hub, tmp_path):
    rc, s, err = run_step("download", "--dataset", "gsm8k", "--revision", "0" * 40, "--dest", tmp_path)
    assert rc == 2 and not s["ok"]
    assert len(err.strip().splitlines()) == 1 and "revision" in err and "Traceback" not in err
    assert not (tmp_path / "gsm8k").exists()


def test_unknown_dataset_and_user_registry(offline_hub, tmp_path, capsys):
    rc, s, _ = step(capsys, "download", "--dataset", "nope", "--dest", tmp_path)
    assert rc == 2 and "not a known dataset" in s["error"]
    reg = tmp_path / "datasets.yaml"
    reg.write_text(
        "gsm8k_v1:\n  repo_id: openai/gsm8k\n  preprocessor: gsm8k\n  config: main\n  allow_patterns: ['main/*']\n"
    )
    rc, s, _ = step(
        capsys, "download", "--dataset", "gsm8k_v1", "--revision", "v1", "--registry", reg, "--dest", tmp_path
    )
    assert rc == 0 and s["commit"] == offline_hub["index"]["openai/gsm8k"][0]["commit"]
    reg.write_text("bad:\n  repo_id: x/y\n  preprocessor: nonexistent\n")
    rc, s, _ = step(capsys, "download", "--dataset", "bad", "--registry", reg, "--dest", tmp_path)
    assert rc == 2 and "preprocessor" in s["error"]


def test_token_is_never_logged(offline_hub, tmp_path):
    secret = "hf_SECRETtoken1234567890"
    rc, s, err = run_step(
        "download", "--dataset", "gsm8k", "--dest", tmp_path, env={"HF_TOKEN": secret, "PIPELINE_LOG_LEVEL": "DEBUG"}
    )
    assert rc == 0 and secret not in err and secret not in json.dumps(s)


def test_the_connections_token_is_sent_to_the_hub_and_never_logged(tmp_path, monkeypatch, capfd):
    """The token from the ``huggingface_default`` Airflow connection reaches the Hub (a local stand-in that records
    each request's Authorization header and answers 503, since the real Hub is unreachable here), and appears
    neither in the task's log nor in the step's output, on the failure path where URLs and errors are printed."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from operators.step import PipelineStepOperator

    secret = "hf_SECRETfromTheConnection42"
    seen: list[str] = []

    class Hub(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            seen.append(self.headers.get("Authorization") or "")
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AIRFLOW_CONN_HUGGINGFACE_DEFAULT", json.dumps({"conn_type": "generic", "password": secret}))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    monkeypatch.setenv("PIPELINE_LOG_LEVEL", "DEBUG")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    op = PipelineStepOperator(
        task_id="download",
        step="download",
        request={"args": ["--dataset", "gsm8k", "--revision", "main", "--dest", str(tmp_path / "d")]},
    )
    try:
        with pytest.raises(Exception) as failed:
            op.execute({})
    finally:
        server.shutdown()
    assert f"Bearer {secret}" in seen  # sent: the test is not vacuous
    log = "".join(capfd.readouterr())  # the task log, as the operator wrote it
    assert "running: python -m pipeline_steps download" in log and "503 Service Unavailable" in log  # read, not empty
    assert secret not in log and secret not in str(failed.value)
