"""The synthetic ``arithmetic`` dataset as the pipeline sees it: a Hub repository in the offline cache, downloaded by
the real ``snapshot_download``, converted by the registry's ``gsm8k`` preprocessor, scored by verl's GSM8K reward."""

from __future__ import annotations

from collections import Counter

import pyarrow.parquet as pq
import pytest

from tests.helpers.step_cli import run_step

pytestmark = pytest.mark.slow  # about 17 s of CPU: the synthetic datasets built and scored

REPO = "pipeline-local/arithmetic"


@pytest.fixture(scope="module")
def processed(hub_cache, tmp_path_factory):
    env = {"HF_HUB_CACHE": str(hub_cache["path"]), "HF_HUB_OFFLINE": "1"}
    root = tmp_path_factory.mktemp("arithmetic")
    out = {}
    for label in ("v1", "v2"):
        _, dl, _ = run_step(
            "download", "--dataset", "arithmetic", "--revision", label, "--dest", root / "snap", env=env, check=0
        )
        _, pp, _ = run_step(
            "preprocess", "--dataset", "arithmetic", "--input", dl["path"], "--output", root / label, env=env, check=0
        )
        out[label] = {"download": dl, "preprocess": pp, "dir": root / label}
    return out


def _rows(d, split):
    return pq.read_table(d["dir"] / f"{split}.parquet").to_pylist()


def test_dataset_repository_layout_and_dated_revisions(hub_cache, processed):
    from pipeline_steps.local import offline_hub, synthetic

    index = hub_cache["index"][REPO]
    assert [r["label"] for r in index] == ["v1", "v2"] and index[0]["date"] < index[1]["date"]
    v1, v2 = processed["v1"]["download"], processed["v2"]["download"]
    assert (v1["commit"], v2["commit"]) == (index[0]["commit"], index[1]["commit"])
    want = {"README.md", "data/train-00000-of-00001.parquet", "data/test-00000-of-00001.parquet"}
    assert want <= set(v2["files"]), v2["files"]  # (with the download step's own marker file)
    # generated, yet deterministic: a second cache gets the same commits
    again = offline_hub._write_repo(hub_cache["path"] / "again", REPO, synthetic.revisions())
    assert [r["commit"] for r in again] == [r["commit"] for r in index]


def test_splits_are_disjoint_and_every_answer_scores_with_verls_gsm8k_reward(processed):
    from verl.utils.reward_score import default_compute_score

    v1, v2 = processed["v1"], processed["v2"]
    assert (len(_rows(v1, "train")), len(_rows(v2, "train"))) == (600, 900)
    test = _rows(v2, "test")
    assert len(test) == 100 and _rows(v1, "test") == test  # the held-out split is the same in every revision
    questions = {r["extra_info"]["question"] for r in test}
    for label in ("v1", "v2"):
        assert not questions & {r["extra_info"]["question"] for r in _rows(processed[label], "train")}
    # the answers are uniform (ten per digit): the best constant answer scores 10% on the held-out split, so a gain
    # over it is a skill that depends on the question, not the prior
    assert sorted(Counter(r["reward_model"]["ground_truth"] for r in test).values()) == [10] * 10
    train_counts = Counter(r["reward_model"]["ground_truth"] for r in _rows(v2, "train"))
    assert len(train_counts) == 10 and max(train_counts.values()) / 900 < 0.15, train_counts
    for r in test[:20] + _rows(v2, "train")[:20]:
        assert r["data_source"] == "openai/gsm8k"
        gt = r["reward_model"]["ground_truth"]
        assert default_compute_score(r["data_source"], f"#### {gt}", gt) == 1.0
        assert default_compute_score(r["data_source"], f"#### {(int(gt) + 1) % 10}", gt) == 0.0
