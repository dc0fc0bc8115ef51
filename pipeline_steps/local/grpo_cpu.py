"""GRPO on CPU for the local backend: Hugging Face generation, verl's mathematics.

``main_ppo`` cannot run without GPUs, so this small trainer runs the same loop on
CPU, driven by the same composed verl config (``pipeline_steps.training.experiment.compose``):

* rollout: ``transformers`` ``generate`` with ``actor_rollout_ref.rollout`` sampling
  settings, ``rollout.n`` responses per prompt;
* rewards: ``verl.utils.reward_score.default_compute_score``, or verl's own seam
  ``reward.custom_reward_function.{path,name}`` (loaded with verl's
  ``get_custom_reward_fn``), or a ``reward_fn`` argument (tests, benchmarks);
* advantages, policy loss, loss aggregation, KL: ``verl.trainer.ppo.core_algos``
  (``get_adv_estimator_fn(algorithm.adv_estimator)``,
  ``get_policy_loss_fn(actor.policy_loss.loss_mode)``, ``agg_loss`` with
  ``actor.loss_agg_mode`` and the global-batch normalisation verl uses,
  ``kl_penalty`` against a frozen reference copy when ``use_kl_loss``);
* optimiser and LR schedule: verl's ``build_optimizer`` and warmup schedules;
* metrics: verl's ``compute_data_metrics``/``compute_timing_metrics``/
  ``compute_throughout_metrics`` logged through verl's ``Tracking`` with the config's
  ``trainer.logger`` backends (console, mlflow, ...) and always verl's ``FileLogger``
  format (``{"step": N, "data": {...}}`` per line);
* checkpoints: the actor is wrapped with FSDP2 (``fully_shard``) in a 1-process
  gloo group, so verl's own ``FSDPCheckpointManager`` writes the files its model
  merger reads (``model/optim/extra_state_world_size_1_rank_0.pt``,
  ``fsdp_config.json``, ``huggingface/``).

Determinism and resume: the sampling RNG is reseeded from (seed, step) at every
step and the data order is a pure function of (seed, epoch), so a run resumed from
``global_step_N`` (model, optimiser, LR schedule and RNG restored by verl's
checkpoint manager) produces the same steps N+1.. as an uninterrupted run.
A checkpoint directory is built aside and renamed into place;
``latest_checkpointed_iteration.txt`` is written after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Callable

from pipeline_steps import atomic, library_env, metrics_log, tracking_run
from pipeline_steps.constants import CHECKPOINT_TRACKER
from pipeline_steps.errors import UserError
from pipeline_steps.evaluation.generation import image_inputs, vision_inputs, vision_token_ids
from pipeline_steps.planning.layout import RunLayout

log = logging.getLogger(__name__)

TRACKER = CHECKPOINT_TRACKER
GROUP_KEY = "reward.custom_reward_function.group_name"  # local backend only: verl 0.9.1 scores per sample
LOCAL_REWARD_MANAGERS = ("naive",)  # verl reward managers the CPU trainer reproduces
# verl settings the CPU trainer does not reproduce: refused in one line when set away from verl's default
_NOT_REPRODUCED = {
    "algorithm.filter_groups.enable": (False, "DAPO dynamic sampling (group filtering and refill)"),
    "data.train_max_samples": (-1, "verl's RLHFDataset sub-sampling"),
}

RewardFn = Callable[..., "float | dict"]


@dataclasses.dataclass
class Prompt:
    input_ids: list[int]
    data_source: str
    ground_truth: object
    extra_info: dict
    messages: list | None = None  # the chat, for verl's agent loops (multi-turn)
    agent_name: str | None = None
    mm: dict | None = None  # an image row's processor outputs (pixel_values, image_grid_thw), as verl's rollout makes
    images: list | None = None  # its images' bytes (the report's thumbnails, the evaluation)


def reads_images(model_path) -> bool:
    """Does the model at ``model_path`` read images (a ``vision_config`` in its config.json)?"""
    import json

    try:
        return bool(json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8")).get("vision_config"))
    except (OSError, ValueError):
        return False


# ----------------------------------------------------------------------------- data


def load_prompts(files, tokenizer, data_cfg, processor=None) -> list[Prompt]:
    """Read verl-schema parquet files and tokenize each prompt with the chat template; an image row (``data.image_key``)
    through ``processor`` (verl's own code: :func:`~pipeline_steps.evaluation.generation.image_inputs`), refused in
    one line when the model has none."""
    import pyarrow.parquet as pq

    image_key = data_cfg.get("image_key", "images")

    prompt_key = data_cfg.get("prompt_key", "prompt")
    source_key = data_cfg.get("reward_fn_key", "data_source")
    max_len = int(data_cfg.max_prompt_length)
    truncation = data_cfg.get("truncation", "error")
    drop_long = bool(data_cfg.get("filter_overlong_prompts", False))
    out: list[Prompt] = []
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise UserError(f"data file {f}: not found; pass parquet files written by the preprocess step")
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:
            raise UserError(
                f"data file {f}: not readable as parquet ({exc.__class__.__name__}); pass the preprocess step's output"
            ) from None
        for i, row in enumerate(rows):
            missing = [c for c in (prompt_key, source_key, "reward_model") if c not in row]
            if missing:
                raise UserError(
                    f"data file {f}: missing column(s) {missing}; "
                    "expected verl's schema (data_source, prompt, ability, reward_model, extra_info)"
                )
            messages = row[prompt_key]
            if not (
                isinstance(messages, list)
                and messages
                and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
            ):
                raise UserError(
                    f"data file {f} row {i}: {prompt_key!r} must be a list of chat messages with role and content"
                )
            rm = row["reward_model"]
            if not isinstance(rm, dict) or "ground_truth" not in rm:
                raise UserError(f"data file {f} row {i}: reward_model must hold a ground_truth")
            mm = None
            if row.get(image_key):
                if processor is None:
                    raise UserError(
                        f"data file {f} row {i}: has images ({image_key!r}) but the model has no image processor; "
                        "train a vision-language model (preset local_tiny_vl) or a text dataset"
                    )
                try:
                    ids, mm = image_inputs(row, messages, processor, data_cfg)  # verl's own code, as the cluster
                except Exception as exc:  # verl's filter would drop it silently: say which row and why
                    raise UserError(
                        f"data file {f} row {i}: its images could not be processed ({exc.__class__.__name__}: "
                        f"{str(exc).splitlines()[0][:160] if str(exc) else ''})"
                    ) from None
            else:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > max_len and mm is not None and not drop_long:  # image tokens cannot be cut
                raise UserError(
                    f"data file {f} row {i}: prompt has {len(ids)} tokens with its image > "
                    f"data.max_prompt_length={max_len}; raise it or lower data.mm_processor_kwargs.max_pixels"
                )
            if len(ids) > max_len:
                if drop_long:
                    continue
                if truncation == "left":
                    ids = ids[-max_len:]
                elif truncation == "right":
                    ids = ids[:max_len]
                elif truncation == "middle":
                    ids = ids[: max_len // 2] + ids[len(ids) - (max_len - max_len // 2) :]
                else:
                    raise UserError(
                        f"data file {f} row {i}: prompt has {len(ids)} tokens > data.max_prompt_length={max_len}; "
                        "raise data.max_prompt_length, or set data.truncation=left|right|middle or "
                        "data.filter_overlong_prompts=true"
                    )
            extra = dict(row.get("extra_info") or {})  # a JSONL row's rollout_extra is a parquet struct: a dict here
            images = [im.get("bytes") for im in row[image_key]] if mm is not None else None
            out.append(
                Prompt(
                    ids, str(row[source_key]), rm["ground_truth"], extra, messages, row.get("agent_name"), mm, images
                )
            )
    return out


def _advantage_probe(algorithm_cfg, estimator: str) -> str | None:
    """Why verl's ``compute_advantage`` fails for ``estimator`` on what this trainer has (None when it runs).

    The same call as :meth:`GRPOTrainerCPU.advantages` on a 2x2 batch: an estimator that needs critic values,
    reward baselines, actor statistics or per-component rewards fails here as it would at step 1, before any model
    is loaded.
    """
    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage
    from verl.utils.config import omega_conf_to_dataclass

    cfg = OmegaConf.merge(algorithm_cfg, {"adv_estimator": estimator})
    data = DataProto.from_dict(
        tensors={"token_level_rewards": torch.tensor([[0.0, 1.0], [0.0, 0.0]]), "response_mask": torch.ones(2, 2)},
        non_tensors={"uid": np.array(["a", "a"], dtype=object)},
    )
    try:
        compute_advantage(
            data,
            adv_estimator=estimator,
            num_repeat=2,
            norm_adv_by_std_in_grpo=bool(cfg.get("norm_adv_by_std_in_grpo", True)),
            config=omega_conf_to_dataclass(cfg),
        )
    except Exception as e:  # verl raises KeyError, TypeError or AssertionError for a missing input
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return None


def _as_list(v) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    return [str(x) for x in v]


# ----------------------------------------------------------------------------- logging


def _file_logger(path: Path, keep_through_step: int):
    """verl's ``FileLogger`` (same line format), appending after the lines of checkpointed steps.

    verl's own constructor truncates the file; on resume the lines of steps that are
    already in the checkpoint must stay, and lines of steps after it are dropped
    because those steps run again (the cluster entrypoint keeps them the same way).
    """
    from verl.utils.tracking import FileLogger

    atomic.write_bytes(path, metrics_log.history_through(path, keep_through_step))
    logger = FileLogger.__new__(FileLogger)
    logger.project_name, logger.experiment_name, logger.filepath = "", "", str(path)
    logger.fp = open(path, "ab", buffering=0)
    return logger


def _tracking(cfg, path: Path, keep_through_step: int, run_file: Path, tensorboard_dir: Path):
    """verl's ``Tracking`` with the config's ``trainer.logger`` backends, so metric names match a cluster run's.

    The file backend is always ours (:func:`_file_logger`: resume keeps the checkpointed steps' lines; progress and
    the report read it). The mlflow backend needs ``$MLFLOW_TRACKING_URI``: without it verl would write to its own
    default ``/tmp/mlruns.db``, so it is left out with a warning. A resumed attempt continues the MLflow run of the
    attempt before it (its id is kept beside the checkpoints; verl attaches to ``$MLFLOW_RUN_ID``). verl's
    tensorboard backend writes its event files to ``tensorboard_dir`` (the run directory's ``tensorboard/``, given to
    verl as ``$TENSORBOARD_DIR``), so they travel with the run; a resumed attempt adds an event file there, and
    TensorBoard drops the first attempt's steps after the checkpoint (its out-of-order-step purge).

    :returns: (the tracking, the MLflow record or None, the tensorboard directory or None)
    """
    from omegaconf import OmegaConf
    from verl.utils.tracking import Tracking

    backends = [b for b in _as_list(cfg.trainer.get("logger")) if b != "file"]
    if "mlflow" in backends and not os.environ.get(library_env.MLFLOW_TRACKING_URI):
        log.warning("trainer.logger has mlflow but MLFLOW_TRACKING_URI is not set: not logging to MLflow")
        backends.remove("mlflow")
    previous = (tracking_run.read(run_file) or {}).get("run_id") if keep_through_step > 0 else None
    env = {}  # what verl's loggers read from the environment while they start
    if "mlflow" in backends and previous and not os.environ.get(library_env.MLFLOW_RUN_ID):
        env[library_env.MLFLOW_RUN_ID] = previous
    if "tensorboard" in backends:
        env[library_env.TENSORBOARD_DIR] = str(tensorboard_dir)
    with library_env.scoped(env):
        tracking = Tracking(
            project_name=cfg.trainer.get("project_name") or "verl_grpo_pipeline",
            experiment_name=cfg.trainer.get("experiment_name") or "local",
            default_backend=backends,
            config=OmegaConf.to_container(cfg, resolve=True),
        )
    tracking.logger["file"] = _file_logger(path, keep_through_step)
    run = None
    if "mlflow" in tracking.logger:
        import mlflow

        info = mlflow.active_run().info
        run = tracking_run.record(os.environ[library_env.MLFLOW_TRACKING_URI], info.run_id, info.experiment_id)
        atomic.write_json(run_file, run)
    tb = tensorboard_dir if "tensorboard" in tracking.logger else None
    if tb is not None:
        log.info("TensorBoard event files in %s: tensorboard --logdir %s", tb, tb)
    return tracking, run, tb


def read_metrics(path) -> list[dict]:
    """The file logger's lines as ``{"step": N, "data": {...}}`` dicts."""
    return metrics_log.read(path).rows


# ----------------------------------------------------------------------------- trainer


@contextlib.contextmanager
def process_group():
    """A 1-process gloo group (FSDP2 and verl's checkpoint manager need one); reused if one exists."""
    import torch.distributed as dist

    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        created = True
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


@contextlib.contextmanager
def verl_locks_in(directory: Path):
    """verl's ``local_mkdir_safe`` takes a ``ckpt_<hash of the path>.lock`` in the temporary directory for each folder
    of a checkpoint and never removes it. Each save here writes a fresh temporary path that only this process writes,
    so each save would leave new lock files in /tmp for good: they go to ``directory`` instead, removed after."""
    import shutil
    import tempfile

    directory.mkdir()
    before, tempfile.tempdir = tempfile.tempdir, str(directory)
    try:
        yield
    finally:
        tempfile.tempdir = before
        shutil.rmtree(directory, ignore_errors=True)


class GRPOTrainer:
    """One GRPO actor on CPU. Build inside :func:`process_group`.

    :param cfg: the composed verl config (OmegaConf), with ``data.train_files``,
        ``actor_rollout_ref.model.path`` and ``trainer.default_local_dir`` set.
    :param reward_fn: optional ``fn(data_source, solution_str, ground_truth, extra_info) -> float|dict``;
        overrides the config's custom reward function and verl's default scorer.
    :param metrics_path: JSON-lines metrics file (default ``$VERL_FILE_LOGGER_PATH``).
    """

    def __init__(self, cfg, reward_fn: RewardFn | None = None, metrics_path: str | os.PathLike | None = None):
        import torch
        from omegaconf import OmegaConf

        self.cfg = cfg
        actor = cfg.actor_rollout_ref.actor
        rollout = cfg.actor_rollout_ref.rollout
        self.n = int(rollout.n)
        self.batch_size = int(cfg.data.train_batch_size)
        self.response_length = int(rollout.get("response_length") or cfg.data.max_response_length)
        self.temperature = float(rollout.temperature)
        self.seed = int(rollout.get("seed", 42) or 0)
        self.data_seed = int(cfg.data.seed) if cfg.data.get("seed") is not None else 1
        self.ckpt_root = Path(str(cfg.trainer.default_local_dir))
        self.layout = RunLayout.for_checkpoints(str(self.ckpt_root))  # the run directory holds the checkpoints
        self.metrics_path = Path(
            metrics_path or os.environ.get(library_env.VERL_FILE_LOGGER_PATH) or self.layout.metrics
        )
        self._validate()

        from verl.trainer.ppo import core_algos
        from verl.utils.config import omega_conf_to_dataclass

        self.core = core_algos
        self.actor_cfg = omega_conf_to_dataclass(actor)
        self.algo_cfg = omega_conf_to_dataclass(cfg.algorithm)
        self.policy_loss_fn = core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)
        manager = str((cfg.reward.get("reward_manager") or {}).get("name") or "naive")
        if manager not in LOCAL_REWARD_MANAGERS:  # dapo's overlong penalty, batch/prime managers: not here
            raise UserError(
                f"reward.reward_manager.name={manager!r}: the local CPU backend scores like verl's "
                f"{'/'.join(LOCAL_REWARD_MANAGERS)} reward manager only; use it locally or run on the kuberay backend"
            )
        self.reward_fn = reward_fn or self._configured_reward_fn()
        self.group_reward_fn = None if reward_fn else self._configured_group_fn()

        # Model, tokenizer, reference copy, FSDP2 wrap.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model_path = str(cfg.actor_rollout_ref.model.path)
        if not (Path(model_path) / "config.json").is_file():
            raise UserError(
                f"actor_rollout_ref.model.path {model_path}: no config.json; pass a Hugging Face model directory "
                "(build-tiny-model makes one)"
            )
        self.processor = None
        if reads_images(model_path):  # a vision-language model: its processor makes the image rows' inputs
            from transformers import AutoProcessor

            self.processor = AutoProcessor.from_pretrained(model_path)
            self.tokenizer = self.processor.tokenizer
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.pad_id = self.tokenizer.pad_token_id
        self.eos_ids = self._eos_ids(model_path)
        torch.manual_seed(self.seed)
        if self.processor is not None:
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.use_ref = bool(actor.use_kl_loss) or bool(cfg.algorithm.use_kl_in_reward)
        self.kl_ctrl_in_reward = None  # verl's KL controller for use_kl_in_reward, built on first use
        self.ref = None
        if self.use_ref:
            import copy

            self.ref = copy.deepcopy(model).eval().requires_grad_(False)
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        layers = model.model.language_model.layers if self.processor is not None else model.model.layers
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model

        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
        from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup
        from verl.workers.config.optimizer import build_optimizer

        self.train_prompts = load_prompts(_as_list(cfg.data.train_files), self.tokenizer, cfg.data, self.processor)
        if len(self.train_prompts) < self.batch_size:
            raise UserError(
                f"data.train_files hold {len(self.train_prompts)} usable prompts, fewer than "
                f"data.train_batch_size={self.batch_size}; lower the batch size or add data"
            )
        self.steps_per_epoch = len(self.train_prompts) // self.batch_size  # verl drops the last partial batch
        total = cfg.trainer.get("total_training_steps")
        self.total_steps = (
            int(total) if total not in (None, -1) else self.steps_per_epoch * int(cfg.trainer.total_epochs)
        )
        val_files = _as_list(cfg.data.get("val_files"))
        self.test_freq = int(cfg.trainer.get("test_freq", -1) or -1)
        self.val_before_train = bool(cfg.trainer.get("val_before_train", True))
        wants_val = (
            self.test_freq > 0 or self.val_before_train
        )  # verl validates before training even when test_freq <= 0
        self.val_prompts = (
            load_prompts(val_files, self.tokenizer, cfg.data, self.processor) if wants_val and val_files else []
        )
        self.total_epochs = int(cfg.trainer.total_epochs)

        optim_cfg = omega_conf_to_dataclass(actor.optim)
        self.optimizer = build_optimizer(self.model.parameters(), optim_cfg)
        warmup = int(optim_cfg.lr_warmup_steps)
        if warmup <= 0:
            warmup = int(optim_cfg.lr_warmup_steps_ratio * self.total_steps)
        if optim_cfg.lr_scheduler_type == "constant":
            self.lr_scheduler = get_constant_schedule_with_warmup(self.optimizer, num_warmup_steps=warmup)
        elif optim_cfg.lr_scheduler_type == "cosine":
            self.lr_scheduler = get_cosine_schedule_with_warmup(
                self.optimizer,
                num_warmup_steps=warmup,
                num_training_steps=self.total_steps,
                min_lr_ratio=optim_cfg.min_lr_ratio,
                num_cycles=optim_cfg.num_cycles,
                zero_indexed_step=optim_cfg.zero_indexed_step,
            )
        else:
            raise UserError(
                f"actor_rollout_ref.actor.optim.lr_scheduler_type={optim_cfg.lr_scheduler_type!r}: use constant or "
                "cosine"
            )
        self.clip_grad = float(optim_cfg.clip_grad)
        self.checkpoint = FSDPCheckpointManager(
            self.model,
            self.optimizer,
            self.lr_scheduler,
            processing_class=self.processor or self.tokenizer,  # a VL model's checkpoint keeps its processor
            checkpoint_config=OmegaConf.to_container(actor.checkpoint, resolve=True),
        )
        self._saved_steps: list[int] = []  # what max_actor_ckpt_to_keep counts, as verl's manager does (see save)
        self.logger = None
        self.last_metrics: dict = {}
        from pipeline_steps.local import agent_rollout

        # multi_turn.enable: rollouts through verl's agent loops (tool agent rows call their tools)
        self.agent = (
            agent_rollout.AgentRollout(cfg, self.model, self.tokenizer, self.eos_ids)
            if agent_rollout.enabled(cfg)
            else None
        )

    # -- configuration ---------------------------------------------------------

    def _validate(self):
        from omegaconf import OmegaConf
        from verl.trainer.ppo import core_algos
        from verl.utils.tracking import Tracking

        cfg = self.cfg
        unknown = [b for b in _as_list(cfg.trainer.get("logger")) if b not in Tracking.supported_backend]
        if unknown:  # verl's own check is an assert, after the model is loaded
            raise UserError(f"trainer.logger: {unknown} not supported by verl; use {Tracking.supported_backend}")
        actor = cfg.actor_rollout_ref.actor
        est = cfg.algorithm.adv_estimator
        if est not in core_algos.ADV_ESTIMATOR_REGISTRY:
            raise UserError(
                f"algorithm.adv_estimator={est!r} is unknown; choose one of {sorted(core_algos.ADV_ESTIMATOR_REGISTRY)}"
            )
        problem = _advantage_probe(cfg.algorithm, est)
        if problem:
            ok = sorted(k for k in core_algos.ADV_ESTIMATOR_REGISTRY if not _advantage_probe(cfg.algorithm, k))
            raise UserError(
                f"algorithm.adv_estimator={est!r} needs inputs the local CPU backend does not produce (it has "
                f"rewards, masks and group ids; no critic values, reward baselines or actor statistics): verl's "
                f"compute_advantage says {problem}; use one of {ok}, or run it on the cluster"
            )
        for key, (default, what) in _NOT_REPRODUCED.items():
            value = OmegaConf.select(cfg, key, default=default)
            if value != default:
                raise UserError(
                    f"{key}={value}: {what} is not reproduced by the local CPU backend; remove the override "
                    "or run on the cluster"
                )
        try:
            core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)
        except ValueError:
            raise UserError(
                f"actor_rollout_ref.actor.policy_loss.loss_mode={actor.policy_loss.loss_mode!r} is unknown; choose one "
                f"of {sorted(core_algos.POLICY_LOSS_REGISTRY)}"
            ) from None
        if self.n < 1:
            raise UserError(f"actor_rollout_ref.rollout.n={self.n}: must be at least 1")
        mini = int(actor.ppo_mini_batch_size)
        if mini < 1 or self.batch_size % mini:
            raise UserError(
                f"data.train_batch_size={self.batch_size} is not divisible by "
                f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}; make it a divisor"
            )
        if not str(cfg.trainer.default_local_dir):
            raise UserError("trainer.default_local_dir is empty; pass --output-dir")
        if not _as_list(cfg.data.train_files):
            raise UserError("data.train_files is empty; pass --train-files")

    def _configured_reward_fn(self) -> RewardFn:
        from verl.trainer.ppo.reward import get_custom_reward_fn
        from verl.utils.reward_score import default_compute_score

        from pipeline_steps.tools import resolve_config_path

        path = self.cfg.reward.custom_reward_function.get("path")
        if path and str(path).startswith("pkg:"):  # a reward shipped in this package (pkg:pipeline_steps.rewards/...)
            self.cfg.reward.custom_reward_function.path = path = resolve_config_path(path)
        if path and not Path(str(path)).is_file():
            raise UserError(
                f"reward.custom_reward_function.path={path}: file not found; pass a Python file defining the reward "
                "function"
            )
        try:
            return get_custom_reward_fn(self.cfg) or default_compute_score
        except AttributeError as exc:
            raise UserError(
                f"reward.custom_reward_function: {exc}; set reward.custom_reward_function.name to a function in that "
                "file"
            ) from None

    def _configured_group_fn(self):
        """``reward.custom_reward_function.group_name`` (local backend only): a function of the same file scoring a
        prompt's whole group at once, ``(data_source, solution_strs, ground_truth, extra_info) -> [score | dict]``,
        so a reward can compare the group's samples (e.g. ReTool's bonus for the shortest correct answer)."""
        spec = self.cfg.reward.get("custom_reward_function") or {}
        name = spec.get("group_name")
        if not name:
            return None
        path = spec.get("path")
        if not path:
            raise UserError(f"{GROUP_KEY}={name}: set reward.custom_reward_function.path to the file that defines it")
        from omegaconf import OmegaConf
        from verl.trainer.ppo.reward import get_custom_reward_fn

        probe = OmegaConf.create({"reward": {"custom_reward_function": {"path": str(path), "name": str(name)}}})
        try:
            return get_custom_reward_fn(probe)
        except AttributeError:
            raise UserError(f"{GROUP_KEY}={name}: no such function in {path}") from None

    def _eos_ids(self, model_path) -> list[int]:
        from transformers import GenerationConfig

        ids = {self.tokenizer.eos_token_id}
        with contextlib.suppress(Exception):
            gen = GenerationConfig.from_pretrained(model_path).eos_token_id
            ids |= set(gen if isinstance(gen, list) else [gen])
        return sorted(i for i in ids if i is not None)

    # -- one step ----------------------------------------------------------------

    def batch_prompts(self, step: int) -> tuple[list[Prompt], int]:
        """The prompts of 1-based ``step``: a seeded permutation per epoch, as verl's shuffled sampler."""
        import numpy as np

        epoch, k = divmod(step - 1, self.steps_per_epoch)
        order = np.arange(len(self.train_prompts))
        if self.cfg.data.get("shuffle", True):
            order = np.random.RandomState(self.data_seed + epoch).permutation(len(self.train_prompts))
        idx = order[k * self.batch_size : (k + 1) * self.batch_size]
        return [self.train_prompts[i] for i in idx], epoch

    def _rollout(self, prompts: list[Prompt], n: int, **sampling) -> dict:
        if self.agent is None:
            return self.generate(prompts, n, **sampling)
        self.model.eval()
        return self.agent.generate(prompts, n, **sampling)

    def generate(
        self, prompts: list[Prompt], n: int, *, temperature: float, top_p: float, top_k: int, seed: int
    ) -> dict:
        """Left-padded prompts, ``n`` sampled responses each (interleaved like verl's repeat)."""
        import torch
        from verl.utils.torch_functional import get_response_mask

        enc = self.tokenizer.pad({"input_ids": [p.input_ids for p in prompts]}, padding=True, return_tensors="pt")
        input_ids = enc["input_ids"].repeat_interleave(n, dim=0)
        attn = enc["attention_mask"].repeat_interleave(n, dim=0)
        torch.manual_seed(seed)
        # As verl's agent loop samples with vLLM: repetition_penalty 1.0 whatever the model's generation_config says,
        # an immediate EOS allowed (no min_new_tokens), and temperature 0 is greedy. verl's v1 trainer passes only
        # temperature/top_p/top_k to the rollout (``do_sample`` is not read), so neither do we.
        kwargs = dict(
            max_new_tokens=self.response_length,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            min_new_tokens=0,
        )
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        mm_rows = [p.mm for p in prompts for _ in range(n)]
        kwargs.update(vision_inputs(input_ids, mm_rows, self.model.config))
        if self.processor is not None:  # a response holding <|image_pad|> would be taken for an image's place
            kwargs["suppress_tokens"] = vision_token_ids(self.tokenizer)
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(input_ids=input_ids, attention_mask=attn, **kwargs)
        responses = out[:, input_ids.shape[1] :]
        if responses.shape[1] < self.response_length:  # every sequence stopped early
            pad = torch.full(
                (responses.shape[0], self.response_length - responses.shape[1]), self.pad_id, dtype=responses.dtype
            )
            responses = torch.cat([responses, pad], dim=1)
        response_mask = get_response_mask(response_id=responses, eos_token=self.eos_ids, dtype=attn.dtype)
        return {
            "prompts": input_ids,
            "responses": responses,
            "input_ids": torch.cat([input_ids, responses], dim=1),
            "attention_mask": torch.cat([attn, response_mask], dim=1),
            "response_mask": response_mask,
            "items": [p for p in prompts for _ in range(n)],
            "mm": mm_rows,  # each row's image inputs (None for a text row): log_probs gives them to the model
            "uids": [str(j) for j in range(len(prompts)) for _ in range(n)],  # one group per prompt
            "num_turns": [2] * (len(prompts) * n),  # verl's single-turn agent loop: user + assistant
            "extra_fields": [{"turn_scores": [], "tool_rewards": []} for _ in range(len(prompts) * n)],  # and these
        }

    def score(self, batch: dict) -> None:
        """verl's naive reward manager in miniature: decode, score, put the score on the last token."""
        import torch

        scores = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        # verl's naive manager: the valid response (model and tool tokens) is the attended part after the prompt
        lengths = batch["attention_mask"][:, -batch["responses"].shape[1] :].sum(-1)
        values, extras = [], []
        texts = [
            self.tokenizer.decode(batch["responses"][i, : int(lengths[i])], skip_special_tokens=True)
            for i in range(len(batch["items"]))
        ]
        grouped = self._group_scores(batch, texts) if self.group_reward_fn else None
        for i, item in enumerate(batch["items"]):
            n = int(lengths[i])
            text = texts[i]
            # verl's naive reward manager adds the agent loop's extra fields (turn_scores, tool_rewards), the turn
            # count and the rollout's own reward scores to extra_info
            extra_info = {
                **item.extra_info,
                **batch["extra_fields"][i],
                "num_turns": batch["num_turns"][i],
                "rollout_reward_scores": {},
            }
            if grouped is not None:
                res = grouped[i]
            else:
                res = self.reward_fn(
                    data_source=item.data_source,
                    solution_str=text,
                    ground_truth=item.ground_truth,
                    extra_info=extra_info,
                )
            if inspect.isawaitable(res):  # an async scorer, awaited as verl's reward loop awaits it
                res = asyncio.run(res)
            value = float(res["score"] if isinstance(res, dict) else res)
            values.append(value)
            # verl's naive reward manager: a dict result's keys become extra infos, a plain score is also ``acc``
            extras.append(dict(res) if isinstance(res, dict) else {"acc": value})
            scores[i, max(n - 1, 0)] = value
        batch["token_level_scores"] = scores
        batch["scores"] = values
        batch["reward_extra"] = extras

    def _group_scores(self, batch: dict, texts: list[str]) -> list:
        """One call of the group reward per prompt group (``uids``), results put back in sample order."""
        groups: dict[str, list[int]] = {}
        for i, uid in enumerate(batch["uids"]):
            groups.setdefault(uid, []).append(i)
        out: list = [None] * len(texts)
        for members in groups.values():
            first = batch["items"][members[0]]
            res = self.group_reward_fn(
                data_source=first.data_source,
                solution_strs=[texts[i] for i in members],
                ground_truth=first.ground_truth,
                extra_info={**first.extra_info, "rollout_reward_scores": {}},
            )
            if inspect.isawaitable(res):
                res = asyncio.run(res)
            if not isinstance(res, (list, tuple)) or len(res) != len(members):
                raise UserError(
                    f"{GROUP_KEY}: the group function returned {type(res).__name__}"
                    f"{f' of {len(res)}' if isinstance(res, (list, tuple)) else ''}; return one score or dict per "
                    f"sample of the group ({len(members)})"
                )
            for i, r in zip(members, res):
                out[i] = r
        return out

    def log_probs(self, model, batch: dict, rows, with_entropy: bool = False):
        from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

        ids = batch["input_ids"][rows]
        attn = batch["attention_mask"][rows]
        mm = vision_inputs(ids, [batch["mm"][int(r)] for r in rows], model.config) if batch.get("mm") else {}
        if mm:  # the model places its multimodal rotary positions from mm_token_type_ids (image tokens on a grid)
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False, **mm).logits
        else:
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
        r = batch["responses"].shape[1]
        logits = logits[:, -r - 1 : -1, :] / self.temperature  # verl scores with the rollout temperature
        logp = logprobs_from_logits(logits, ids[:, -r:])
        ent = entropy_from_logits(logits) if with_entropy else None
        return logp, ent

    def advantages(self, batch: dict) -> None:
        import numpy as np

        mask = batch["response_mask"]
        rewards = batch["token_level_scores"]
        cfg = self.cfg.algorithm
        if cfg.use_kl_in_reward:
            # verl's own apply_kl_penalty with its controller (fixed or adaptive, kept across steps like the trainer's)
            from verl import DataProto
            from verl.trainer.ppo.ray_trainer import apply_kl_penalty

            if self.kl_ctrl_in_reward is None:
                self.kl_ctrl_in_reward = self.core.get_kl_controller(cfg.kl_ctrl)
            data = DataProto.from_dict(
                tensors={k: batch[k] for k in ("response_mask", "token_level_scores", "old_log_probs", "ref_log_prob")}
            )
            data, kl_metrics = apply_kl_penalty(data, kl_ctrl=self.kl_ctrl_in_reward, kl_penalty=cfg.kl_penalty)
            rewards = data.batch["token_level_rewards"]
            batch["kl_metrics"] = kl_metrics
        batch["token_level_rewards"] = rewards
        # verl's own compute_advantage, called as the v1 trainer calls it (trainer_base._compute_advantage): GRPO
        # gets norm_adv_by_std_in_grpo as an argument, every other estimator only the algorithm config
        from verl import DataProto
        from verl.trainer.ppo.ray_trainer import compute_advantage

        data = DataProto.from_dict(
            tensors={"token_level_rewards": rewards, "response_mask": mask},
            non_tensors={"uid": np.array(batch["uids"], dtype=object)},
        )
        data = compute_advantage(
            data,
            adv_estimator=cfg.adv_estimator,
            gamma=float(cfg.gamma),
            lam=float(cfg.lam),
            num_repeat=self.n,
            norm_adv_by_std_in_grpo=bool(cfg.get("norm_adv_by_std_in_grpo", True)),
            config=self.algo_cfg,
        )
        batch["advantages"], batch["returns"] = data.batch["advantages"], data.batch["returns"]

    def update(self, batch: dict) -> dict:
        """verl's actor update: mini-batches (one optimiser step each) of micro-batches (gradient accumulation)."""
        import torch
        from torch.nn.utils.clip_grad import _clip_grads_with_norm_, _get_total_norm

        actor = self.cfg.actor_rollout_ref.actor
        total = batch["responses"].shape[0]
        mini = int(actor.ppo_mini_batch_size) * self.n
        micro = int(actor.get("ppo_micro_batch_size_per_gpu") or actor.get("ppo_micro_batch_size") or mini)
        mode = actor.loss_agg_mode
        entropy_coeff = float(actor.entropy_coeff or 0.0)
        mask = batch["response_mask"]
        resp_attn = batch["attention_mask"][:, -mask.shape[1] :]  # response tokens, tool output included
        sums: dict[str, list[float]] = {}
        self.model.train()
        for epoch in range(int(actor.ppo_epochs)):
            order = torch.arange(total)
            if actor.get("shuffle", False):
                order = torch.randperm(total, generator=torch.Generator().manual_seed(self.seed + epoch))
            for start in range(0, total, mini):
                rows_mb = order[start : start + mini]
                # Normalise every micro-batch loss by the whole mini-batch (verl's global batch info),
                # so accumulated gradients equal the mini-batch loss's gradient.
                self.actor_cfg.global_batch_info.update(
                    dp_size=1,
                    batch_num_tokens=int(mask[rows_mb].sum()),
                    global_batch_size=len(rows_mb),
                    loss_scale_factor=self.actor_cfg.loss_scale_factor,
                )
                self.optimizer.zero_grad()
                mb: dict[str, float] = {}
                for m0 in range(0, len(rows_mb), micro):
                    rows = rows_mb[m0 : m0 + micro]
                    # verl's workers pad a micro-batch to its longest response, and seq-mean-token-sum-norm divides
                    # by that width (agg_loss's horizon): cut ours to the same width (the tail is padding only)
                    h = max(int(resp_attn[rows].sum(-1).max()), 1)
                    rmask = mask[rows][:, :h].bool()
                    logp, ent = self.log_probs(self.model, batch, rows, with_entropy=entropy_coeff != 0)
                    logp, ent = logp[:, :h], (ent[:, :h] if ent is not None else None)
                    pg_loss, pg_metrics = self.policy_loss_fn(
                        old_log_prob=batch["old_log_probs"][rows][:, :h],
                        log_prob=logp,
                        advantages=batch["advantages"][rows][:, :h],
                        response_mask=rmask,
                        loss_agg_mode=mode,
                        config=self.actor_cfg,
                        rollout_is_weights=None,
                    )
                    loss = pg_loss
                    mb["actor/pg_loss"] = mb.get("actor/pg_loss", 0.0) + float(pg_loss.detach())
                    if entropy_coeff != 0:
                        ent_loss = self.core.agg_loss(
                            loss_mat=ent, loss_mask=rmask, loss_agg_mode=mode, **self.actor_cfg.global_batch_info
                        )
                        loss = loss - entropy_coeff * ent_loss
                        mb["actor/entropy_loss"] = mb.get("actor/entropy_loss", 0.0) + float(ent_loss.detach())
                    if actor.use_kl_loss:
                        kld = self.core.kl_penalty(
                            logprob=logp, ref_logprob=batch["ref_log_prob"][rows][:, :h], kl_penalty=actor.kl_loss_type
                        )
                        kl_loss = self.core.agg_loss(
                            loss_mat=kld, loss_mask=rmask, loss_agg_mode=mode, **self.actor_cfg.global_batch_info
                        )
                        loss = loss + kl_loss * float(actor.kl_loss_coef)
                        mb["actor/kl_loss"] = mb.get("actor/kl_loss", 0.0) + float(kl_loss.detach())
                    loss.backward()
                    mb["actor/loss"] = mb.get("actor/loss", 0.0) + float(loss.detach())
                    for k, v in pg_metrics.items():
                        sums.setdefault(k, []).append(float(v))
                # verl's fsdp2_clip_grad_norm_ minus its move to the accelerator (there is none here)
                params = [p for p in self.model.parameters() if p.grad is not None]
                grad_norm = _get_total_norm([p.grad for p in params], 2.0, False, None)
                _clip_grads_with_norm_(params, self.clip_grad, grad_norm, None)
                if hasattr(grad_norm, "full_tensor"):
                    grad_norm = grad_norm.full_tensor()
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                else:  # verl skips the update on a non-finite gradient
                    log.warning("grad_norm is not finite (%s); update skipped", grad_norm)
                    self.optimizer.zero_grad()
                sums.setdefault("actor/grad_norm", []).append(float(grad_norm))
                for k, v in mb.items():
                    sums.setdefault(k, []).append(v)
        metrics = {k: sum(v) / len(v) for k, v in sums.items()}
        if actor.use_kl_loss:
            metrics["actor/kl_coef"] = float(actor.kl_loss_coef)
        self.lr_scheduler.step()
        metrics["actor/lr"] = float(self.lr_scheduler.get_last_lr()[0])  # verl logs the rate after its step
        metrics.update(batch.get("kl_metrics") or {})
        return metrics

    def generate_and_score(self, step: int) -> tuple[dict, dict, int]:
        """Rollout and rewards of one step (the benchmark's baseline stops here)."""
        ro = self.cfg.actor_rollout_ref.rollout
        timing: dict[str, float] = {}
        prompts, epoch = self.batch_prompts(step)
        t = time.perf_counter()
        batch = self._rollout(
            prompts,
            self.n,
            temperature=self.temperature,
            top_p=float(ro.top_p),
            top_k=int(ro.top_k),
            seed=self.seed * 1_000_003 + step,
        )
        timing["gen"] = time.perf_counter() - t
        t = time.perf_counter()
        self.score(batch)
        timing["reward"] = time.perf_counter() - t
        return batch, timing, epoch

    def train_step(self, step: int) -> dict:
        """One GRPO step; returns verl-named metrics."""
        import torch

        t_step = time.perf_counter()
        batch, timing, epoch = self.generate_and_score(step)
        mode = self.cfg.actor_rollout_ref.actor.loss_agg_mode
        rows = torch.arange(batch["responses"].shape[0])
        t = time.perf_counter()
        self.model.eval()
        with torch.no_grad():
            old, ent = self.log_probs(self.model, batch, rows, with_entropy=True)
        batch["old_log_probs"] = old
        entropy = float(self.core.agg_loss(loss_mat=ent, loss_mask=batch["response_mask"].bool(), loss_agg_mode=mode))
        timing["old_log_prob"] = time.perf_counter() - t
        if self.use_ref:
            t = time.perf_counter()
            with torch.no_grad():
                batch["ref_log_prob"], _ = self.log_probs(self.ref, batch, rows)
            timing["ref"] = time.perf_counter() - t
        t = time.perf_counter()
        self.advantages(batch)
        timing["adv"] = time.perf_counter() - t
        actor_metrics = {}
        if int(self.cfg.trainer.get("critic_warmup", 0) or 0) <= step:  # verl updates the actor from this step on
            t = time.perf_counter()
            actor_metrics = self.update(batch)
            timing["update_actor"] = time.perf_counter() - t
        t = time.perf_counter()
        self.dump_rollouts(step, batch)
        timing["dump_rollout_generations"] = time.perf_counter() - t  # verl's timer name for the same dump
        timing["step"] = time.perf_counter() - t_step
        return self._metrics(batch, timing, step, epoch, {"actor/entropy": entropy, **actor_metrics})

    def dump_rollouts(self, step: int, batch: dict) -> None:
        """The step's samples as verl's ``trainer.rollout_data_dir`` files; locally always (default: the run
        directory's ``rollouts/``, where the report reads them)."""
        from pipeline_steps.evaluation import trajectories

        dump = self.cfg.trainer.get("rollout_data_dir") or self.layout.rollouts
        trajectories.write_step(dump, step, batch, self.tokenizer)

    def _metrics(self, batch, timing, step, epoch, extra) -> dict:
        from verl import DataProto
        from verl.trainer.ppo.metric_utils import (
            compute_data_metrics,
            compute_throughout_metrics,
            compute_timing_metrics,
        )

        keys = (
            "prompts",
            "responses",
            "attention_mask",
            "response_mask",
            "token_level_scores",
            "token_level_rewards",
            "advantages",
            "returns",
        )
        import numpy as np

        num_turns = np.asarray(batch["num_turns"], dtype=np.int32)
        # verl's v1 trainer pads the batch's nested prompts and responses to the longest of each before
        # compute_data_metrics, so its */clip_ratio compares lengths with the longest in the batch: cut ours the same
        r_width, p_width = batch["responses"].shape[1], batch["prompts"].shape[1]
        attn = batch["attention_mask"]
        p_len, r_len = attn[:, :p_width].sum(-1), attn[:, p_width:].sum(-1)
        p_cut, r_cut = max(int(p_len.max()), 1), max(int(r_len.max()), 1)
        tensors = {k: batch[k] for k in keys if k not in ("prompts", "attention_mask")}
        tensors = {k: v[:, :r_cut] if v.dim() == 2 and v.shape[1] == r_width else v for k, v in tensors.items()}
        tensors.update(
            prompts=batch["prompts"][:, p_width - p_cut :],
            prompt_length=p_len.float(),
            response_length=r_len.float(),
        )
        dp = DataProto.from_dict(
            tensors=tensors,
            # compute_data_metrics then emits num_turns/* (and tool_call_counts/* for agent rollouts) as verl's does
            non_tensors={
                "__num_turns__": num_turns,
                **({"tool_call_counts": batch["tool_call_counts"]} if "tool_call_counts" in batch else {}),
            },
            meta_info={"global_token_num": batch["attention_mask"].sum(-1).tolist()},
        )
        from verl.utils import flops_counter
        from verl.utils.seqlen_balancing import log_seqlen_unbalance

        seqlens = batch["attention_mask"].sum(-1).tolist()
        metrics = {"training/global_step": step, "training/epoch": epoch, **extra}
        # verl's own computations, on one data-parallel rank: sequence balance and the actor update's MFU
        metrics.update(log_seqlen_unbalance(seqlens, [list(range(len(seqlens)))], prefix="global_seqlen"))
        if timing.get("update_actor"):
            # FlopsCounter.estimate_flops asks torch for a CUDA device name even on a CPU build, so call its
            # per-architecture estimate and its device table (entry "CPU") directly
            estimate = flops_counter.ESTIMATE_FUNC.get(self.model.config.model_type)
            if estimate is not None:
                achieved = estimate(self.model.config, sum(seqlens), seqlens, timing["update_actor"])
                metrics["perf/mfu/actor"] = achieved / flops_counter.get_device_flops(device_name="CPU")
        metrics.update(compute_data_metrics(dp, use_critic=False))
        from pipeline_steps.local import agent_rollout

        metrics.update(agent_rollout.metrics(batch))
        metrics.update(
            {
                "training/num_turns/mean": float(num_turns.mean()),
                "training/num_turns/max": int(num_turns.max()),
                "training/num_turns/min": int(num_turns.min()),
            }
        )
        metrics.update(compute_timing_metrics(dp, timing))
        metrics.update(compute_throughout_metrics(dp, timing, n_gpus=1))
        return {k: (float(v) if not isinstance(v, (int, float, str)) else v) for k, v in metrics.items()}

    def validate(self) -> dict:
        """``rollout.val_kwargs`` generation on the validation prompts, reported under verl's own names.

        The metric dict comes from verl's v1 trainer code (``PPOTrainer._val_metrics_update`` over
        ``process_validation_metrics``), so a local run logs ``val-core/<data source>/acc/mean@N`` (the headline),
        ``val-aux/<data source>/reward/...``, ``std@N``, ``best@N`` exactly as a cluster run does.
        """
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer

        vk = self.cfg.actor_rollout_ref.rollout.val_kwargs
        data_sources: list[str] = []
        uids: list[str] = []
        infos: dict[str, list] = {"reward": []}
        bs = max(self.batch_size, 1)
        for i in range(0, len(self.val_prompts), bs):
            chunk = self.val_prompts[i : i + bs]
            batch = self._rollout(
                chunk,
                int(vk.n),
                temperature=float(vk.temperature),
                top_p=float(vk.top_p),
                top_k=int(vk.top_k),
                seed=self.seed,
            )
            self.score(batch)
            for j, (item, s, extra) in enumerate(zip(batch["items"], batch["scores"], batch["reward_extra"])):
                data_sources.append(item.data_source)
                uids.append(f"val-{i + j // int(vk.n)}")
                infos["reward"].append(s)
                for k, v in extra.items():
                    if k != "score" and isinstance(v, (int, float, bool)):
                        infos.setdefault(k, []).append(float(v))
        infos = {k: v for k, v in infos.items() if len(v) == len(uids)}  # keys every sample reported
        # The method uses nothing of the trainer instance: called unbound so the names and rules are verl's.
        metrics = PPOTrainer._val_metrics_update(None, data_sources, uids, infos, sample_turns=[])
        return {k: float(v) for k, v in metrics.items()}

    # -- checkpoints ------------------------------------------------------------

    def resume(self) -> int:
        """Load the checkpoint ``trainer.resume_mode`` asks for; returns the step it holds (0 if none)."""
        mode = self.cfg.trainer.get("resume_mode", "auto")
        if mode == "disable":
            return 0
        if mode == "resume_path":
            path = self.cfg.trainer.get("resume_from_path")
            m = re.search(r"global_step_(\d+)/?$", str(path or ""))
            if not m or not Path(str(path), "actor").is_dir():
                raise UserError(
                    f"trainer.resume_from_path={path!r}: not a global_step_N checkpoint directory with an actor/ folder"
                )
            step, ckpt = int(m.group(1)), Path(str(path))
        elif mode == "auto":
            tracker = self.ckpt_root / TRACKER
            if not tracker.is_file():
                return 0
            text = tracker.read_text().strip()
            if not text.isdigit() or not (self.ckpt_root / f"global_step_{text}" / "actor").is_dir():
                raise UserError(f"{tracker}: names no complete checkpoint ({text!r}); remove the file to start over")
            step, ckpt = int(text), self.ckpt_root / f"global_step_{text}"
        else:
            raise UserError(f"trainer.resume_mode={mode!r}: use auto, disable or resume_path")
        self.checkpoint.load_checkpoint(str(ckpt / "actor"))
        log.info("resumed from %s (step %d)", ckpt, step)
        return step

    def save(self, step: int, epoch: int) -> Path:
        """Build ``global_step_N`` aside (``actor/`` and ``data.pt``) and rename it into place; :meth:`commit`
        advances the tracker once the step's metrics line is written."""
        import torch

        final = self.ckpt_root / f"global_step_{step}"
        with atomic.atomic_dir(final) as tmp, verl_locks_in(tmp / ".locks"):  # removed before the rename
            self.checkpoint.save_checkpoint(str(tmp / "actor"), global_step=step, max_ckpt_to_keep=None)
            # verl saves its dataloader's state here; ours is the sampler position (seed, epoch, step)
            torch.save({"seed": self.data_seed, "epoch": epoch, "global_step": step}, tmp / "data.pt")
        self.checkpoint.previous_saved_paths.clear()  # it recorded the temporary path; retention is ours
        return final

    def commit(self, step: int) -> None:
        """Advance the tracker to the saved step ``step``, then apply retention.

        Called after the step's metrics line is written: a run killed between the save and that line resumes from
        the step before (whose history ends there), runs step N again and logs it once. With the tracker advanced
        at the save, as verl's trainer does, the resumed run skipped step N and its line was lost for good.

        Retention is verl's: ``max_actor_ckpt_to_keep`` removes only the ``actor/`` folder of older steps, and only
        of steps this process saved (verl's checkpoint manager counts its own saves: after a resume, the checkpoints
        of the attempts before it stay).
        """
        atomic.write_text(self.ckpt_root / TRACKER, str(step))
        self._saved_steps.append(step)
        keep = self.cfg.trainer.get("max_actor_ckpt_to_keep")
        if keep:
            import shutil

            for old in self._saved_steps[: -int(keep)]:
                shutil.rmtree(self.ckpt_root / f"global_step_{old}" / "actor", ignore_errors=True)
            self._saved_steps = self._saved_steps[-int(keep) :]

    # -- the loop ---------------------------------------------------------------

    def fit(self, on_step: Callable[[int, dict], None] | None = None) -> dict:
        """Train from the resumed step to ``total_steps``; returns the run summary."""
        start = self.resume()
        self.logger, mlflow_run, tb_dir = _tracking(
            self.cfg,
            self.metrics_path,
            start,
            self.ckpt_root / tracking_run.FILE,  # beside the checkpoints: a resumed attempt and the export find the run
            Path(self.layout.tensorboard),
        )
        save_freq = int(self.cfg.trainer.get("save_freq", -1) or -1)
        try:
            # verl's loop rules (v1 trainer_base.fit): validate first whenever val_before_train (a resume too),
            # stop at total_epochs even if total_training_steps is larger, save only when save_freq > 0,
            # validate only when test_freq > 0; saving is timed inside the step.
            if self.val_prompts and self.val_before_train:
                self.logger.log(data=self.validate(), step=start)
            # trainer.val_only: verl returns after the first validation (only when val_before_train ran it)
            val_only = bool(self.cfg.trainer.get("val_only", False) and self.val_prompts and self.val_before_train)
            for step in range(start + 1, 1 if val_only else self.total_steps + 1):
                if (step - 1) // self.steps_per_epoch >= self.total_epochs:
                    break
                metrics = self.train_step(step)
                last = step == self.total_steps
                saved = save_freq > 0 and (last or step % save_freq == 0)
                if saved:
                    t = time.perf_counter()
                    self.save(step, int(metrics.get("training/epoch", 0)))
                    metrics["timing_s/save_checkpoint"] = time.perf_counter() - t
                    metrics["timing_s/step"] = metrics.get("timing_s/step", 0.0) + metrics["timing_s/save_checkpoint"]
                if self.val_prompts and self.test_freq > 0 and (last or step % self.test_freq == 0):
                    t = time.perf_counter()
                    metrics.update(self.validate())
                    metrics["timing_s/testing"] = time.perf_counter() - t
                self.logger.log(data=metrics, step=step)
                if saved:
                    self.commit(step)
                log.info(
                    "step %d: %s",
                    step,
                    {
                        k: round(v, 4) if isinstance(v, float) else v
                        for k, v in metrics.items()
                        if k in ("critic/score/mean", "actor/pg_loss", "actor/entropy", "timing_s/step")
                    },
                )
                self.last_metrics = metrics
                if on_step:
                    on_step(step, metrics)
        finally:
            self.logger.finish()
        lines = read_metrics(self.metrics_path)
        final = lines[-1]["data"] if lines else {}
        last_step = int(lines[-1]["step"]) if lines else start
        tracker = self.ckpt_root / TRACKER
        ckpt_step = int(tracker.read_text().strip()) if tracker.is_file() else None
        return {
            "checkpoint_dir": str(self.ckpt_root / f"global_step_{ckpt_step}") if ckpt_step is not None else None,
            "checkpoint_root": str(self.ckpt_root),
            "last_step": last_step,
            "resumed_from_step": start,
            "metrics_path": str(self.metrics_path),
            "mlflow": mlflow_run,  # run_id, tracking_uri, experiment_id, url; None when not logging to MLflow
            # {uri, command} of the event files; None without the tensorboard logger
            "tensorboard": tracking_run.tensorboard_info(str(tb_dir), tb_dir) if tb_dir else None,
            "final_metrics": {
                k: v
                for k, v in final.items()
                if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))
            },
        }


