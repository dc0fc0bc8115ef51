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

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox server needs root (uids, namespaces)"),
    pytest.mark.slow,
]


def _rows(n: int) -> list[dict]:
    from pipeline_steps.data.preprocessors.base import tool_agent_rows

    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is 6 times {7 + i}? Output the answer after ####."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(6 * (7 + i))},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]
    return tool_agent_rows(rows, "code_interpreter")


class ScriptedFirstTurn:
    """The trainer's own server (HFAsyncServer), with each trajectory's first turn replaced by a tool call."""

    def __init__(self, inner):
        self.inner, self.seen, self.first_turns = inner, set(), 0

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
        from verl.workers.rollout.replica import TokenOutput

        if request_id in self.seen:
            return await self.inner.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kw)
        self.seen.add(request_id)
        code = "print(6 * 7)" if self.first_turns % 2 == 0 else "1 / 0"
        self.first_turns += 1
        tok = self.inner.tokenizer
        call = json.dumps({"name": "code_interpreter", "arguments": {"code": code}})
        ids = tok.encode(f"<tool_call>\n{call}\n</tool_call>", add_special_tokens=False) + [tok.eos_token_id]
        return TokenOutput(token_ids=ids, log_probs=None, stop_reason="completed")


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
    pq.write_table(pa.Table.from_pylist(_rows(4)), train)
    out = tmp_path / "run"
    derived = train_local.derived_keys([train], [], tiny_model, out)
    cfg = experiment.compose(
        experiment.load(
            "local_tiny_tool_agent",
            ["trainer.total_training_steps=2", "trainer.save_freq=-1", "actor_rollout_ref.rollout.n=4"],
            derived=derived,
        )
    )

    def reward(data_source, solution_str, ground_truth, extra_info=None):
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

    lines = grpo_cpu.read_metrics(out / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        m = line["data"]
        # user + scripted call + tool answer + sampled answer (verl counts user, assistant and tool turns)
        assert m["num_turns/min"] == 4 and m["num_turns/max"] == 4
        assert m["tool_call_counts/mean"] == 1 and m["tool/call_rate"] == 1.0
        assert m["tool/errors"] == 4 and m["tool/error_rate"] == 0.5
        assert m["critic/score/mean"] == 0.5  # 42 for half of each group: non-zero advantages

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
        run_dir, output, dashboard_url, exported_uri = str(out), None, "", ""

    page = (out / "report" / "report.md").read_text() if report.run(Args()) else ""
    assert "## Trajectories" in page and "| 2 | 8 | 1 | 8 | 4 |" in page
    assert "&lt;tool_call&gt;" in (out / "report" / "report.html").read_text()  # model text escaped, not markup
