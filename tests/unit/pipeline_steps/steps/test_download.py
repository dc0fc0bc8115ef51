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


@pytest.mark.slow  # five datasets through three steps as subprocesses (~30 s of CPU)
@pytest.mark.parametrize("kind", ["file", "oss"])
def test_every_builtin_dataset_is_handed_from_step_to_step_through_the_store_alone(
    kind, offline_hub, tmp_path, request
):
    """Tasks share nothing but the store (issue 45): each step runs as a user runs it, with a work directory of its
    own that the next step never sees; the snapshot and the preprocessed output reach the next step through the
    store only (a ``file://`` store, whose versions carry the store's bookkeeping files beside the data, and the OSS
    stand-in). Before, preprocess read the snapshot from download's work directory; dapo_math's nested data directory
    and aime2024's lone parquet file each broke a first attempt at reading a snapshot in place."""
    env = {}
    if kind == "file":
        store = f"file://{tmp_path / 'store'}"
    else:
        env = request.getfixturevalue("oss_server").env()
        store = f"oss://test-bucket/{tmp_path.name}"
    for name in ("gsm8k", "dapo_math", "geometry3k", "aime2024", "arithmetic"):
        work = [tmp_path / name / f"task{i}" for i in range(3)]  # a fresh disk per task
        rc, down, err = run_step(
            "download",
            "--dataset",
            name,
            "--dest",
            work[0],
            "--store-dest",
            f"{store}/snapshots",
            env=env,
            cwd=tmp_path,
        )
        assert rc == 0, err
        assert down["path"] == down["snapshot_uri"] == f"{store}/snapshots/{name}/{down['commit']}"
        out = f"{store}/cache/processed/{name}/{down['commit']}/default"
        rc, pre, err = run_step(
            "preprocess",
            "--dataset",
            name,
            "--input",
            down["path"],
            "--output",
            out,
            env={**env, "PIPELINE_HOME": str(work[1])},
            cwd=tmp_path,
        )
        assert rc == 0, f"{name}: {err}"
        assert pre["output"] == out and pre["rows_out"] > 0 and all(u.startswith(out) for u in pre["splits"].values())
        dest = f"{store}/datasets/{name}/{down['commit']}/{pre['content_hash'][:16]}"
        rc, up, err = run_step(
            "upload", "--src", pre["output"], "--dest", dest, env={**env, "PIPELINE_HOME": str(work[2])}, cwd=tmp_path
        )
        assert rc == 0, f"{name}: {err}"
        assert up["files"] >= 2  # stats.json and at least one split
    # an upstream output that is not in the store: transient (exit 1, retried), not bad input
    rc, _, err = run_step(
        "upload",
        "--src",
        f"{store}/cache/processed/nothing/here",
        "--dest",
        f"{store}/datasets/x/y",
        env={**env, "PIPELINE_HOME": str(tmp_path / "empty")},
        cwd=tmp_path,
    )
    assert rc == 1 and "upstream task's output is not in the store" in err, err
