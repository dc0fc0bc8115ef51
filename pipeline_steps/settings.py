"""The pipeline's own environment variables, each defined once here: name, default, what it does (issue 25, item 2).

Every variable the project itself defines has the prefix ``PIPELINE_`` and is read only through this module
(:func:`get` and its typed forms), at call time: tests and the Makefile set them per process, so nothing is cached at
import. Variables of the libraries (``HF_TOKEN``, ``MLFLOW_TRACKING_URI``, ``AIRFLOW__*``, ``E2B_*``, ``RAY_*``, ...)
stay read where they are used. docs/settings.md lists every setting below (tests/unit/pipeline_steps/test_settings.py
checks both ways).

The ``VERL_PIPELINE_*`` names of earlier releases (and ``AIRFLOW_HOST``, ``AIRFLOW_PORT``,
``SANDBOX_SERVER_API_KEY``) still work as deprecated aliases of their ``PIPELINE_*`` names:
the new name wins when both are set, and reading an old name logs one warning naming the new one.

Standard library only: DAG files import this module and must parse fast.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Setting:
    name: str
    default: str | None  # what :func:`get` returns when unset (the environment's form); None: the reader's fallback
    doc: str  # what it does; the reader's fallback when ``default`` is None
    old: str | None = None  # the deprecated name of earlier releases, still read
    shown: str | None = None  # the default as docs/settings.md shows it, when it is derived (``$PIPELINE_HOME/...``)


SETTINGS: dict[str, Setting] = {}


def _define(name: str, default: str | None, doc: str, *, old: str | None = None, shown: str | None = None) -> str:
    assert name.startswith("PIPELINE_") and name not in SETTINGS, name
    SETTINGS[name] = Setting(name, default, doc, old, shown)
    return name


# --- local state -------------------------------------------------------------------------------------------------
HOME = _define(
    "PIPELINE_HOME",
    None,
    "The local profile's state (store, work, MLflow, sandboxes); `make demo`/`make airflow` set `./.demo`",
    shown="`~/.verl-grpo-pipeline`",
)
CACHE_DIR = _define(
    "PIPELINE_CACHE_DIR",
    None,
    "Best-effort caches: checksums, OSS resume checkpoints, the built tiny models; losing it costs time only",
    shown="`~/.cache/pipeline_steps`",
)
WORK_DIR = _define(
    "PIPELINE_WORK_DIR", None, "The runs' local work directories (the plan's `work`)", shown="`$PIPELINE_HOME/work`"
)
MIRROR_DIR = _define(
    "PIPELINE_MIRROR_DIR",
    None,
    "Local mirror of cloud-store objects the worker fetches or writes",
    shown="`$PIPELINE_HOME/work/mirror`",
)
LOG_LEVEL = _define("PIPELINE_LOG_LEVEL", "INFO", "Log level of `python -m pipeline_steps <step>`")
DEBUG = _define(
    "PIPELINE_DEBUG", None, "Any non-empty value: a step's unexpected error prints its traceback", shown="unset"
)

# --- store -------------------------------------------------------------------------------------------------------
STORE_URI = _define(
    "PIPELINE_STORE_URI",
    None,
    "Store root of runs whose form gives none; also the `verl_doctor` form's and the `doctor` step's default",
    shown="`file://$PIPELINE_HOME/store`",
)
STORE_CONN_ID = _define(
    "PIPELINE_STORE_CONN_ID", "pipeline_store", "Airflow connection holding the store's credentials"
)
STORE_PART_MB = _define(
    "PIPELINE_STORE_PART_MB",
    None,
    "Transfer part size in MB: OSS multipart part, GCS resumable chunk",
    shown="16 (OSS), 100 (GCS)",
)
STORE_PARALLEL = _define("PIPELINE_STORE_PARALLEL", "4", "OSS parts in flight (peak memory: about parts x part size)")
STORE_CONNECT_TIMEOUT = _define("PIPELINE_STORE_CONNECT_TIMEOUT", "10", "Store connect timeout in seconds (OSS, GCS)")
STORE_RETRIES = _define(
    "PIPELINE_STORE_RETRIES",
    "3",
    "OSS client retries; an OSS download fails after this many attempts in a row without progress",
)
STORE_RETRY_DEADLINE = _define(
    "PIPELINE_STORE_RETRY_DEADLINE", "60", "GCS: seconds within which transient errors are retried"
)
STORE_STALL_SECONDS = _define(
    "PIPELINE_STORE_STALL_SECONDS", "120", "An OSS download making no progress this many seconds fails"
)

# --- datasets and presets ----------------------------------------------------------------------------------------
DATASETS = _define(
    "PIPELINE_DATASETS", None, "A YAML/JSON dataset registry file adding to the packaged datasets", shown="none"
)
REVISION_INDEX = _define(
    "PIPELINE_REVISION_INDEX",
    None,
    "Directory of local dataset revision indexes (offline commit lists)",
    shown="`$HF_HUB_CACHE/revision-index`",
)
PRESETS_DIR = _define(
    "PIPELINE_PRESETS_DIR",
    None,
    "A deployment's own presets directory; its presets shadow the packaged ones by name",
    old="VERL_PIPELINE_PRESETS_DIR",
    shown="none",
)

# --- the DAGs ----------------------------------------------------------------------------------------------------
DEFAULT_EXPERIMENT = _define(
    "PIPELINE_DEFAULT_EXPERIMENT",
    "local_tiny",
    "Preset a run with no form input trains (the `verl_doctor` form's default when set, else `gsm8k_qwen2_5_3b`)",
    old="VERL_PIPELINE_DEFAULT_EXPERIMENT",
)
DEFAULT_BACKEND = _define(
    "PIPELINE_DEFAULT_BACKEND",
    "local",
    "Backend a run with no form input uses (`local` or `kuberay`)",
    old="VERL_PIPELINE_DEFAULT_BACKEND",
)
SCHEDULE = _define(
    "PIPELINE_SCHEDULE",
    "@weekly",
    "The training DAG's schedule: an Airflow preset, a cron expression or `none`",
    old="VERL_PIPELINE_SCHEDULE",
)
END_DATE = _define(
    "PIPELINE_END_DATE",
    None,
    "ISO date after which no scheduled run starts",
    old="VERL_PIPELINE_END_DATE",
    shown="none",
)
MAX_ACTIVE_RUNS = _define(
    "PIPELINE_MAX_ACTIVE_RUNS", "1", "Runs of the training DAG active at once", old="VERL_PIPELINE_MAX_ACTIVE_RUNS"
)
GPU_POOL = _define(
    "PIPELINE_GPU_POOL",
    "gpu",
    "Airflow pool the train and evaluate tasks take slots from",
    old="VERL_PIPELINE_GPU_POOL",
)
GPU_SLOTS = _define(
    "PIPELINE_GPU_SLOTS", "8", "Slots of the GPU pool a train or evaluate task takes", old="VERL_PIPELINE_GPU_SLOTS"
)
POLL_SECONDS = _define(
    "PIPELINE_POLL_SECONDS",
    "30",
    "How often a job's status is read (the local profile sets 5)",
    old="VERL_PIPELINE_POLL_SECONDS",
)

# --- MLflow ------------------------------------------------------------------------------------------------------
MLFLOW_CONN_ID = _define("PIPELINE_MLFLOW_CONN_ID", "mlflow_default", "Airflow connection of a team's MLflow server")
MLFLOW_SECRET = _define(
    "PIPELINE_MLFLOW_SECRET",
    None,
    "Kubernetes Secret with the MLflow credentials for RayJobs",
    shown="the preset's `cluster.mlflow_secret`",
)
MLFLOW_CREDENTIALS_FILE = _define(
    "PIPELINE_MLFLOW_CREDENTIALS_FILE",
    None,
    "Set by the train operator for a local job: a file only the worker's user reads, holding the MLflow credentials",
    shown="none",
)
STORE_CREDENTIALS_FILE = _define(
    "PIPELINE_STORE_CREDENTIALS_FILE",
    None,
    "Set by the train operator for a local job: a file only the worker's user reads, holding the store's credentials "
    "(a job on another machine uses its own environment)",
    shown="none",
)
MLFLOW_DIR = _define(
    "PIPELINE_MLFLOW_DIR",
    None,
    "The local profile's MLflow server state and artifacts",
    shown="`$PIPELINE_HOME/mlflow`",
)
MLFLOW_PORT = _define("PIPELINE_MLFLOW_PORT", None, "Port of the local profile's MLflow server", shown="a free port")

# --- local Ray cluster -------------------------------------------------------------------------------------------
RAY_TEMP_DIR = _define("PIPELINE_RAY_TEMP_DIR", "/tmp/ray_pipeline", "The local Ray cluster's files and state")
RAY_PORT = _define("PIPELINE_RAY_PORT", "6379", "The local Ray cluster's GCS port (127.0.0.1)")
RAY_DASHBOARD_PORT = _define("PIPELINE_RAY_DASHBOARD_PORT", "8265", "The local Ray cluster's dashboard/jobs API port")

# --- cluster (KubeRay) -------------------------------------------------------------------------------------------
MOUNTS = _define("PIPELINE_MOUNTS", None, "The pods' bucket mounts (JSON)", shown="the preset's `cluster.mounts`")
TRAIN_IMAGE = _define(
    "PIPELINE_TRAIN_IMAGE", None, "The training image of RayJobs (pinned)", shown="the preset's `cluster.image`"
)
RAY_SERVICE_ACCOUNT = _define(
    "PIPELINE_RAY_SERVICE_ACCOUNT",
    None,
    "Service account of the Ray pods",
    shown="the preset's `cluster.service_account`, else `default`",
)
RAY_AUTH_SECRET = _define(
    "PIPELINE_RAY_AUTH_SECRET", None, "A Secret of your own holding the clusters' Ray token", shown="KubeRay makes one"
)
E2B_DOMAIN = _define(
    "PIPELINE_E2B_DOMAIN", None, "The default sandbox service's domain, for tool presets naming none", shown="none"
)
SANDBOX_SERVICES = _define(
    "PIPELINE_SANDBOX_SERVICES",
    None,
    "Named sandbox services (JSON: name -> `domain`, `secret`, `key`)",
    shown="none",
)

# --- local profile's servers ------------------------------------------------------------------------------------
AIRFLOW_HOST = _define(
    "PIPELINE_AIRFLOW_HOST",
    "127.0.0.1",
    "Address `make airflow`'s API server binds (every UI user is an admin: configure a real auth manager first)",
    old="AIRFLOW_HOST",
)
AIRFLOW_PORT = _define(
    "PIPELINE_AIRFLOW_PORT", None, "Port of `make airflow`'s API server", old="AIRFLOW_PORT", shown="a free port"
)
SANDBOX_API_KEY = _define(
    "PIPELINE_SANDBOX_API_KEY",
    None,
    "The API key clients of the local sandbox server (`sandbox-server` step) must send; never on the command line",
    old="SANDBOX_SERVER_API_KEY",
    shown="none (the step requires it; `LocalSandboxServer` sets it)",
)

_warned: set[str] = set()  # deprecated names already warned about in this process


def get(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of setting ``name`` (a ``PIPELINE_*`` name defined above; KeyError for any other) in ``environ``
    (default: this process's environment), else its deprecated name's, else its default. Empty counts as unset."""
    setting = SETTINGS[name]
    env = os.environ if environ is None else environ
    value = env.get(name)
    if not value and setting.old and env.get(setting.old):
        if setting.old not in _warned:
            _warned.add(setting.old)
            log.warning("%s is deprecated: set %s instead (read %s this time)", setting.old, name, setting.old)
        value = env[setting.old]
    return value or setting.default


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment sets ``name`` (or its deprecated name), as opposed to falling back to the default."""
    setting = SETTINGS[name]
    env = os.environ if environ is None else environ
    return bool(env.get(name) or (setting.old and env.get(setting.old)))


def get_int(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    value = get(name, environ)
    return None if value is None else int(value)


def get_float(name: str, environ: Mapping[str, str] | None = None) -> float | None:
    value = get(name, environ)
    return None if value is None else float(value)


def get_path(name: str, fallback: Path, environ: Mapping[str, str] | None = None) -> Path:
    """A directory setting: its value, else ``fallback`` (the derived default docs/settings.md shows)."""
    value = get(name, environ)
    return Path(value) if value else fallback


def home() -> Path:
    """``PIPELINE_HOME``: the one default of the pipeline's local state, whoever asks."""
    return get_path(HOME, Path.home() / ".verl-grpo-pipeline")


def cache_dir() -> Path:
    """``PIPELINE_CACHE_DIR``: the best-effort caches (checksums, OSS resume checkpoints); losing it costs time only."""
    return get_path(CACHE_DIR, Path.home() / ".cache" / "pipeline_steps")
