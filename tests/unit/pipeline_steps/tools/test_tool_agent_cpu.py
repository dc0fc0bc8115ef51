"""verl's real ``ToolAgentLoop`` on CPU: the tiny model behind verl's async server interface, our code sandbox tool
(loaded from its shipped tool config by verl's registry) calling the local E2B-compatible server through the
pinned SDK, then one GRPO policy-loss step (verl's ``core_algos``) on the multi-turn output.

A randomly initialised tiny model never writes a tool call by itself, so each trajectory's first assistant turn is
scripted: the server returns a hermes ``<tool_call>{...}</tool_call>`` (its log-probabilities are still the model's);
the second turn, after the tool's answer, is sampled from the model.
"""

from __future__ import annotations

import asyncio
import json
from importlib.resources import files

import numpy as np
import pytest

pytestmark = pytest.mark.needs_root(reason="the sandbox server needs root (uids, namespaces)")

TOOL_CONFIG = str(files("pipeline_steps.tools") / "code_sandbox.yaml")


@pytest.fixture(scope="module")
def sandbox_server(tmp_path_factory):
    from pipeline_steps.sandbox.launcher import LocalSandboxServer

    with LocalSandboxServer(tmp_path_factory.mktemp("sandboxes") / "state", args=["--warm", "2"]) as srv:
        yield srv


@pytest.fixture
def e2b_env(sandbox_server, monkeypatch):
    for k, v in sandbox_server.env().items():
        monkeypatch.setenv(k, v)
    return sandbox_server


def _config():
    from omegaconf import OmegaConf

    from pipeline_steps.training.experiment import verl_defaults

    cfg = OmegaConf.create(verl_defaults())
    rollout = cfg.actor_rollout_ref.rollout
    rollout.prompt_length, rollout.response_length = 256, 256
    mt = rollout.multi_turn
    mt.enable, mt.format, mt.tool_config_path = True, "hermes", TOOL_CONFIG
    mt.max_assistant_turns, mt.max_tool_response_length = 2, 256
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 1  # one prompt, its group of two in one step
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 2
    return cfg


def _tool_call(tokenizer, code: str) -> list[int]:
    call = json.dumps({"name": "code_interpreter", "arguments": {"code": code}})
    return tokenizer.encode(f"<tool_call>\n{call}\n</tool_call>", add_special_tokens=False) + [tokenizer.eos_token_id]


async def _rollout(cfg, model, tokenizer, tools, code: str):
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from pipeline_steps.local.agent_server import HFAsyncServer

    server = HFAsyncServer(model, tokenizer, script=[_tool_call(tokenizer, code)])
    loop = ToolAgentLoop(
        trainer_config=DictConfigWrap(cfg),
        server_manager=server,
        tokenizer=tokenizer,
        processor=None,
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(cfg.data),
        tools=ToolListWrap(tools),
    )
    prompt = [{"role": "user", "content": "What is 6 times 7? Use the code_interpreter tool."}]
    out = await loop.run(sampling_params={"temperature": 1.0, "top_p": 1.0, "max_tokens": 8}, raw_prompt=prompt)
    return out, server


