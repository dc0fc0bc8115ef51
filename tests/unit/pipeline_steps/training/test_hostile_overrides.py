"""Nothing a user types is instantiated: hostile verl overrides through the real CLI and through the DAG's plan.

Before the fix, ``+actor_rollout_ref.actor.x={_target_: builtins.open, _args_: ["<file>","w"]}`` reached verl's
``validate_config`` in pre-flight, whose Hydra instantiation truncated the file inside the Airflow worker. Each
payload below names a sentinel file; after the refused run the sentinel must be byte-identical and no new file may
appear beside it.
"""

from __future__ import annotations

import pytest

from pipeline_steps.errors import UserError
from tests.helpers.step_cli import run_step

SENTINEL_TEXT = "precious\n"

# (override template, what the one-line error must mention); {s} is the sentinel path, {d} a path beside it
HOSTILE = [
    ('+actor_rollout_ref.actor.x={{_target_: builtins.open, _args_: ["{s}", "w"]}}', "_target_"),
    ('actor_rollout_ref.actor.optim={{_target_: shutil.copyfile, _args_: ["{s}", "{d}"]}}', "_target_"),
    ("+actor_rollout_ref.actor._target_=builtins.open", "_target_"),
    ('++actor_rollout_ref.x=[{{_target_: builtins.open, _args_: ["{s}", "w"]}}]', "_target_"),
    ('+x={{a: {{b: {{_target_: builtins.open, _args_: ["{s}", "w"]}}}}}}', "_target_"),
    ('+x=[1, [2, {{_args_: ["{s}", "w"]}}]]', "_args_"),
    ("+x={{_partial_: true, _recursive_: false}}", "_partial_"),
    ("+trainer._convert_=all", "_convert_"),
    ("+x={{_self_: 1}}", "_self_"),
    ("trainer.experiment_name=${{oc.env:HOME}}", "interpolation"),
    ('trainer.experiment_name="${{oc.env:AWS_SECRET_ACCESS_KEY}}"', "interpolation"),
    ('+x={{a: "${{oc.env:HF_TOKEN}}"}}', "interpolation"),
    ("trainer.project_name=${{trainer.experiment_name}}", "interpolation"),
    ('+x="{{_target_: builtins.open}}"', "_target_"),
    ("hydra.run.dir={d}", "Hydra's own"),
    ("+hydra.job.chdir=true", "Hydra's own"),
    ("~trainer.logger", "deleting"),
    ("~actor_rollout_ref.model.path", "deleting"),
    ("data.train_files={s}", "set by the pipeline"),
    ("+data.val_files=[{s}]", "set by the pipeline"),
    ("++actor_rollout_ref.model.path={d}", "set by the pipeline"),
    ("trainer.default_local_dir=oss://bkt/models/exported/gsm8k", "set by the pipeline"),
    ("trainer.resume_mode=resume_path", "set by the pipeline"),
    ("trainer.resume_from_path={d}", "set by the pipeline"),
]


@pytest.fixture
def sentinel(tmp_path):
    s = tmp_path / "secret.txt"
    s.write_text(SENTINEL_TEXT)
    s.chmod(0o600)
    return s


@pytest.mark.parametrize("template,needle", HOSTILE, ids=[h[0][:40] for h in HOSTILE])
def test_preflight_cli_refuses_in_one_line_and_runs_nothing(template, needle, sentinel, tmp_path):
    override = template.format(s=sentinel, d=tmp_path / "copied.txt")
    code, summary, err = run_step(
        "preflight", "--experiment", "local_tiny", "--skip-store-check", f"--override={override}"
    )
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0] and "Traceback" not in err
    assert summary["ok"] is False
    assert sentinel.read_text() == SENTINEL_TEXT  # not truncated
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret.txt"]  # nothing copied beside it


def test_the_plan_task_refuses_form_overrides_before_any_step_runs(sentinel):
    from pipeline_steps.planning import plan

    params = {
        "experiment": "local_tiny",
        "verl_overrides": [f'+actor_rollout_ref.actor.x={{_target_: builtins.open, _args_: ["{sentinel}", "w"]}}'],
    }
    with pytest.raises(UserError, match="_target_") as err:
        plan.plan(params, None, "manual__1", "verl_grpo_pipeline")
    assert "\n" not in str(err.value)
    assert sentinel.read_text() == SENTINEL_TEXT


# Code verl imports, typed into the trigger form: pre-flight would import a reward file in the Airflow worker, verl
# imports the rest in the training pods. (A step's own --override is typed by someone with a shell: allowed there.)
FORM_CODE = [
    ("+reward.custom_reward_function.path={s}", "names code"),
    ("+reward={{custom_reward_function: {{path: {s}, name: main}}}}", "names code"),
    ("actor_rollout_ref.rollout.multi_turn.tool_config_path={s}", "names code"),
    ("actor_rollout_ref.rollout.agent.agent_loop_config_path={s}", "names code"),
    ("+actor_rollout_ref.rollout.agent={{agent_loop_config_path: {s}}}", "names code"),
    ("+data.custom_cls={{path: {s}, name: X}}", "names code"),
    ("actor_rollout_ref.model.external_lib=os", "names a module or class"),
    ("+trainer.checkpoint_callback_class=builtins.open", "names a module or class"),
]


