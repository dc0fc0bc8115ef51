"""Sandbox capacity of the code tool's ``session: trajectory`` mode, against the real local sandbox server (issue 46,
item 2): a trajectory's sandbox is killed when the trajectory ends (verl's own ``ToolAgentLoop`` as verl's
``AgentLoopWorker`` runs it, and the CPU trainer's rollout), not left to the service's 300 s timeout; a call the
service refuses for capacity is counted in the step's metrics and logged once; pre-flight refuses a rollout that would
hold more sandboxes at once than the service has.

Every trajectory's first turn is a scripted hermes tool call (a random tiny model never writes one) and its second an
answer; the second turns wait until every trajectory has had its tool answer, so all of them hold their sandbox at
once, as a rollout of ``train_batch_size x rollout.n`` trajectories does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import types
from importlib.resources import files

import httpx
import pytest
import yaml

from tests.helpers.budget import scaled

needs_root = pytest.mark.needs_root(reason="the sandbox server needs root (uids, namespaces)")

CAPACITY = 4  # the server's --max-sandboxes
SANDBOX_TIMEOUT = 300  # the shipped config's: a sandbox that outlives its trajectory is left to this


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pipeline_steps.sandbox.launcher import LocalSandboxServer

    args = ["--warm", "0", "--max-sandboxes", str(CAPACITY)]
    with LocalSandboxServer(tmp_path_factory.mktemp("sandboxes") / "state", args=args) as srv:
        yield srv


@pytest.fixture
def e2b_env(server, monkeypatch):
    for k in ("E2B_DOMAIN", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
        monkeypatch.delenv(k, raising=False)
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    yield server
    _kill_all(server)  # a failed test leaves nothing for the next one


def _live(server) -> list[str]:
    """The server's live sandboxes, as its API lists them (``Sandbox.list``'s route)."""
    r = httpx.get(f"{server.url}/v2/sandboxes", headers={"X-API-KEY": server.api_key}, timeout=10)
    r.raise_for_status()
    return [s["sandboxID"] for s in r.json()]


def _kill_all(server):
    for sid in _live(server):
        httpx.delete(f"{server.url}/sandboxes/{sid}", headers={"X-API-KEY": server.api_key}, timeout=10)


def _tool_config(tmp_path, session: str = "trajectory") -> str:
    spec = yaml.safe_load((files("pipeline_steps.tools") / "code_sandbox.yaml").read_text())
    spec["tools"][0]["config"].update(session=session, sandbox_timeout=SANDBOX_TIMEOUT, default_timeout=10)
    path = tmp_path / "code_tool.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def _config(tool_config: str, batch: int = 1, n: int = 1):
    from omegaconf import OmegaConf

    from pipeline_steps.training.experiment import verl_defaults

    cfg = OmegaConf.create(verl_defaults())
    rollout = cfg.actor_rollout_ref.rollout
    rollout.prompt_length, rollout.response_length = 256, 256
    rollout.n, cfg.data.train_batch_size = n, batch
    mt = rollout.multi_turn
    mt.enable, mt.format, mt.tool_config_path = True, "hermes", tool_config
    mt.max_assistant_turns, mt.max_tool_response_length = 3, 256
    rollout.agent.default_agent_loop = "tool_agent"
    return cfg


class ScriptedTurns:
    """verl's async server interface without a model: a trajectory's first turn calls the code tool (variables set
    there are read back by a second call when ``calls=2``), its last answers; a turn after a tool answer waits until
    every trajectory has had one, and ``probe`` (if any) is measured once, when the last one arrives: all of them
    hold their sandboxes then."""

    def __init__(self, tokenizer, trajectories: int, calls: int = 1, probe=None):
        self.tok, self.trajectories, self.calls, self.probe = tokenizer, trajectories, calls, probe
        self.turns: dict[str, int] = {}
        self.answered = 0
        self.event: asyncio.Event | None = None
        self.during = None

    def _ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
        from verl.workers.rollout.replica import TokenOutput

        turn = self.turns[request_id] = self.turns.get(request_id, 0) + 1
        if self.event is None:
            self.event = asyncio.Event()
        if turn > 1:  # after a tool answer
            self.answered += 1
            if self.answered == self.trajectories:  # the last first answer: every trajectory is waiting here
                if self.probe is not None:
                    self.during = self.probe()  # blocking the loop on purpose: nothing moves while it measures
                self.event.set()
            await asyncio.wait_for(self.event.wait(), scaled(60))
        if turn <= self.calls:
            code = "x = 6 * 7\nprint(x)" if turn == 1 else "print(x + 1)"
            call = json.dumps({"name": "code_interpreter", "arguments": {"code": code}})
            return TokenOutput(token_ids=self._ids(f"<tool_call>\n{call}\n</tool_call>"), stop_reason="completed")
        return TokenOutput(token_ids=self._ids("#### 42"), stop_reason="completed")


def _prompts(k: int):
    return [
        types.SimpleNamespace(
            agent_name=None,
            messages=[{"role": "user", "content": f"What is 6 times {7 + i}? Use the code_interpreter tool."}],
            extra_info={},
        )
        for i in range(k)
    ]


def _wait_until_none_live(server, deadline_s: float) -> tuple[list[str], float]:
    t0 = time.monotonic()
    while True:
        live = _live(server)
        if not live or time.monotonic() - t0 > deadline_s:
            return live, time.monotonic() - t0
        time.sleep(0.05)


@needs_root
def test_trajectory_sandboxes_are_killed_when_verls_tool_agent_loop_ends(e2b_env, tiny_model, tmp_path):
    """As verl's ``AgentLoopWorker`` runs them (one long-lived event loop, a ``ToolAgentLoop`` per trajectory from
    verl's registry, the tools from verl's tool registry): once the trajectories have ended, no sandbox is alive, well
    before the 300 s sandbox timeout; meanwhile each trajectory held one (two calls in one sandbox: state kept)."""
    import hydra
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.tools.tool_registry import initialize_tools_from_config
    from verl.utils.dataset.rl_dataset import RLHFDataset

    trajectories = CAPACITY - 1
    cfg = _config(_tool_config(tmp_path), batch=trajectories)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tools = initialize_tools_from_config(cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path)
    server = ScriptedTurns(tokenizer, trajectories, calls=2, probe=lambda: len(_live(e2b_env)))

    async def one(prompt):
        loop = hydra.utils.instantiate(  # verl's AgentLoopWorker._run_agent_loop
            config=_agent_loop_registry["tool_agent"],
            trainer_config=DictConfigWrap(config=cfg),
            server_manager=server,
            tokenizer=tokenizer,
            processor=None,
            dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(cfg.data),
            tools=ToolListWrap(tools),
        )
        sp = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 64}
        return await loop.run(sp, raw_prompt=list(prompt.messages), tools_kwargs={})

    async def worker():  # the worker's event loop lives on after the step, as a Ray actor's does
        outs = await asyncio.gather(*[one(p) for p in _prompts(trajectories)])
        ended = time.monotonic()
        while _live(e2b_env) and time.monotonic() - ended < scaled(15):
            await asyncio.sleep(0.05)
        return outs, _live(e2b_env), time.monotonic() - ended

    outs, left, waited = asyncio.run(worker())
    texts = [tokenizer.decode([t for t, m in zip(o.response_ids, o.response_mask) if m == 0]) for o in outs]
    assert all("42" in t and "43" in t for t in texts), texts  # the second call saw the first call's variable
    assert server.during == trajectories  # one sandbox per trajectory while they ran
    print(f"\nsandboxes alive after {trajectories} trajectories ended: {len(left)} (after {waited:.2f} s)")
    assert left == [], f"{len(left)} sandboxes still alive {waited:.1f} s after the trajectories ended"


@needs_root
def test_cpu_trainer_rollout_leaves_no_sandbox_alive(e2b_env, tiny_model, tmp_path):
    """The CPU trainer's rollout (``AgentRollout.generate``, one step of ``batch x n`` trajectories): every sandbox is
    gone when the step's rollout returns, and no call was refused."""
    from transformers import AutoTokenizer

    from pipeline_steps.local import agent_rollout

    batch, n = 2, 2  # four trajectories: the server's capacity
    cfg = _config(_tool_config(tmp_path), batch=batch, n=n)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    scripted = ScriptedTurns(tokenizer, batch * n, probe=lambda: len(_live(e2b_env)))
    rollout = agent_rollout.AgentRollout(cfg, None, tokenizer, [tokenizer.eos_token_id], lambda *a: scripted)
    out = rollout.generate(_prompts(batch), n, temperature=1.0, top_p=1.0, top_k=-1, seed=0)
    left = _live(e2b_env)
    assert scripted.during == batch * n
    print(f"\nsandboxes alive when the step's rollout returned: {len(left)}")
    assert left == []
    metrics = agent_rollout.metrics(out)
    assert metrics["tool/calls"] == batch * n and metrics["tool/errors"] == 0
    assert metrics["tool/sandbox_capacity_refused"] == 0


