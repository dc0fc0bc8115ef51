"""User reward functions (guide 002): the shipped ReTool-style example, the pre-flight that imports and calls a
reward on a sample row, and JSONL ``rollout_extra`` reaching the reward as a dict."""

from __future__ import annotations

import json

import pytest

from pipeline_steps.errors import UserError


def _cfg(path, name="compute_score"):
    from omegaconf import OmegaConf

    return OmegaConf.create({"reward": {"custom_reward_function": {"path": str(path), "name": name}}})


def test_retool_reward_scores_boxed_answer_and_tool_use():
    from pipeline_steps.rewards.retool import compute_group_score, compute_score

    right_tool = "<tool_call>{}</tool_call> 42 so \\boxed{42}"
    assert compute_score("x", right_tool, "42")["score"] == pytest.approx(1.1)
    assert compute_score("x", "\\boxed{42}", "42")["score"] == 1.0
    assert compute_score("x", "\\boxed{41}", "42")["score"] == -1.0
    # the pipeline's DAPO/AIME rows ask for an "Answer:" line (verl's math_dapo prompt): the last one counts
    assert compute_score("x", "6*7\nAnswer: 41\nno, wait\nAnswer: $42$", "42")["acc"] == 1.0
    assert compute_score("x", "the Answer: 42 is inline", "42")["acc"] == 0.0
    assert compute_score("x", "[error] NameError \\boxed{1}", "42")["score"] == pytest.approx(-1.05)
    extra = {"rollout_extra": {"solution": "7", "note": None}}  # a parquet struct: every row's keys, None if absent
    assert compute_score("x", "\\boxed{7}", "42", extra)["acc"] == 1.0
    assert compute_score("x", "\\boxed{42}", "42", {"rollout_extra": {"solution": None}})["acc"] == 1.0
    group = compute_group_score("x", ["\\boxed{42} long answer", "\\boxed{42}", "\\boxed{3}"], "42")
    assert [g["score"] for g in group] == [1.0, pytest.approx(1.1), -1.0]


def test_preflight_calls_the_reward_on_a_sample_row(tmp_path):
    from pipeline_steps.rewards.reward_check import check_reward_function

    ok = check_reward_function(_cfg("pkg:pipeline_steps.rewards/retool.py"))
    assert ok["reward_sample"] == pytest.approx(1.1)
    bad = tmp_path / "bad.py"
    bad.write_text("def compute_score(solution_str):\n    return 1.0\n")  # verl passes four keyword arguments
    with pytest.raises(UserError) as e:
        check_reward_function(_cfg(bad))
    assert "failed on a sample row (TypeError" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="no such function"):
        check_reward_function(_cfg(bad, "score_it"))
    with pytest.raises(UserError, match="file not found|no file"):
        check_reward_function(_cfg(tmp_path / "missing.py"))
    (tmp_path / "none.py").write_text("def compute_score(**kw):\n    return None\n")
    with pytest.raises(UserError, match="returned NoneType"):
        check_reward_function(_cfg(tmp_path / "none.py"))


def test_rollout_extra_reaches_the_reward_as_a_dict(tmp_path, tiny_model, capsys, monkeypatch):
    """The preprocess step stores ``rollout_extra`` as a parquet struct over the union of the rows' keys, so verl's own
    dataset class (what ``main_ppo`` reads on the cluster, which hands ``extra_info`` to ``compute_score`` unchanged)
    and the CPU trainer's loader both give the reward a dict, whichever batch a row was written in."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from pipeline_steps import cli
    from pipeline_steps.data import row_batches
    from pipeline_steps.local.grpo_cpu import load_prompts
    from pipeline_steps.rewards.retool import compute_score

    extras = [
        {"solution": "2", "tag": "a"},
        {"solution": "3", "weight": 0.5, "meta": {"ids": [1, 2]}},
        {"solution": "4", "weight": 1, "meta": {"source": "web"}},  # an integer beside a decimal: a number
    ]
    src = tmp_path / "rows.jsonl"
    src.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"{i}+1?"}], "rollout_extra": e}) + "\n"
            for i, e in enumerate(extras)
        )
    )
    monkeypatch.setattr(
        row_batches, "LINE_BATCH_ROWS", 1
    )  # one row per batch: types are the first pass's, not a batch's
    assert cli.main(["preprocess", "--dataset", "jsonl", "--input", str(src), "--output", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    union = {"solution": None, "tag": None, "weight": None, "meta": {"ids": None, "source": None}}

    def expected(e):
        return {**union, **e, "meta": {**union["meta"], **(e.get("meta") or {})} if "meta" in e else None}

    want = [expected(e) for e in extras]
    want[2]["weight"] = 1.0
    tok = AutoTokenizer.from_pretrained(tiny_model)
    data = OmegaConf.create({"max_prompt_length": 256, "filter_overlong_prompts": False, "cache_dir": str(tmp_path)})
    dataset = RLHFDataset([str(tmp_path / "out" / "train.parquet")], tok, data)
    got = [dataset[i]["extra_info"]["rollout_extra"] for i in range(len(dataset))]
    assert all(isinstance(g, dict) for g in got) and got == want, got
    local = [p.extra_info["rollout_extra"] for p in load_prompts([tmp_path / "out" / "train.parquet"], tok, data)]
    assert local == want
    assert compute_score("x", "\\boxed{3}", "0", dataset[1]["extra_info"])["acc"] == 1.0  # its solution, a dict key


GROUP_REWARD = """
import json, os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    raise AssertionError("the group function scores this run")

