"""Multi-turn GRPO on the tiny model with the code tool, shared by tests/e2e/test_agent_grpo_cpu.py and
benchmarks/bench_sandbox.py: gsm8k-style rows in the tool agent's shape, and the trainer's model server with each
trajectory's first assistant turn scripted as a hermes ``<tool_call>`` (a randomly initialised tiny model never writes
one)."""

from __future__ import annotations

import json


def code_tool_rows(n: int) -> list[dict]:
    from pipeline_steps.data.preprocessors.common import tool_agent_rows

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