@pytest.mark.parametrize("template,needle", FORM_CODE, ids=[h[0][:40] for h in FORM_CODE])
def test_the_form_may_not_name_code_for_verl_to_import(template, needle, sentinel):
    from pipeline_steps.planning import plan

    params = {"experiment": "local_tiny", "verl_overrides": [template.format(s=sentinel)]}
    with pytest.raises(UserError, match=needle) as err:
        plan.plan(params, None, "manual__1", "verl_grpo_pipeline")
    assert "\n" not in str(err.value)


def test_the_form_may_not_name_code_files_even_shipped_ones():
    """Issue 46: the form sets only the keys of the reviewed table (pipeline_steps/training/form_keys.py), and no path:
    a file the package ships passes the code check, then the allow-list refuses it; a preset may name it."""
    from pipeline_steps.planning import plan

    for shipped in (
        "+reward.custom_reward_function.path=pkg:pipeline_steps.rewards/retool.py",
        "actor_rollout_ref.rollout.agent.agent_loop_config_path=pkg:pipeline_steps.rollouts/mcp_math_loop.yaml",
    ):
        params = {"experiment": "local_tiny", "verl_overrides": [shipped]}
        with pytest.raises(UserError, match="names a file or directory") as err:
            plan.plan(params, None, "manual__1", "verl_grpo_pipeline")
        assert "\n" not in str(err.value) and "set it in a preset" in str(err.value)
    # the same files from a preset: planned
    out = plan.plan({"experiment": "local_tiny_custom_rollout"}, None, "manual__1", "verl_grpo_pipeline")
    assert out["preset"]["verl"]["actor_rollout_ref.rollout.agent.agent_loop_config_path"].startswith("pkg:")


LOOPS = "actor_rollout_ref.rollout.agent.agent_loop_config_path"
# pkg: names that no installed package ships: the form would hand verl a loop file of its choosing
UNSHIPPED = [
    (LOOPS + "=pkg:pipeline_steps.rollouts/missing.yaml", "no file 'missing.yaml'"),
    (LOOPS + "=pkg:pipeline_steps.rollouts/{up}{s}", "without '..'"),  # out of the package to any file
    (LOOPS + "=pkg:pipeline_steps.rollouts/../tools/mcp_tool.yaml", "without '..'"),  # a file, not a loop config
    (LOOPS + "=pkg:pipeline_steps.rollouts//{s}", "without '..'"),
    (LOOPS + "=pkg:no_such_package_xyz/loops.yaml", "not an installed package"),
    (LOOPS + "=pkg:os/loops.yaml", "not an installed package"),  # a module, not a package
    ("+actor_rollout_ref.rollout.agent={{agent_loop_config_path: 'pkg:pipeline_steps.rollouts/{up}{s}'}}", "'..'"),
    ("+reward.custom_reward_function.path=pkg:pipeline_steps.rewards/{up}{s}", "without '..'"),
]


@pytest.mark.parametrize("template,needle", UNSHIPPED, ids=[u[0][-40:] for u in UNSHIPPED])
def test_the_form_may_not_name_a_file_no_package_ships(template, needle, sentinel):
    from pipeline_steps.planning import plan

    override = template.format(s=str(sentinel).lstrip("/"), up="../" * 30)
    params = {"experiment": "local_tiny", "verl_overrides": [override]}
    with pytest.raises(UserError, match="not a file the package or the deployment ships") as err:
        plan.plan(params, None, "manual__1", "verl_grpo_pipeline")
    message = str(err.value)
    assert "\n" not in message and needle in message and "verl_overrides" in message, message
    assert "choose an existing pkg: file or set it in a preset" in message
    assert sentinel.read_text() == SENTINEL_TEXT


def test_a_deployment_preset_cannot_smuggle_instantiation_either(tmp_path, monkeypatch, sentinel):
    preset = tmp_path / "presets" / "team.yaml"
    preset.parent.mkdir()
    preset.write_text(
        "name: team\nbackend: local\nverl:\n"
        f'  +actor_rollout_ref.actor.x: {{_target_: builtins.open, _args_: ["{sentinel}", "w"]}}\n'
    )
    code, _, err = run_step("preflight", "--experiment", str(preset), "--skip-store-check")
    assert code == 2 and "_target_" in err and err.count("\n") == 1
    assert sentinel.read_text() == SENTINEL_TEXT


@pytest.mark.slow  # about 9 s of CPU: verl's config composed for each
def test_benign_overrides_still_work(tmp_path):
    code, summary, err = run_step(
        "preflight",
        "--experiment",
        "local_tiny",
        "--skip-store-check",
        "--override=actor_rollout_ref.actor.optim.lr=2e-6",
        "--override=trainer.experiment_name=a'b$(id)_target",
        "--override=+trainer.my_note={a: 1, b: [x, y]}",
        "--override=+reward.custom_reward_function.path=pkg:pipeline_steps.rewards/retool.py",  # shipped code
    )
    assert code == 0, err
    assert summary["ok"] is True
