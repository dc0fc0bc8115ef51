"""A user's own JSONL dataset (guide 002), named by URI in the trigger form: a store file (``file://``, ``oss://``) or a
Hub dataset file (``hf://datasets/...``, the offline cache's ``pipeline-local/chat-jsonl``), through plan ->
download -> preprocess with the real steps (CLI, real ``hf_hub_download``, the real store layer and the OSS test
server), and bad input refused in one line."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone

import pyarrow.parquet as pq
import pytest

from pipeline_steps.errors import UserError
from pipeline_steps.planning import plan, run_requests
from tests.helpers.step_cli import assert_refused, run_step

HUB = "hf://datasets/pipeline-local/chat-jsonl"
CHAT = "pipeline-local/chat-jsonl"


def rows_file(path, n=6, offset=0):
    path.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [{"role": "user", "content": f"What is {i} + 1? Reply with Answer: N."}],
                    "rollout_extra": {"solution": str(i + 1), "id": i},
                }
            )
            + "\n"
            for i in range(offset, offset + n)
        )
    )
    return path


def download(*args, env=None):
    code, summary, err = run_step("download", *args, env=env)
    assert code == 0, err[-3000:]
    return summary


def test_hub_file_is_read_at_a_commit_and_preprocessed_with_its_validation_split(offline_hub, tmp_path):
    v1, v2 = (r["commit"] for r in offline_hub["index"][CHAT])
    pinned = download(
        "--train-file",
        f"{HUB}@v1/data/train.jsonl",
        "--validation-file",
        f"{HUB}@v1/data/validation.jsonl",
        "--dest",
        tmp_path / "snap",
    )
    assert pinned["dataset"] == "chat-jsonl" and pinned["commit"] == v1 and pinned["revision_kind"] == "hub-commit"
    assert pinned["path"] == str(tmp_path / "snap" / "chat-jsonl" / v1)
    assert pinned["files"] == ["train.jsonl", "validation.jsonl"]
    latest = download("--train-file", f"{HUB}/data/train.jsonl", "--dest", tmp_path / "snap")
    assert latest["commit"] == v2  # unpinned: main

    code, pp, err = run_step(
        "preprocess",
        "--dataset",
        "chat-jsonl",
        "--train-file",
        f"{HUB}@v1/data/train.jsonl",
        "--validation-file",
        f"{HUB}@v1/data/validation.jsonl",
        "--input",
        pinned["path"],
        "--output",
        tmp_path / "pp",
    )
    assert code == 0, err
    assert sorted(pp["splits"]) == ["train", "validation"] and pp["commit"] == v1
    train = pq.read_table(pp["splits"]["train"]).to_pylist()
    val = pq.read_table(pp["splits"]["validation"]).to_pylist()
    assert len(train) == 40 and len(val) == 10  # the v1 revision's files
    assert train[0]["extra_info"]["rollout_extra"]["solution"] == train[0]["reward_model"]["ground_truth"]
    assert isinstance(train[0]["extra_info"]["rollout_extra"]["symbols"], list)
    assert val[0]["extra_info"]["split"] == "validation"


def test_store_file_version_is_its_content(tmp_path):
    src = rows_file(tmp_path / "my_math.jsonl")
    first = download("--train-file", f"file://{src}", "--dest", tmp_path / "snap")
    digest = hashlib.sha256(b"train\0" + hashlib.sha256(src.read_bytes()).hexdigest().encode() + b"\0").hexdigest()
    assert first["dataset"] == "my_math" and first["revision_kind"] == "content-sha256"
    assert (
        first["commit"] == digest[:16]
        and first["sources"]["train"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    )
    again = download("--train-file", f"file://{src}", "--dest", tmp_path / "snap")
    assert again["commit"] == first["commit"]  # same bytes, same version
    rows_file(src, n=7)
    changed = download("--train-file", f"file://{src}", "--dest", tmp_path / "snap")
    assert changed["commit"] != first["commit"]  # changed bytes, a new version
    assert sorted(p.name for p in (tmp_path / "snap" / "my_math").iterdir()) == sorted(
        [first["commit"], changed["commit"]]
    )  # no staging directory left behind


@pytest.mark.parametrize("scheme", ["oss", "gs"])
def test_cloud_store_file_is_read_through_the_store_layer(scheme, request, tmp_path, monkeypatch):
    """The README's `oss://` and `gs://` JSONL files, each through its real SDK against its local test server."""
    from pipeline_steps.store import open_store

    server = request.getfixturevalue("oss_server" if scheme == "oss" else "gcs_server")
    env = {**server.env(), "PIPELINE_CACHE_DIR": str(tmp_path / "cache")}
    if scheme == "oss":
        env["OSS_PATH_STYLE"] = "true"
    uri = f"{scheme}://test-bucket/user-data/chat.jsonl"
    data = rows_file(tmp_path / "rows.jsonl").read_bytes()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    open_store(uri).write_bytes(uri, data)
    got = download("--train-file", uri, "--dest", tmp_path / "snap", env=env)
    assert (
        got["dataset"] == "chat" and (tmp_path / "snap" / "chat" / got["commit"] / "train.jsonl").read_bytes() == data
    )
    missing = f"{scheme}://test-bucket/user-data/none.jsonl"
    code, _, err = run_step("download", "--train-file", missing, "--dest", tmp_path / "x", env=env)
    assert_refused(code, err, f"--train-file {missing}: no such object")