def test_tool_agent_loop_runs_code_in_sandbox_and_its_batch_gives_verls_loss_a_gradient(e2b_env, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.tools.tool_registry import initialize_tools_from_config
    from verl.trainer.ppo import core_algos
    from verl.utils.config import omega_conf_to_dataclass

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    cfg = _config()
    tools = initialize_tools_from_config(TOOL_CONFIG)  # verl's registry, as the rollout workers load it
    outs = []
    for code in ("print(6 * 7)", "print(6 * 8)"):  # one group of two trajectories for one prompt
        out, server = asyncio.run(_rollout(cfg, model, tokenizer, tools, code))
        assert len(server.calls) == 2  # the scripted tool call, then a sampled turn after the tool's answer
        outs.append(out)

    rewards = []
    for out, expected in zip(outs, ("42", "48")):
        mask = out.response_mask
        assert len(mask) == len(out.response_ids) == len(out.response_logprobs)
        tool_part = tokenizer.decode([t for t, m in zip(out.response_ids, mask) if m == 0])
        model_part = tokenizer.decode([t for t, m in zip(out.response_ids, mask) if m == 1])
        assert expected in tool_part and "<tool_call>" in model_part and expected not in model_part
        assert mask[0] == 1 and 0 in mask and mask[-1] == 1  # model, tool (masked), model again
        rewards.append(1.0 if "42" in tool_part else 0.0)

    # verl's advantage estimator, policy loss and aggregation on the agent loop's batch give a gradient (the trainer's
    # own update on agent batches is tested in test_agent_grpo_cpu.py and test_trainer_numbers.py)
    width = max(len(o.response_ids) for o in outs)
    prompt_ids = outs[0].prompt_ids
    assert outs[1].prompt_ids == prompt_ids
    resp = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width)
    old = torch.zeros(2, width)
    scores = torch.zeros(2, width)
    for i, o in enumerate(outs):
        n = len(o.response_ids)
        resp[i, :n], mask[i, :n] = torch.tensor(o.response_ids), torch.tensor(o.response_mask, dtype=torch.float)
        old[i, :n] = torch.tensor(o.response_logprobs)
        scores[i, n - 1] = rewards[i]
    adv, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=scores, response_mask=mask, index=np.array(["q", "q"], dtype=object)
    )
    input_ids = torch.cat([torch.tensor([prompt_ids] * 2), resp], 1)
    logits = model(input_ids).logits[:, len(prompt_ids) - 1 : -1]
    log_prob = torch.log_softmax(logits, -1).gather(-1, resp[..., None])[..., 0]
    log_prob.retain_grad()
    actor = cfg.actor_rollout_ref.actor
    actor_cfg = omega_conf_to_dataclass(actor)
    actor_cfg.global_batch_info.update(
        dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=2, loss_scale_factor=actor_cfg.loss_scale_factor
    )
    pg_loss, _ = core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=adv,
        response_mask=mask.bool(),
        loss_agg_mode=actor.loss_agg_mode,
        config=actor_cfg,
        rollout_is_weights=None,
    )
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad()
    pg_loss.backward()
    assert torch.all(log_prob.grad[mask == 0] == 0)  # tool tokens take no part in the loss
    assert torch.all(log_prob.grad[mask == 1] != 0)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    changed = [k for k, v in model.named_parameters() if not torch.equal(v.detach(), before[k])]
    assert changed, "the GRPO step left every weight unchanged"


def _tool(**config):
    from verl.tools.schemas import OpenAIFunctionToolSchema
    from verl.utils.config import omega_conf_to_dataclass  # noqa: F401  (verl's import order, as in the loop)

    from pipeline_steps.tools.code_sandbox import CodeSandboxTool

    schema = OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": "code_interpreter",
                "description": "run code",
                "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
            },
        }
    )
    return CodeSandboxTool({"type": "native", **config}, schema)


async def _call(tool, code, **kw):
    iid, _ = await tool.create()
    try:
        return await tool.execute(iid, {"code": code}, **kw)
    finally:
        await tool.release(iid)


def test_tool_output_formatting_and_truncation(e2b_env):
    tool = _tool(max_output_chars=120, default_timeout=10)
    resp, reward, metrics = asyncio.run(_call(tool, "import sys\nprint('out')\nprint('err', file=sys.stderr)\n6*7"))
    assert resp.text == "out\n42\n[stderr]\nerr" and metrics["code_error"] == 0
    resp, _, metrics = asyncio.run(_call(tool, "undefined_name"))
    assert resp.text.startswith("[error] NameError") and metrics["code_error"] == 1
    resp, _, _ = asyncio.run(_call(tool, "print('a' * 5000)"))
    assert len(resp.text) <= 120 and "characters cut" in resp.text
    resp, _, _ = asyncio.run(_call(tool, ""))
    assert resp.text.startswith("Error: the 'code' argument")


def test_tool_failures_are_text_not_exceptions(e2b_env, monkeypatch):
    monkeypatch.setenv("E2B_API_URL", "http://127.0.0.1:9")  # nothing listens: connection refused
    resp, _, metrics = asyncio.run(_call(_tool(), "1"))
    assert resp.text.startswith("Error: code sandbox unavailable") and metrics["sandbox_error"] == 1
    monkeypatch.setenv("E2B_API_KEY", "wrong")
    monkeypatch.setenv("E2B_API_URL", e2b_env.url)
    resp, _, _ = asyncio.run(_call(_tool(), "1"))
    assert "Error: code sandbox unavailable (AuthenticationException" in resp.text


def test_tool_concurrency_cap(e2b_env):
    tool = _tool(max_concurrency=2)

    code = "import time; a = time.time(); time.sleep(0.5); print(a, time.time())"

    async def main():
        return await asyncio.gather(*[_call(tool, code) for _ in range(4)])

    results = asyncio.run(main())
    spans = [tuple(map(float, r[0].text.split())) for r in results]  # when each call's code ran, in the sandbox
    # the most calls running at one moment: exactly the cap (a cap of 1 gives 1, no cap 4)
    assert max(sum(a <= t < b for a, b in spans) for t, _ in spans) == 2, spans


def test_trajectory_session_keeps_state(e2b_env):
    class AgentData:
        request_id = "trajectory-1"

    tool = _tool(session="trajectory")

    async def main():
        await _call(tool, "x = 21", agent_data=AgentData())
        return await _call(tool, "x * 2", agent_data=AgentData())

    assert asyncio.run(main())[0].text == "42"
