"""GPU capacity: allocatable ``nvidia.com/gpu`` on the nodes a preset's worker pods may land on, against its request.

Allocatable is what a node offers, not what is free now: GPUs other pods hold are not subtracted (a busy pool
queues; a pool that is too small never runs). Nodes count when they are Ready and schedulable, carry every label of
``cluster.node_selector`` and have no NoSchedule/NoExecute taint that ``cluster.tolerations`` does not tolerate.
"""

from __future__ import annotations

from pipeline_steps.diagnostics import Check

GPU = "nvidia.com/gpu"  # the resource the renderer requests per worker (pipeline_steps/training/rayjob_manifest.py)


def tolerates(toleration: dict, taint) -> bool:
    """Kubernetes' ToleratesTaint: effect and key match (empty = any), then Exists or an equal value."""
    if toleration.get("effect") and toleration["effect"] != taint.effect:
        return False
    key, op = toleration.get("key") or "", toleration.get("operator") or "Equal"
    if key and key != taint.key:
        return False
    if not key and op != "Exists":
        return False
    return op == "Exists" or str(toleration.get("value") or "") == (taint.value or "")


def _fits(node, selector: dict, tolerations: list[dict]) -> bool:
    if node.spec is not None and node.spec.unschedulable:
        return False
    ready = [c.status for c in (node.status.conditions or []) if c.type == "Ready"]
    if ready and ready[0] != "True":
        return False
    labels = node.metadata.labels or {}
    if any(labels.get(str(k)) != str(v) for k, v in selector.items()):
        return False
    taints = (node.spec.taints if node.spec is not None else None) or []
    hard = [t for t in taints if t.effect in ("NoSchedule", "NoExecute")]
    return all(any(tolerates(tol, t) for tol in tolerations) for t in hard)


def _allocatable(node) -> int:
    value = str((node.status.allocatable or {}).get(GPU, "0"))
    try:
        return int(value)
    except ValueError:  # GPUs are whole devices; anything else is not a count
        return 0


def request(exp) -> tuple[int, int]:
    """(nnodes, GPUs per node) as the renderer reads them: the verl keys first, then the preset's cluster section."""
    cluster = exp.spec.get("cluster") or {}
    nnodes = exp.verl.get("trainer.nnodes", cluster.get("nnodes", 1))
    gpus = exp.verl.get("trainer.n_gpus_per_node", cluster.get("gpus_per_node", 0))
    return int(nnodes), int(gpus)


def check_gpus(core, exp) -> list[Check]:
    from kubernetes.client.exceptions import ApiException

    cluster = exp.spec.get("cluster") or {}
    selector, tolerations = cluster.get("node_selector") or {}, cluster.get("tolerations") or []
    nnodes, per_node = request(exp)
    need = nnodes * per_node
    total_name, node_name = f"GPU capacity for {exp.name}", f"GPUs per node for {exp.name}"
    if need <= 0:
        return []
    try:
        nodes = core.list_node().items
    except ApiException as exc:
        if exc.status == 403:  # nodes are cluster-scoped; the Airflow roles do not list them
            return [Check(total_name, True, "not checked: this identity may not list nodes")]
        return [Check(total_name, False, f"HTTP {exc.status} listing nodes", "kubectl get nodes")]
    counts = sorted((_allocatable(n) for n in nodes if _fits(n, selector, tolerations)), reverse=True)
    counts = [c for c in counts if c > 0]
    total, fitting = sum(counts), sum(1 for c in counts if c >= per_node)
    where = f"node_selector {selector or '{}'}, tolerations {len(tolerations)}"
    pool = (
        f"add GPU nodes the worker pods may use ({where}: kubectl get nodes -o wide; kubectl describe node <n>), "
        "or lower trainer.nnodes / trainer.n_gpus_per_node"
    )
    out = [
        Check(
            total_name,
            total >= need,
            f"{total} {GPU} allocatable on {len(counts)} matching GPU node(s); "
            f"the run needs {nnodes}x{per_node} = {need}",
            pool,
        )
    ]
    largest = counts[0] if counts else 0
    fix = (
        f"each worker pod needs {per_node} GPUs on one node: set trainer.n_gpus_per_node <= {largest} (and raise "
        f"trainer.nnodes), or {pool.split(', or ')[0]}"
    )
    detail = f"largest matching node has {largest}; nodes with {per_node}: {fitting}, the run needs {nnodes}"
    out.append(Check(node_name, fitting >= nnodes, detail, fix))
    return out
