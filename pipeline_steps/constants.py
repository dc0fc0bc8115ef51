"""Names shared by the Airflow side (operators, DAGs) and the step side (pipeline_steps): one home each."""

from __future__ import annotations

# KubeRay appends 6 characters for the RayCluster's name, which must stay within 53; so RayJob names stay within 47.
RAYJOB_NAME_MAX = 47
LOCAL_SANDBOX_MAX = 64  # the local sandbox server's --max-sandboxes default (sandbox-server; the pre-flight's count)
# verl's checkpoint tracker: the newest complete global_step_N under a checkpoint directory.
CHECKPOINT_TRACKER = "latest_checkpointed_iteration.txt"

BACKENDS = ("local", "kuberay")
_FROM_PRESET = ("", "none", "auto", "preset")


def resolve_backend(value, preset_backend: str | None) -> str:
    """The backend a task runs on: an explicit ``local``/``kuberay``, else the preset's (``local`` or a cluster).

    Raises ValueError with a one-line message for anything else.
    """
    v = str(value or "").strip().lower()
    if v in BACKENDS:
        return v
    if v not in _FROM_PRESET:
        raise ValueError(f"backend {value!r}: choose 'local' or 'kuberay' (or leave empty for the preset's)")
    if preset_backend is None:
        return "local"
    return "local" if preset_backend == "local" else "kuberay"
