"""A user rollout function through CPU GRPO: the ``local_tiny_custom_rollout`` preset, its agent loop registered from
an ``agent_loop_config_path`` file as verl registers it, calling the MCP code server's ``run_code_once`` (real
``mcp`` client, real MCP server, real sandbox server, both started by the trainer for the run) with its own timeout
and concurrency cap, its trajectories in ``rollouts/<step>.jsonl``.

The file is a deployment's own copy of the shipped entry with this test's timeout and cap (a preset may name any
path). A randomly initialised tiny model never writes a tool call, so its server is wrapped to script the first
assistant turn of every trajectory as a hermes ``<tool_call>``: one call per step sleeps far past the loop's timeout,
the others sleep briefly and print, from inside the sandbox, when they ran and ``6 * 7``. Everything after the
scripted turn (the MCP calls, the tool answers, the model's next turn, masks, rewards, the update) is real.
"""

from __future__ import annotations

import json
import os
from importlib.resources import files

import pytest

from tests.helpers.budget import scaled

pytestmark = [
    pytest.mark.needs_root(reason="the sandbox server needs root (uids, namespaces)"),
    pytest.mark.slow,
    pytest.mark.budget(300),  # 203 s at a load average of 26 on 2 cores
]

# the loop's tool timeout: a fast call (a slot under the cap, a sandbox, 1.5 s of sleep) must end within it; two
# suites on one machine (PIPELINE_TEST_BUDGET_SCALE=2) once took a fast call past 5 s
TIMEOUT_S = scaled(5.0)
CAP = 2
SLOW = "import time; time.sleep(60)"
FAST = "import time as t;a=t.time();t.sleep(1.5);print(a,t.time());6*7"  # short: all turns fit response_length


def _rows(n: int) -> list[dict]:
    return [  # plain rows (no agent_name): rollout.agent.default_agent_loop rolls them out
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is 6 times {7 + i}? Output the answer after ####."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(6 * (7 + i))},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]


class ScriptedFirstTurn:
    """The trainer's own server (HFAsyncServer), with each trajectory's first turn replaced by a tool call."""

    def __init__(self, inner):
        self.inner, self.seen, self.first_turns = inner, set(), 0

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
        from verl.workers.rollout.replica import TokenOutput

        if request_id in self.seen:
            return await self.inner.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kw)
        self.seen.add(request_id)
        code = SLOW if self.first_turns % 8 == 3 else FAST  # one trajectory of each step's eight
        self.first_turns += 1
        tok = self.inner.tokenizer
        call = json.dumps({"name": "run_code_once", "arguments": {"code": code}})
        ids = tok.encode(f"<tool_call>\n{call}\n</tool_call>", add_special_tokens=False) + [tok.eos_token_id]
        return TokenOutput(token_ids=ids, log_probs=None, stop_reason="completed")


def _most_at_once(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: (e[0], e[1]))
    now = best = 0
    for _, d in events:
        now += d
        best = max(best, now)
    return best


