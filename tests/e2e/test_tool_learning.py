"""A tool-using policy that learns on CPU (issue 26, item 5).

``test_the_tool_schema_and_markers_reach_the_model`` (fast): the tiny tool model's chat template renders the code
tool's schema into the prompt verl's agent loop builds, and the hermes markers are single tokens. The plain tiny
model failed both (its template dropped ``tools``; ``<tool_call>`` was eleven tokens), and in 160 trajectories it
never called the tool.

``test_the_policy_learns_to_call_the_tool`` (slow, root): ``make demo-tools``'s two runs (``scripts/demo_tools.py``:
the ``local_tool_learning`` preset through ``train-local``, verl's ToolAgentLoop, the code tool on the local sandbox
server, no scripted turn) and the control without the tool: the tool-call rate and the reward of the last steps
must beat the first steps' by a clear margin, and the control must end lower than the tool run.
``test_the_reward_rises_with_the_calls``: the same runs' reward rises by at least ``REWARD_GAIN``, and the control's
stays below the tool run's by as much: the reward is earned through the tool, not by learning likely answers.
"""

from __future__ import annotations

import os

import pytest

CALL_RATE_GAIN = 0.2  # last-K tool-call rate over first-K, at least
REWARD_GAIN = 0.2  # last-K mean reward over first-K, at least (0.40 measured, 0.0 before digits were tokens apart)
E2B = ("E2B_DOMAIN", "E2B_API_URL", "E2B_API_KEY", "E2B_SANDBOX_URL")


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    from pipeline_steps import settings
    from pipeline_steps.local import tiny_tool_model

    return tiny_tool_model.build_cached(settings.cache_dir(), tmp_path_factory.mktemp("tiny-tool"))


@pytest.mark.slow  # about 8 s of CPU: the tiny tool model's tokenizer built
def test_the_tool_schema_and_markers_reach_the_model(tmp_path):
    from transformers import AutoTokenizer
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    from pipeline_steps.local import tiny_tool_model

    model = tiny_tool_model.build(tmp_path / "m", warmup_steps=0)  # the tokenizer and template; no warm-up
    tok = AutoTokenizer.from_pretrained(model)  # as every stage loads it
    for marker in tiny_tool_model.TOOL_TOKENS:
        assert len(tok.encode(marker, add_special_tokens=False)) == 1, marker
    schemas = tiny_tool_model.tool_schemas()
    builder = create_continuous_token_builder(tok)  # what verl's agent loop builds prompts with
    prompt = tok.decode(builder.build_initial_tokens(tiny_tool_model.prompt_messages(347, 812), tools=schemas))
    assert '"name": "code_interpreter"' in prompt and "<tools>" in prompt
    assert "What is 347 * 812?" in prompt
    # a number is the same tokens in the question and in the code (digits apart): copying it is copying, not a
    # translation between " 347" and "347" merges
    assert tok.encode(" 347", add_special_tokens=False)[-3:] == tok.encode("347", add_special_tokens=False)
    assert len(tok.encode("347", add_special_tokens=False)) == 3
    # a call the model writes is one verl's hermes parser reads back
    ids = tok.encode(tiny_tool_model.call_text(347, 812), add_special_tokens=False)
    assert tok.decode(ids) == tiny_tool_model.call_text(347, 812)
    assert ids[0] == tok.convert_tokens_to_ids("<tool_call>")


@pytest.fixture(scope="module")
def runs(tool_model, tmp_path_factory):
    """``make demo-tools``'s two runs: the tool run and the control."""
    from scripts import demo_tools

    saved = {k: os.environ.pop(k) for k in E2B if k in os.environ}  # the trainer starts the local sandbox server
    try:
        out = tmp_path_factory.mktemp("tool-learning")
        result = demo_tools.run(out, model=tool_model)
    finally:
        os.environ.update(saved)
    print(demo_tools.report(result, out))
    assert (out / "tool_learning.png").stat().st_size > 0
    return result


@pytest.mark.slow
@pytest.mark.needs_root(reason="the local sandbox server needs root")
# the two runs and the model build (300 warm-up steps): 53 s + 54 s + ~30 s alone on an idle machine (2026-11-27)
@pytest.mark.budget(900)
def test_the_policy_learns_to_call_the_tool(runs):
    tool, control = runs["ends"]["tool"], runs["ends"]["control"]
    assert tool["tool_call_rate"][1] >= tool["tool_call_rate"][0] + CALL_RATE_GAIN, tool
    assert all(s["tool_call_rate"] == 0 for s in runs["runs"]["control"]["steps"]), control
    assert control["reward"][1] <= tool["reward"][1], (control, tool)


@pytest.mark.slow
@pytest.mark.needs_root(reason="the local sandbox server needs root")
def test_the_reward_rises_with_the_calls(runs):
    tool, control = runs["ends"]["tool"], runs["ends"]["control"]
    assert tool["reward"][1] >= tool["reward"][0] + REWARD_GAIN, tool
    assert control["reward"][1] < tool["reward"][1] - REWARD_GAIN, (control, tool)