# an allocation that failed: torch's CPU allocator ("DefaultCPUAllocator: not enough memory: you tried to allocate
# ... bytes"), its OutOfMemoryError ("... out of memory ..."), the C library's ("Cannot allocate memory")
_OUT_OF_MEMORY = re.compile(r"not enough memory|out of memory|can(no|')t allocate memory", re.IGNORECASE)


def out_of_memory(cfg, exc: BaseException) -> UserError | None:
    """A failed allocation as bad input (one line naming the settings that size it, exit 2, not retried: the same
    settings fail the same way), or None when ``exc`` is no such failure."""
    if not (isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and _OUT_OF_MEMORY.search(str(exc)))):
        return None
    rollout = cfg.actor_rollout_ref.rollout
    response = rollout.get("response_length") or cfg.data.max_response_length
    response_key = "actor_rollout_ref.rollout.response_length"
    if not rollout.get("response_length"):
        response_key = "data.max_response_length"
    tbs, n, prompt = int(cfg.data.train_batch_size), int(rollout.n), int(cfg.data.max_prompt_length)
    what = " ".join(str(exc).split())[:160] or type(exc).__name__
    return UserError(
        f"out of memory in the CPU trainer ({what}): data.train_batch_size x actor_rollout_ref.rollout.n x "
        f"(data.max_prompt_length + {response_key}) = {tbs} x {n} x ({prompt} + {response}) tokens per step; lower "
        f"{response_key} (or the batch size, n, data.max_prompt_length)"
    )


def train(cfg, reward_fn: RewardFn | None = None, metrics_path=None, on_step=None) -> dict:
    """Build the trainer in a 1-process gloo group and run it to the end (resuming per ``trainer.resume_mode``).

    :raises UserError: an allocation failed (:func:`out_of_memory`): the settings are too large for this machine.
    """
    from pipeline_steps.local.agent_rollout import local_sandbox

    run_dir = Path(str(cfg.trainer.default_local_dir)).parent
    # the code tool's sandboxes: the local server when no E2B service is configured (the run's files hidden from them)
    with process_group(), local_sandbox(cfg, hide=[str(run_dir)]):
        try:
            return GRPOTrainer(cfg, reward_fn=reward_fn, metrics_path=metrics_path).fit(on_step=on_step)
        except (MemoryError, RuntimeError) as exc:
            error = out_of_memory(cfg, exc)
            if error is None:
                raise
            raise error from None
