"""What the tasks of the current run are doing, read through the Task SDK (no database access from a worker)."""

from __future__ import annotations


def task_states(ti) -> dict[str, str]:
    """This run's tasks and their states as Airflow sees them now (a mapped task as ``<task>_<map index>``),
    except the calling task; for the report's "what ran and what did not"."""
    found = ti.get_task_states(dag_id=ti.dag_id, run_ids=[ti.run_id]).get(ti.run_id) or {}
    return {task: str(state or "not started") for task, state in sorted(found.items()) if task != ti.task_id}