BAD = {
    "ftp": ("ftp://host/rows.jsonl", "scheme 'ftp' is not supported"),
    "not jsonl": ("file:///data/rows.csv", "not a .jsonl file"),
    "missing store file": ("file:///nonexistent/rows.jsonl", "no such object in the store"),
    "no such hub repo": ("hf://datasets/nobody/no-such-repo/train.jsonl", "dataset nobody/no-such-repo is not in"),
    "no such hub file": (f"{HUB}/data/test.jsonl", "file 'data/test.jsonl'"),
    "model repo": ("hf://nobody/model/train.jsonl", "must be a dataset file"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_file_is_one_line_exit_2_and_no_output(case, offline_hub, tmp_path):
    uri, needle = BAD[case]
    code, summary, err = run_step("download", "--train-file", uri, "--dest", tmp_path / "out")
    assert_refused(code, err, "--train-file", needle)
    assert summary["ok"] is False
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def at(day: str) -> datetime:
    return datetime.fromisoformat(day).replace(tzinfo=timezone.utc)


def test_plan_takes_the_form_files_as_a_train_set_with_validation(offline_hub, monkeypatch, tmp_path):
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    monkeypatch.delenv("PIPELINE_STORE_URI", raising=False)
    v1 = offline_hub["index"][CHAT][0]["commit"]
    run = plan.plan(
        {
            "experiment": "local_tiny",
            "train_jsonl": f"{HUB}/data/train.jsonl",
            "validation_jsonl": f"{HUB}/data/validation.jsonl",
        },
        at("2026-09-15"),
        "scheduled__2026-09-15",
        "d",
    )
    items = {d["dataset"]: d for d in run["datasets"]}
    assert set(items) == {"chat-jsonl", "aime2024"}  # the form's file instead of the preset's gsm8k
    chat = items["chat-jsonl"]
    assert chat["role"] == "train" and chat["revision"] == v1 and chat["resolved"]["commit"] == v1
    # unpinned Hub files are pinned to the newest commit at the logical date, as registry datasets are
    assert chat["files"] == {"train": f"{HUB}@{v1}/data/train.jsonl", "validation": f"{HUB}@{v1}/data/validation.jsonl"}
    request = run_requests.download_kwargs(chat)
    assert request["store_uri"] == run["store"]  # the snapshot is committed to the run's store (issue 45)
    argv = request["request"]["args"]
    assert argv[argv.index("--train-file") + 1] == f"{HUB}@{v1}/data/train.jsonl" and "--revision" not in argv

    # with the form's datasets too, both are trained on; a store file is read with the store's connection
    store_file = "oss://team-bucket/data/my_math.jsonl"
    run = plan.plan({"datasets": ["gsm8k"], "train_jsonl": store_file}, None, "manual", "d")
    items = {d["dataset"]: d for d in run["datasets"]}
    assert items["gsm8k"]["role"] == items["my_math"]["role"] == "train"
    assert (
        items["my_math"]["revision"] == "content"
        and run_requests.download_kwargs(items["my_math"])["store_uri"] == store_file
    )

    # a file named like a registry dataset does not become a version of it
    run = plan.plan({"train_jsonl": "file:///data/gsm8k.jsonl"}, None, "manual", "d")
    assert "gsm8k-jsonl" in {d["dataset"] for d in run["datasets"]}


def test_collect_uses_the_validation_file_as_validation_data(offline_hub, monkeypatch, tmp_path):
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    files = {"train_jsonl": "file:///a.jsonl", "validation_jsonl": "file:///b.jsonl"}
    run = plan.plan({"experiment": "local_tiny", "store_uri": "file:///s", **files}, None, "r", "d")
    (item,) = [d for d in run["datasets"] if d["role"] == "train"]
    name = item["dataset"]

    def done(splits, files=None):
        d = {
            **{k: v for k, v in item.items() if k != "files"},
            "download": {"commit": "a" * 16, "repo_id": "", "sources": {"train": {"uri": "u"}}},
            "preprocess": {"splits": {s: f"/p/{s}.parquet" for s in splits}, "content_hash": "c" * 64},
            "upload": {"uri": f"file:///s/datasets/{name}/{'a' * 16}/{'c' * 16}"},
        }
        if files:
            d["files"] = files
        return d

    staged = {"model": "tiny", "stage_model": {"uri": "file:///s/models/tiny/local-v2"}}
    mine = done(["train", "validation"], {"train": "file:///a.jsonl", "validation": "file:///b.jsonl"})
    inputs = run_requests.collect([mine], staged, run)
    base = f"file:///s/datasets/{name}/{'a' * 16}/{'c' * 16}"
    assert inputs["train_files"] == [f"{base}/train.parquet"] and inputs["val_files"] == [f"{base}/validation.parquet"]
    assert inputs["lineage"]["datasets"][0]["files"] == {"train": {"uri": "u"}}
    no_val = done(["train"], {"train": "file:///a.jsonl"})
    assert run_requests.collect([no_val], staged, run)["val_files"] == []


PLAN_BAD = [
    ({"train_jsonl": "ftp://host/x.jsonl"}, "train_jsonl 'ftp://host/x.jsonl': scheme 'ftp' is not supported"),
    ({"train_jsonl": "file:///data/x.txt"}, "not a .jsonl file"),
    ({"train_jsonl": "file://relative/x.jsonl"}, "train_jsonl: store URI"),
    ({"train_jsonl": "hf://datasets/org/x.jsonl"}, "train_jsonl"),
    ({"validation_jsonl": "file:///data/v.jsonl"}, "set train_jsonl too"),
    ({"train_jsonl": "file:///d/x.jsonl", "validation_jsonl": "gs://b/v.csv"}, "validation_jsonl 'gs://b/v.csv'"),
    ({"train_jsonl": "file:///d/x.jsonl", "dataset_revisions": {"x": "v1"}}, "pin a Hub file's revision in its URI"),
    ({"train_jsonl": ["file:///d/x.jsonl"]}, "train_jsonl: not a string"),
]


@pytest.mark.parametrize("params,needle", PLAN_BAD, ids=[str(i) for i in range(len(PLAN_BAD))])
def test_plan_refuses_bad_files_in_one_line(params, needle, offline_hub, monkeypatch, tmp_path):
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    with pytest.raises(UserError) as e:
        plan.plan(params, None, "r", "d")
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_plan_names_a_missing_hub_repo_when_resolving_as_of_a_date(offline_hub):
    with pytest.raises(UserError, match="nobody/none is not in the offline Hub cache"):
        plan.plan({"train_jsonl": "hf://datasets/nobody/none/train.jsonl"}, at("2026-10-01"), "r", "d")


def test_registry_entry_may_name_jsonl_files(offline_hub, tmp_path):
    reg = tmp_path / "datasets.yaml"
    reg.write_text(
        f"team_chat:\n  preprocessor: jsonl\n  data_source: custom_chat\n  train_file: {HUB}@v1/data/train.jsonl\n"
    )
    got = download("--dataset", "team_chat", "--registry", reg, "--dest", tmp_path / "snap")
    assert got["dataset"] == "team_chat" and got["commit"] == offline_hub["index"][CHAT][0]["commit"]
    code, pp, err = run_step(
        "preprocess", "--dataset", "team_chat", "--registry", reg, "--input", got["path"], "--output", tmp_path / "pp"
    )
    assert code == 0, err
    assert pq.read_table(pp["splits"]["train"]).column("data_source").to_pylist()[0] == "custom_chat"
    reg.write_text("bad:\n  preprocessor: gsm8k\n  train_file: file:///x.jsonl\n")
    code, _, err = run_step("download", "--dataset", "bad", "--registry", reg, "--dest", tmp_path / "o")
    assert_refused(code, err, "names JSONL files; set preprocessor")
