"""Pre-flight of verl tool configs: the shipped ones pass; a bad one fails in one line naming the entry."""

from __future__ import annotations

from importlib.resources import files

import pytest
import yaml

from pipeline_steps.errors import UserError
from pipeline_steps.tools.tool_config_check import check_tool_config

SHIPPED = files("pipeline_steps.tools")


def test_shipped_configs_pass():
    assert check_tool_config(str(SHIPPED / "code_sandbox.yaml")) == ["code_interpreter"]
    assert check_tool_config(str(SHIPPED / "mcp_tool.yaml")) == ["pipeline_steps.tools.mcp_tool.MCPTool"]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.update(class_name="pipeline_steps.tools.code_sandbox.Nope"), "not importable"),
        (lambda t: t.update(class_name="no_such_package.Tool"), "not importable"),
        (lambda t: t.update(class_name="pipeline_steps.tools.code_sandbox.DEFAULTS"), "not a verl BaseTool"),
        (lambda t: t["config"].update(type="mcp"), "config.type must be 'native'"),
        (lambda t: t["tool_schema"]["function"].pop("name"), "tool_schema is not a valid"),
    ],
)
def test_bad_entries_fail_in_one_line(tmp_path, change, message):
    spec = yaml.safe_load((SHIPPED / "code_sandbox.yaml").read_text())
    change(spec["tools"][0])
    bad = tmp_path / "tools.yaml"
    bad.write_text(yaml.safe_dump(spec))
    with pytest.raises(UserError, match=message) as err:
        check_tool_config(str(bad))
    assert "\n" not in str(err.value) and "tools[0]" in str(err.value)


def test_preflight_checks_a_readable_tool_config(tmp_path):
    from pipeline_steps.training import experiment
    from pipeline_steps.training.preflight_checks import preflight

    mt = "actor_rollout_ref.rollout.multi_turn."
    overrides = [
        f"{mt}enable=true",
        f"{mt}format=hermes",
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
    ]
    good = experiment.load(
        "dapo_qwen3_4b", overrides + [f"{mt}tool_config_path=pkg:pipeline_steps.tools/code_sandbox.yaml"]
    )
    assert preflight(good, check_store=False)["tools"] == ["code_interpreter"]
    # a tool config of the deployment's own comes with its preset (a run's overrides may name only shipped ones)
    bad = tmp_path / "tools.yaml"
    bad.write_text("tools: []\n")
    spec = yaml.safe_load(experiment.resolve_path("dapo_qwen3_4b").read_text())
    spec["name"] = "team_dapo"
    spec["verl"][f"{mt}tool_config_path"] = str(bad)
    preset = tmp_path / "team_dapo.yaml"
    preset.write_text(yaml.safe_dump(spec))
    with pytest.raises(UserError, match="non-empty 'tools:' list"):
        preflight(experiment.load(str(preset), overrides), check_store=False)
