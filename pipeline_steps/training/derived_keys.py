"""The verl keys the pipeline derives for a run, in one place: where the data, the model and the run's outputs are.

:func:`derived_keys` gives them from a run's :class:`~pipeline_steps.planning.layout.RunLayout` and its inputs; each
backend adds only what it must on top:

* the train task (pre-flight, and the RayJob it renders): the store URIs as they are;
* ``train-local`` (the local job): the local copies of the inputs and the run directory, ``trainer.device=cpu``;
* the RayJob's entrypoint (:mod:`pipeline_steps.training.rayjob_manifest`): the locations as paths on the pods' bucket
  mounts (``where=mounts.to_pod_path``), and the rollout dump unless the preset or the form names one.

They go between the preset and the user's overrides (:func:`pipeline_steps.training.experiment.merged`): the
overrides table refuses a user override of a derived key (:mod:`pipeline_steps.training.overrides`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipeline_steps import library_env
from pipeline_steps.planning.layout import RunLayout


def derived_keys(
    layout: RunLayout,
    *,
    train_files: Sequence[str] | None = None,
    val_files: Sequence[str] | None = None,
    model_path: str | None = None,
    rollouts: bool = False,
    where: Callable[[str], str] = str,
) -> dict:
    """The verl keys derived for a run.

    :param layout: the run's locations (``trainer.default_local_dir`` is its ``checkpoints``)
    :param train_files: ``data.train_files`` (left out when None: already in the experiment)
    :param val_files: ``data.val_files``
    :param model_path: ``actor_rollout_ref.model.path``
    :param rollouts: also ``trainer.rollout_data_dir`` (the layout's ``rollouts``: where the run report reads
        trajectories)
    :param where: a location as the job sees it (the identity; a pod path on KubeRay)
    """
    keys: dict = {}
    if train_files is not None:
        keys["data.train_files"] = [where(str(f)) for f in train_files]
    if val_files is not None:
        keys["data.val_files"] = [where(str(f)) for f in val_files]
    if model_path is not None:
        keys["actor_rollout_ref.model.path"] = where(str(model_path))
    keys["trainer.default_local_dir"] = where(layout.checkpoints)
    keys["trainer.resume_mode"] = "auto"  # a retried job continues from the run's last checkpoint
    if rollouts:
        keys["trainer.rollout_data_dir"] = where(layout.rollouts)
    return keys


def derived_env(layout: RunLayout, *, tensorboard: bool, where: Callable[[str], str] = str) -> dict[str, str]:
    """The environment verl's loggers read for the run's locations: the file logger's metrics, and TensorBoard's
    directory when ``trainer.logger`` has it (verl's default goes with the job's working directory)."""
    env = {library_env.VERL_FILE_LOGGER_PATH: where(layout.metrics)}
    if tensorboard:
        env[library_env.TENSORBOARD_DIR] = where(layout.tensorboard)
    return env
