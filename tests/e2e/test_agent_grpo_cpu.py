"""Multi-turn GRPO through the CPU trainer: ``local_tiny_tool_agent`` rows rolled out by verl's real
``ToolAgentLoop``, the code tool running in the local sandbox server the trainer starts itself, two GRPO steps that
change the weights, ``num_turns/*`` and tool counts in the metrics, trajectories in ``rollouts/<step>.jsonl`` and in
the report.

A randomly initialised tiny model never writes a tool call, so the model's server is wrapped to script the first
assistant turn of every trajectory as a hermes ``<tool_call>``: half of them run ``print(6 * 7)``, half ``1 / 0``
(a tool error). Everything after it (the tool's answer, the model's second turn, masks, rewards, the update) is real.
"""

from __future__ import annotations

import json
import os

import pytest

from pipeline_steps.local.scripted_tool_turns import ScriptedFirstTurn, code_tool_rows

pytestmark = [
    pytest.mark.needs_root(reason="the sandbox server needs root (uids, namespaces)"),
    pytest.mark.slow,
]


def test_two_multi_turn_grpo_steps_call_the_tool_and_learn(tmp_path, tiny_model, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from pipeline_steps.local import agent_rollout, grpo_cpu
    from pipeline_steps.steps import report, train_local
    from pipeline_steps.training import experiment

    for k in ("E2B_DOMAIN", "E2B_API_URL", "E2B_API_KEY", "E2B_SANDBOX_URL"):
        monkeypatch.delenv(k, raising=False)  # no E2B service configured: the trainer starts the local server
    default = agent_rollout._default_server
    servers = []
    monkeypatch.setattr(
        agent_rollout, "_default_server", lambda *a: servers.append(ScriptedFirstTurn(default(*a))) or servers[-1]
    )
    train = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(code_tool_rows(4)), train)
    out = tmp_path / "run"
    derived = train_local.derived_keys([train], [], tiny_model, out)
    cfg = experiment.compose(
        experiment.load(
            "local_tiny_tool_agent",
            ["trainer.total_training_steps=2", "trainer.save_freq=-1", "actor_rollout_ref.rollout.n=4"],
            derived=derived,
        )
    )

    seen = []

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        return 1.0 if "42" in solution_str else 0.0  # the tool's answer is part of the scored response

    with grpo_cpu.process_group(), agent_rollout.local_sandbox(cfg, hide=[str(out)]) as server:
        assert server is not None and os.environ["E2B_API_URL"] == server.url
        trainer = grpo_cpu.GRPOTrainer(cfg, reward_fn=reward, metrics_path=out / "metrics.jsonl")

        def weights():
            return {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in trainer.model.named_parameters()
            }

        before = weights()
        summary = trainer.fit()
        after = weights()
    assert "E2B_API_URL" not in os.environ  # restored when the server stops
    assert summary["last_step"] == 2
    assert any(not torch.equal(before[k], after[k]) for k in before), "two GRPO steps left every weight unchanged"
    assert servers[0].first_turns == 16  # 2 steps x 2 prompts x 4 samples, each trajectory started with the call
    # as verl's reward manager: the tool loop's extra fields reach the reward
    assert len(seen) == 16, len(seen)
    assert all(isinstance(e["turn_scores"], list) and isinstance(e["tool_rewards"], list) for e in seen), seen[:2]
    assert all(e["num_turns"] == 4 for e in seen)

    lines = grpo_cpu.read_metrics(out / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        m = line["data"]
        # user + scripted call + tool answer + sampled answer (verl counts user, assistant and tool turns)
        assert m["num_turns/min"] == 4 and m["num_turns/max"] == 4
        assert m["tool_call_counts/mean"] == 1 and m["tool/call_rate"] == 1.0
        assert m["tool/errors"] == 4 and m["tool/error_rate"] == 0.5
        assert m["critic/score/mean"] == 0.5  # 42 for half of each group: non-zero advantages
        # verl's own agent-loop timings, under the names its AgentLoopManager gives them on the cluster
        assert 0 < m["timing_s/agent_loop/tool_calls/mean"] <= m["timing_s/agent_loop/tool_calls/max"]
        assert m["timing_s/agent_loop/generate_sequences/mean"] > 0

    rows = [json.loads(x) for x in (out / "rollouts" / "2.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and {r["step"] for r in rows} == {2}
    for r in rows:
        assert set(r) >= {"input", "output", "gts", "score", "step", "advantage", "turns", "tool_calls", "uid"}
        roles = [t["role"] for t in r["turns"]]
        assert roles[:3] == ["assistant", "tool", "assistant"]  # split by verl's response mask
        assert "<tool_call>" in r["turns"][0]["text"]
        tool_text = r["turns"][1]["text"]
        assert r["tool_calls"][0]["name"] == "code_interpreter"
        ok = r["tool_calls"][0]["arguments"]["code"] == "print(6 * 7)"
        assert ("42" in tool_text) if ok else ("ZeroDivisionError" in tool_text)
        assert r["tool_outputs"][0]["error"] is (not ok)
        assert r["score"] == (1.0 if ok else 0.0)
        assert (r["advantage"] > 0) if ok else (r["advantage"] < 0)
        assert "code_interpreter" in r["input"]  # the system prompt naming the tool

    class Args:
        run_dir, output, dashboard_url, exported_uri, task_states = str(out), None, "", "", ""

    page = (out / "report" / "report.md").read_text() if report.run(Args()) else ""
    assert "## Trajectories" in page and "| 2 | 8 | 1 | 8 | 4 |" in page
    assert "&lt;tool_call&gt;" in (out / "report" / "report.html").read_text()  # model text escaped, not markup


# A user's reward file (guide 002), as a team would ship it: verl's per-sample signature, rollout_extra read as a dict,
# the tool's output scored; and a group function of the same file scoring a prompt's whole group at once.
USER_REWARD = """
import json
import os


def _log(record):
    with open(os.environ["USER_REWARD_LOG"], "a") as f:
        f.write(json.dumps(record) + "\\n")


def _score(solution_str, extra):
    # the sandbox's answer to the scripted print(6 * 7) is in the response; the row's weight scales it
    correct = extra["solution"] in solution_str
    return extra["weight"] * float(correct) - (0.25 if "ZeroDivisionError" in solution_str else 0.0), correct


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    extra = extra_info["rollout_extra"]
    score, correct = _score(solution_str, extra)
    _log({"fn": "sample", "extra_type": type(extra).__name__, "extra": extra, "solution_str": solution_str,
          "ground_truth": ground_truth, "score": score})
    return {"score": score, "acc": float(correct)}


def compute_group_score(data_source, solution_strs, ground_truth, extra_info=None):
    extra = extra_info["rollout_extra"]
    scored = [_score(s, extra) for s in solution_strs]
    # the group's shortest correct response gets a bonus: only defined over the whole group
    correct = [i for i, (_, ok) in enumerate(scored) if ok]
    best = min(correct, key=lambda i: (len(solution_strs[i]), i)) if correct else None
    scores = [s + (0.5 if i == best else 0.0) for i, (s, _) in enumerate(scored)]
    _log({"fn": "group", "extra_type": type(extra).__name__, "extra": extra, "solution_strs": solution_strs,
          "scores": scores})
    return [{"score": s, "acc": float(ok)} for s, (_, ok) in zip(scores, scored)]
"""


@pytest.mark.parametrize("kind", ["per_sample", "group"])
def test_grpo_step_scored_by_a_user_reward_file(kind, tmp_path, tiny_model, monkeypatch):
    """The guide-002 path end to end on CPU: JSONL rows with ``rollout_extra`` through the real preprocess step
    (``tool_agent`` variant), verl's ``ToolAgentLoop`` calling the code tool in the local sandbox, and a reward FILE
    named by ``reward.custom_reward_function.{path,name}`` (``group_name`` for the group case) loaded by the trainer's
    own loader (verl's ``get_custom_reward_fn``). The tool's output is in the response and masked out of the loss,
    the reward the trainer logged is what the file's function returns for those responses, ``rollout_extra`` arrived
    as a dict, and the GRPO step changed the weights."""
    import torch
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    from pipeline_steps import cli
    from pipeline_steps.local import agent_rollout, grpo_cpu
    from pipeline_steps.steps import train_local
    from pipeline_steps.training import experiment

    for k in ("E2B_DOMAIN", "E2B_API_URL", "E2B_API_KEY", "E2B_SANDBOX_URL"):
        monkeypatch.delenv(k, raising=False)
    default = agent_rollout._default_server
    monkeypatch.setattr(agent_rollout, "_default_server", lambda *a: ScriptedFirstTurn(default(*a)))
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(USER_REWARD)
    log_file = tmp_path / "reward_calls.jsonl"
    monkeypatch.setenv("USER_REWARD_LOG", str(log_file))

    # two rows: different weights, and a key only one row has (None in the other: the struct's union of keys)
    extras = [{"solution": "42", "weight": 1.0, "note": "first"}, {"solution": "42", "weight": 2.0}]
    src = tmp_path / "rows.jsonl"
    src.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"Row {i}: what is 6 times 7?"}], "rollout_extra": e})
            + "\n"
            for i, e in enumerate(extras)
        )
    )
    args = ["preprocess", "--dataset", "jsonl", "--input", str(src), "--output", str(tmp_path / "data")]
    assert cli.main([*args, "--variant", "tool_agent"]) == 0
    train = tmp_path / "data" / "train.parquet"

    out = tmp_path / "run"
    keys = [
        "trainer.total_training_steps=1",
        "trainer.save_freq=-1",
        "actor_rollout_ref.rollout.n=4",
        f"reward.custom_reward_function.path={reward_file}",
        "reward.custom_reward_function.name=compute_score",
    ]
    if kind == "group":
        keys.append("+reward.custom_reward_function.group_name=compute_group_score")
    cfg = experiment.compose(
        experiment.load("local_tiny_tool_agent", keys, derived=train_local.derived_keys([train], [], tiny_model, out))
    )
    with grpo_cpu.process_group(), agent_rollout.local_sandbox(cfg, hide=[str(out)]):
        trainer = grpo_cpu.GRPOTrainer(cfg, metrics_path=out / "metrics.jsonl")  # no reward_fn: the file's
        batches = []
        update = trainer.update
        monkeypatch.setattr(trainer, "update", lambda batch: batches.append(batch) or update(batch))

        def weights():
            return {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in trainer.model.named_parameters()
            }

        before = weights()
        assert trainer.fit()["last_step"] == 1
        after = weights()
    assert any(not torch.equal(before[k], after[k]) for k in before), "the GRPO step left every weight unchanged"

    [batch] = batches
    tok = trainer.tokenizer
    resp, rmask = batch["responses"], batch["response_mask"]
    lengths = batch["attention_mask"][:, -resp.shape[1] :].sum(-1)
    for i in range(resp.shape[0]):
        valid = resp[i, : int(lengths[i])]
        mask = rmask[i, : int(lengths[i])]
        tool_text = tok.decode(valid[mask == 0], skip_special_tokens=True)
        model_text = tok.decode(valid[mask == 1], skip_special_tokens=True)
        assert "42" in tool_text or "ZeroDivisionError" in tool_text, tool_text  # the sandbox's answer...
        assert "42" not in model_text.replace("6 * 7", "") and "ZeroDivisionError" not in model_text  # ...is masked

    calls = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert calls and all(c["extra_type"] == "dict" for c in calls)  # rollout_extra arrived as a dict
    seen = sorted((c["extra"] for c in calls), key=lambda e: e["weight"])
    assert seen[0] == {"solution": "42", "weight": 1.0, "note": "first"}
    assert seen[-1] == {"solution": "42", "weight": 2.0, "note": None}

    # the reward the trainer logged is what the file's function returns for those responses
    rows = [json.loads(line) for line in (out / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert [r["score"] for r in rows] == pytest.approx(batch["scores"])
    if kind == "per_sample":
        fn = get_custom_reward_fn(cfg)  # the loader the trainer used
        assert [c["fn"] for c in calls] == ["sample"] * len(rows)
        for row, call in zip(rows, calls):
            assert row["output"] == call["solution_str"]  # the scored response, tool output included
            got = fn(row.get("data_source", "math_dapo"), row["output"], row["gts"], {"rollout_extra": call["extra"]})
            assert got["score"] == pytest.approx(row["score"]) and row["acc"] == got["acc"]
        assert {r["score"] for r in rows} >= {1.0, 2.0}  # the rows' weights reached the reward
    else:
        probe = OmegaConf.create({"reward": {"custom_reward_function": {"path": str(reward_file), "name": "x"}}})
        probe.reward.custom_reward_function.name = "compute_group_score"
        group_fn = get_custom_reward_fn(probe)
        assert [c["fn"] for c in calls] == ["group", "group"]  # one call per prompt, with its whole group
        by_uid: dict = {}
        for row in rows:
            by_uid.setdefault(row["uid"], []).append(row)
        assert len(by_uid) == 2 and all(len(g) == 4 for g in by_uid.values())
        for group in by_uid.values():
            [call] = [c for c in calls if c["solution_strs"] == [r["output"] for r in group]]
            got = group_fn("math_dapo", call["solution_strs"], "42", {"rollout_extra": call["extra"]})
            assert [g["score"] for g in got] == pytest.approx([r["score"] for r in group])
            assert sum(1 for g in got if g["score"] % 1 == 0.5) == 1  # the bonus went to one response of the group
    metrics = grpo_cpu.read_metrics(out / "metrics.jsonl")[0]["data"]
    assert metrics["critic/score/mean"] == pytest.approx(sum(batch["scores"]) / len(batch["scores"]))