def compute_group_score(data_source, solution_strs, ground_truth, extra_info=None):
    # the rank of each response's length inside its group: only defined over the whole group
    order = sorted(range(len(solution_strs)), key=lambda i: (len(solution_strs[i]), i))
    with open(os.environ["GROUP_LOG"], "a") as f:
        f.write(json.dumps({"n": len(solution_strs), "index": extra_info["index"]}) + "\\n")
    return [{"score": float(order.index(i)), "rank": order.index(i)} for i in range(len(solution_strs))]
"""


def test_local_trainer_scores_whole_groups_with_group_name(tmp_path, tiny_model, monkeypatch):
    """``+reward.custom_reward_function.group_name``: the real CPU trainer calls the group function once per prompt
    with its ``rollout.n`` responses, and the scores it returns (a group-relative rank) are the step's rewards."""
    from pipeline_steps.local import grpo_cpu
    from tests.helpers.train_local_runs import compose, write_gsm8k_parquet

    reward = tmp_path / "group_reward.py"
    reward.write_text(GROUP_REWARD)
    monkeypatch.setenv("GROUP_LOG", str(tmp_path / "calls.jsonl"))
    assets = {"model": tiny_model, "train": write_gsm8k_parquet(tmp_path / "train.parquet", n=2)}
    out = tmp_path / "run"
    cfg = compose(
        assets,
        out,
        [
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
            f"reward.custom_reward_function.path={reward}",
            "+reward.custom_reward_function.group_name=compute_group_score",
        ],
    )
    grpo_cpu.train(cfg, metrics_path=out / "metrics.jsonl")
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    n = int(cfg.actor_rollout_ref.rollout.n)
    assert sorted(c["index"] for c in calls) == [0, 1] and all(c["n"] == n for c in calls)  # one call per prompt
    rows = [json.loads(line) for line in (out / "rollouts" / "1.jsonl").read_text().splitlines()]
    by_group: dict = {}
    for r in rows:
        by_group.setdefault(r["uid"], []).append(r["score"])
    assert all(sorted(scores) == [float(i) for i in range(n)] for scores in by_group.values()), by_group


def test_group_reward_preflight(tmp_path):
    from omegaconf import OmegaConf

    from pipeline_steps.rewards.reward_check import check_group_reward

    def cfg(name, path="pkg:pipeline_steps.rewards/retool.py"):
        return OmegaConf.create({"reward": {"custom_reward_function": {"path": path, "group_name": name}}})

    assert check_group_reward(cfg("compute_group_score"), "local")["group_reward_function"].startswith(
        "compute_group_score"
    )
    with pytest.raises(UserError, match="local backend's"):
        check_group_reward(cfg("compute_group_score"), "cluster")
    with pytest.raises(UserError, match="no such function"):
        check_group_reward(cfg("nope"), "local")
    (tmp_path / "scalar.py").write_text(
        "def g(data_source, solution_strs, ground_truth, extra_info=None):\n    return 1\n"
    )
    with pytest.raises(UserError, match="return a list"):
        check_group_reward(cfg("g", str(tmp_path / "scalar.py")), "local")