@needs_root
def test_capacity_refusals_are_counted_in_the_step_metrics_and_logged_once(e2b_env, tiny_model, tmp_path, caplog):
    """Six trajectories against four sandboxes: two calls are refused, and the step's metrics say so
    (``tool/sandbox_capacity_refused``), with one warning for the step."""
    from transformers import AutoTokenizer

    from pipeline_steps.local import agent_rollout

    batch, n = 3, 2
    cfg = _config(_tool_config(tmp_path), batch=batch, n=n)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    scripted = ScriptedTurns(tokenizer, batch * n)
    rollout = agent_rollout.AgentRollout(cfg, None, tokenizer, [tokenizer.eos_token_id], lambda *a: scripted)
    with caplog.at_level(logging.WARNING):
        out = rollout.generate(_prompts(batch), n, temperature=1.0, top_p=1.0, top_k=-1, seed=0)
    metrics = agent_rollout.metrics(out)
    refused = [o for t in out["trajectories"] for o in t["tool_outputs"] if "at capacity" in o["text"]]
    print(f"\nrefused for capacity: {metrics.get('tool/sandbox_capacity_refused')} of {batch * n} calls")
    assert metrics["tool/sandbox_capacity_refused"] == batch * n - CAPACITY == len(refused)
    assert metrics["tool/errors"] == batch * n - CAPACITY
    warnings = [r.getMessage() for r in caplog.records if "capacity" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "2 code tool calls" in warnings[0] and "tool/sandbox_capacity_refused" in warnings[0], warnings[0]
    assert _live(e2b_env) == []


# ---------------------------------------------------------------------------------------------- pre-flight


@needs_root
def test_preflight_refuses_more_trajectories_than_the_local_server_holds(e2b_env, tmp_path):
    """``train_batch_size x rollout.n`` trajectories, each holding a sandbox, against the server's capacity (asked
    of the running server): refused in one line naming the settings; within capacity it passes with the figures."""
    from pipeline_steps.errors import UserError
    from pipeline_steps.tools.tool_config_check import check_multi_turn

    tool_config = _tool_config(tmp_path)
    with pytest.raises(UserError) as err:
        check_multi_turn(_config(tool_config, batch=3, n=2), "local")
    line = str(err.value)
    print(f"\npre-flight: {line}")
    assert "\n" not in line
    for part in ("data.train_batch_size=3", "actor_rollout_ref.rollout.n=2", "session: trajectory", "6 sandboxes"):
        assert part in line, line
    assert f"{CAPACITY}" in line and e2b_env.url in line

    ok = check_multi_turn(_config(tool_config, batch=2, n=2), "local")
    assert ok["sandboxes"] == {"at_once": 4, "capacity": CAPACITY, "session": "trajectory"}


@needs_root
def test_preflight_counts_concurrent_calls_in_call_mode(e2b_env, tmp_path):
    """``session: call`` holds a sandbox only during a call: at most ``max_concurrency`` of a process's calls at
    once (the local trainer is one process), so 8 x 2 trajectories fit 4 sandboxes only with ``max_concurrency``
    at most 4."""
    from pipeline_steps.errors import UserError
    from pipeline_steps.tools.tool_config_check import check_multi_turn

    path = _tool_config(tmp_path, session="call")
    with pytest.raises(UserError, match=r"max_concurrency=32") as err:
        check_multi_turn(_config(path, batch=8, n=2), "local")
    assert "16 sandboxes" in str(err.value)
    spec = yaml.safe_load(open(path))
    spec["tools"][0]["config"]["max_concurrency"] = CAPACITY
    (tmp_path / "code_tool.yaml").write_text(yaml.safe_dump(spec))
    assert check_multi_turn(_config(path, batch=8, n=2), "local")["sandboxes"]["at_once"] == CAPACITY


@needs_root
@pytest.mark.slow
def test_a_cpu_trainer_step_logs_the_capacity_refusals_in_metrics_jsonl(e2b_env, tiny_model, tmp_path, monkeypatch):
    """One GRPO step of the CPU trainer (``local_tiny_tool_agent``, 3 prompts x n=2, ``session: trajectory``) against
    the four-sandbox server: ``metrics.jsonl`` has ``tool/sandbox_capacity_refused`` 2 for the step, and the step
    leaves no sandbox alive."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline_steps.local import agent_rollout, grpo_cpu
    from pipeline_steps.local.scripted_tool_turns import code_tool_rows
    from pipeline_steps.steps import train_local
    from pipeline_steps.training import experiment

    batch, n = 3, 2
    scripted = []
    monkeypatch.setattr(
        agent_rollout,
        "_default_server",
        lambda m, tok, eos: scripted.append(ScriptedTurns(tok, batch * n)) or scripted[-1],
    )
    train = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(code_tool_rows(batch)), train)
    out = tmp_path / "run"
    derived = train_local.derived_keys([train], [], tiny_model, out)
    overrides = ["trainer.total_training_steps=1", "trainer.save_freq=-1", f"actor_rollout_ref.rollout.n={n}"]
    overrides += [f"data.train_batch_size={batch}", "actor_rollout_ref.actor.ppo_mini_batch_size=3"]
    cfg = experiment.compose(experiment.load("local_tiny_tool_agent", overrides, derived=derived))
    cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path = _tool_config(tmp_path)  # session: trajectory
    with grpo_cpu.process_group(), agent_rollout.local_sandbox(cfg, hide=[str(out)]) as started:
        assert started is None  # E2B_API_URL names the four-sandbox server
        grpo_cpu.GRPOTrainer(cfg, reward_fn=lambda *a, **k: 0.0, metrics_path=out / "metrics.jsonl").fit()
    (line,) = grpo_cpu.read_metrics(out / "metrics.jsonl")
    print(f"\nmetrics.jsonl step 1: tool/sandbox_capacity_refused={line['data'].get('tool/sandbox_capacity_refused')}")
    assert line["data"]["tool/sandbox_capacity_refused"] == batch * n - CAPACITY
    assert line["data"]["tool/errors"] == batch * n - CAPACITY
    assert _live(e2b_env) == []


def test_preflight_of_the_local_backend_without_a_service_uses_the_server_it_starts(monkeypatch, tmp_path):
    """No E2B service set: the local backend starts its own server, whose capacity is the ``sandbox-server``
    default (64): 65 trajectories are refused, 64 pass."""
    from pipeline_steps.errors import UserError
    from pipeline_steps.tools.tool_config_check import check_multi_turn

    for k in ("E2B_DOMAIN", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
        monkeypatch.delenv(k, raising=False)
    path = _tool_config(tmp_path)
    with pytest.raises(UserError, match=r"65 sandboxes at once, but the local sandbox server the run starts "):
        check_multi_turn(_config(path, batch=13, n=5), "local")
    assert check_multi_turn(_config(path, batch=16, n=4), "local")["sandboxes"]["capacity"] == 64


def test_preflight_of_a_cluster_preset_against_its_services_capacity(monkeypatch, caplog):
    """``dapo_retool_qwen3_4b`` (``cluster.sandbox_service: ags-shanghai``, the shipped ``session: call`` config):
    128 x 8 trajectories, at most max_concurrency 32 x 8 rollout workers = 256 calls at once. A service capacity of
    100 in ``$PIPELINE_SANDBOX_SERVICES`` is refused in one line naming the settings; 256 passes; without a capacity
    the pre-flight warns and goes on."""
    from pipeline_steps.errors import UserError
    from pipeline_steps.training import experiment, sandbox_services
    from pipeline_steps.training.preflight_checks import preflight

    def services(capacity=None):
        svc = {"domain": "ap-shanghai.tencentags.com", "secret": "ags-api-key"}
        if capacity is not None:
            svc["capacity"] = capacity
        monkeypatch.setenv(sandbox_services.SANDBOX_SERVICES_ENV, json.dumps({"ags-shanghai": svc}))

    exp = experiment.load("dapo_retool_qwen3_4b")
    services(100)
    with pytest.raises(UserError) as err:
        preflight(exp, check_store=False)
    line = str(err.value)
    print(f"\npre-flight: {line}")
    assert "\n" not in line
    for part in ("data.train_batch_size=128", "actor_rollout_ref.rollout.n=8", "max_concurrency=32", "256 sandboxes"):
        assert part in line, line
    assert "$PIPELINE_SANDBOX_SERVICES['ags-shanghai'].capacity" in line and "holds 100" in line
    services(256)
    assert preflight(exp, check_store=False)["sandboxes"] == {"at_once": 256, "capacity": 256, "session": "call"}
    services()
    with caplog.at_level(logging.WARNING):
        assert preflight(exp, check_store=False)["sandboxes"]["capacity"] is None
    assert any("capacity of cluster.sandbox_service=ags-shanghai" in r.getMessage() for r in caplog.records)
    services("many")
    with pytest.raises(UserError, match=r"capacity='many': sandboxes the service holds at once"):
        preflight(exp, check_store=False)


def _agent_data(request_id: str):
    from verl.experimental.agent_loop.tool_agent_loop import AgentData

    return AgentData([], None, None, None, None, {}, request_id, {})


@needs_root
def test_parallel_calls_of_a_trajectory_share_one_sandbox_and_a_closed_loop_still_kills_it(e2b_env, tmp_path):
    """Two calls of one trajectory at once (``multi_turn.max_parallel_calls``) get one sandbox, not one each (the
    second one used to be left to the timeout); and a trajectory whose event loop has closed before its AgentData
    goes still has its sandbox killed (through the SDK's synchronous API)."""
    import gc

    from verl.tools.tool_registry import initialize_tools_from_config

    (tool,) = initialize_tools_from_config(_tool_config(tmp_path))
    data = _agent_data("same-trajectory")

    async def calls(data):
        a, b = await asyncio.gather(
            tool.execute("i1", {"code": "x = 1"}, agent_data=data),
            tool.execute("i2", {"code": "y = 2"}, agent_data=data),
        )
        return a, b, len(_live(e2b_env)), await tool.execute("i3", {"code": "x + y"}, agent_data=data)

    a, b, during, c = asyncio.run(calls(data))  # the loop is closed when this returns
    assert during == 1 and c[0].text == "3", (during, a, b, c)
    del data
    gc.collect()
    left, waited = _wait_until_none_live(e2b_env, scaled(15))
    assert left == [], f"{len(left)} sandboxes alive {waited:.1f} s after the trajectory's AgentData went"