def test_user_agent_loop_calls_the_mcp_tool_within_its_timeout_and_cap(tmp_path, tiny_model, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    import yaml

    from pipeline_steps.local import agent_rollout, grpo_cpu
    from pipeline_steps.steps import train_local
    from pipeline_steps.training import experiment

    for k in ("E2B_DOMAIN", "E2B_API_URL", "E2B_API_KEY", "E2B_SANDBOX_URL", "MCP_SERVERS_CONFIG"):
        monkeypatch.delenv(k, raising=False)  # nothing configured: the trainer starts the sandbox and MCP servers
    default = agent_rollout._default_server
    servers = []
    monkeypatch.setattr(
        agent_rollout, "_default_server", lambda *a: servers.append(ScriptedFirstTurn(default(*a))) or servers[-1]
    )
    [shipped] = yaml.safe_load((files("pipeline_steps.rollouts") / "mcp_math_loop.yaml").read_text())
    assert shipped["name"] == "mcp_math_agent"
    loops = tmp_path / "team" / "loops.yaml"  # a deployment's own loop file: the shipped entry, its own settings
    loops.parent.mkdir()
    loops.write_text(yaml.safe_dump([dict(shipped, tool_timeout_s=TIMEOUT_S, max_concurrent=CAP)]))
    train = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(4)), train)
    out = tmp_path / "run"
    cfg = experiment.compose(
        experiment.load(
            "local_tiny_custom_rollout",
            [
                "trainer.total_training_steps=2",
                "trainer.save_freq=-1",
                f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
            ],
            derived=train_local.derived_keys([train], [], tiny_model, out),
        )
    )

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 if "42" in solution_str else 0.0  # the tool's answer is part of the scored response

    with grpo_cpu.process_group(), agent_rollout.local_sandbox(cfg, hide=[str(out)]):
        assert os.environ["MCP_SERVERS_CONFIG"]  # the local MCP code server, started for the run
        trainer = grpo_cpu.GRPOTrainer(cfg, reward_fn=reward, metrics_path=out / "metrics.jsonl")

        def weights():
            return {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in trainer.model.named_parameters()
            }

        before = weights()
        summary = trainer.fit()
        after = weights()
    assert "MCP_SERVERS_CONFIG" not in os.environ  # restored when the server stops
    assert summary["last_step"] == 2
    assert any(not torch.equal(before[k], after[k]) for k in before), "two GRPO steps left every weight unchanged"
    assert servers[0].first_turns == 16  # 2 steps x 2 prompts x 4 samples, each started with the call

    for line in grpo_cpu.read_metrics(out / "metrics.jsonl"):
        m = line["data"]
        assert m["tool/calls"] == 8 and m["tool/timeouts"] == 1 and m["tool/errors"] == 1
        assert m["timing_s/agent_loop/tool_calls/max"] >= TIMEOUT_S  # the slow call held its rollout that long

    for step in (1, 2):
        rows = [json.loads(x) for x in (out / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 8
        assert {r["agent_name"] for r in rows} == {"mcp_math_agent"}  # rolled out by the user's loop
        assert sum(len(r["tool_calls"]) for r in rows) == 8
        slow = [r for r in rows if r["tool_calls"][0]["arguments"]["code"] == SLOW]
        fast = [r for r in rows if r["tool_calls"][0]["arguments"]["code"] == FAST]
        assert len(slow) == 1 and len(fast) == 7
        for r in rows:
            assert r["tool_calls"][0]["name"] == "run_code_once"
            roles = [t["role"] for t in r["turns"]]
            assert roles[:3] == ["assistant", "tool", "assistant"]  # the rollout went on after the tool's turn
        # the timeout: the slow call was abandoned at the loop's limit, recorded as a timeout, and the model answered
        [o] = slow[0]["tool_outputs"]
        assert o["timeout"] is True and o["error"] is True
        assert f"timed out after {TIMEOUT_S:g} s" in o["text"] and "timed out" in slow[0]["turns"][1]["text"]
        assert TIMEOUT_S <= o["seconds"] < TIMEOUT_S + 3
        assert slow[0]["score"] == 0.0
        # the calls that ran: answered by the sandbox (its clock says when the code ran)
        intervals = []
        for r in fast:
            [o] = r["tool_outputs"]
            assert o["timeout"] is False and o["error"] is False and r["score"] == 1.0
            ran, answer = o["text"].splitlines()
            assert answer == "42" and "42" in r["turns"][1]["text"]
            start, end = map(float, ran.split())
            intervals.append((start, end))
        # the cap: never more than CAP calls running at once, and CAP of them did run together
        assert _most_at_once(intervals) == CAP
        slow_start = slow[0]["tool_outputs"][0]["started"]
        assert _most_at_once([*intervals, (slow_start, slow_start + TIMEOUT_S)]) == CAP
