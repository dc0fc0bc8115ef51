"""Every Kubernetes API call the code makes, the Airflow component that makes it, and the Role that grants it.

The calls are found by scanning the sources (operators/, pipeline_steps/) for the Kubernetes clients' own method names
(every API method of ``kubernetes.client``'s generated classes, which ``kubernetes_asyncio`` shares, and the
cncf-kubernetes hook's methods that wrap one), so a new call is found without anyone listing it. Each is mapped to the
(API group, resource, subresource, verb) the API server's authorizer sees: the client method's own HTTP route, with the
group and plural of a custom-object call read from its arguments. The component is found by walking up the callers to
a root: a trigger's method runs in the triggerer, an operator's in a worker, a step's ``run`` where the DAGs run that
step (``PipelineStepOperator``: a worker). The grants are the shipped k8s/base/rbac.yaml Roles bound to each
component's service account (the Helm chart's names, tests/unit/k8s/test_airflow_rbac.py), read by the API stand-in's
own RBAC model. The table is printed (``pytest -s``); a call whose component's Role lacks the grant fails, and so does a
grant no call needs, unless it is in :data:`NOT_GRANTED` with the reason the code does without it.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.helpers.helm_accounts import release, service_account
from tests.helpers.k8s_api_stand_in import granted, rbac_grants, request_attributes, shipped_rbac

ROOT = Path(__file__).resolve().parents[3]
SOURCES = [ROOT / "operators", ROOT / "pipeline_steps"]
K8S_NS = "verl-pipeline"  # where the Roles grant (the RayJobs' namespace)
# where each step-running operator runs a step (an operator not listed here must be added with its answer)
STEP_RUNS_IN = {"PipelineStepOperator": {"worker"}, "PipelineStepJobOperator": {"worker", "ray-pod"}}
ACCOUNTS = {"ray-pod": ("verl-ray", K8S_NS)}  # the Ray pods' account (k8s/overlays/*/ray-serviceaccount.yaml)

# Calls the code makes that no Role grants, on purpose: (component, group, resource, subresource, verb) -> why the code
# works without it. Each must still be made somewhere (a stale entry fails), so the list stays short and true.
NOT_GRANTED = {
    ("worker", "apiextensions.k8s.io", "customresourcedefinitions", "", "get"): (
        "cluster-scoped; doctor's CRD check falls back to listing RayJobs (granted) on 403"
    ),
    ("worker", "apps", "deployments", "", "list"): (
        "across all namespaces (cluster scope); doctor reports the KubeRay version 'not checked' on 403"
    ),
    ("worker", "", "namespaces", "", "get"): "cluster-scoped; doctor reports the namespace 'not checked' on 403",
    ("worker", "", "nodes", "", "list"): "cluster-scoped; doctor reports GPU capacity 'not checked' on 403",
    ("worker", "", "secrets", "", "get"): (
        "doctor only: the worker reads no Secret by design; doctor reports them 'not checked' on 403"
    ),
    ("worker", "authorization.k8s.io", "selfsubjectaccessreviews", "", "create"): (
        "every authenticated identity may (Kubernetes' system:basic-user ClusterRole); no Role needed"
    ),
    ("triggerer", "", "pods", "", "list"): (
        "K8sJobMode submitter-pod log only; every rendered RayJob is HTTPMode (test_every_rendered_rayjob_is_httpmode)"
    ),
    ("triggerer", "", "pods", "log", "get"): (
        "K8sJobMode submitter-pod log only; every rendered RayJob is HTTPMode (test_every_rendered_rayjob_is_httpmode)"
    ),
}


# -- the clients' API methods ------------------------------------------------------------------------------------------
@functools.cache
def client_routes() -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """API method name -> (HTTP method, route, parameter names), from ``kubernetes.client``'s generated classes."""
    import kubernetes.client.api as api_pkg

    routes: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    for info in pkgutil.iter_modules(api_pkg.__path__):
        module = importlib.import_module(f"kubernetes.client.api.{info.name}")
        for cls in vars(module).values():
            if not (inspect.isclass(cls) and cls.__name__.endswith("Api") and cls.__module__ == module.__name__):
                continue
            for name, fn in vars(cls).items():
                if not name.endswith("_with_http_info"):
                    continue
                m = re.search(r"call_api\(\s*'([^']+)', '(GET|POST|PUT|PATCH|DELETE)'", inspect.getsource(fn))
                if not m:
                    continue
                base = name.removesuffix("_with_http_info")
                signature = inspect.signature(getattr(cls, base))
                params = tuple(p for p in signature.parameters if p not in ("self", "kwargs"))
                routes.setdefault(base, (m.group(2), m.group(1), params))
    return routes


@functools.cache
def hook_wrappers() -> dict[str, tuple[str, tuple[str, ...]]]:
    """cncf-kubernetes hook method -> (the API method it calls, its own parameter names)."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook, KubernetesHook

    routes = client_routes()
    out = {}
    for cls in (KubernetesHook, AsyncKubernetesHook):
        for name, fn in vars(cls).items():
            if name.startswith("_") or not inspect.isfunction(fn):
                continue
            called = [c for c in re.findall(r"\.(\w+)\(", inspect.getsource(fn)) if c in routes]
            if called:
                params = tuple(p for p in inspect.signature(fn).parameters if p not in ("self", "kwargs"))
                out[name] = (called[0], params)
    return out


# -- the sources -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Func:
    path: Path
    cls: str  # "" for a module-level function
    bases: tuple[str, ...]
    name: str
    node: ast.AST

    @property
    def qualname(self) -> str:
        return f"{self.cls}.{self.name}" if self.cls else self.name

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.qualname}"


@dataclass(frozen=True)
class Call:
    func: Func
    line: int
    method: str  # as written in the code (a client method or a hook wrapper)
    api_method: str  # the client API method it amounts to
    group: str
    resource: str
    sub: str
    verb: str

    @property
    def what(self) -> str:
        return f"{self.resource}{'/' + self.sub if self.sub else ''}{'.' + self.group if self.group else ''}"


@functools.cache
def modules() -> dict[Path, tuple[str, ast.Module]]:
    return {p: (p.read_text(), ast.parse(p.read_text())) for src in SOURCES for p in sorted(src.rglob("*.py"))}


def _name(node) -> str:
    return getattr(node, "id", None) or getattr(node, "attr", None) or ""


@functools.cache
def functions() -> list[Func]:
    out = []
    for path, (_, tree) in modules().items():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append(Func(path, "", (), node.name, node))
            elif isinstance(node, ast.ClassDef):
                bases = tuple(_name(b) for b in node.bases)
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        out.append(Func(path, node.name, bases, item.name, item))
    return out


def _constants(tree: ast.Module) -> dict[str, object]:
    """Module-level ``NAME = literal`` and ``A, B = literal, literal`` assignments."""
    out = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
                out[target.id] = node.value.value
            elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                for t, v in zip(target.elts, node.value.elts):
                    if isinstance(t, ast.Name) and isinstance(v, ast.Constant):
                        out[t.id] = v.value
    return out


def _argument(call: ast.Call, params: tuple[str, ...], name: str, consts: dict) -> object:
    value = next((k.value for k in call.keywords if k.arg == name), None)
    if value is None and name in params and params.index(name) < len(call.args):
        value = call.args[params.index(name)]
    if isinstance(value, ast.Constant):
        return value.value
    if isinstance(value, ast.Name):
        return consts.get(value.id)
    return None


@functools.cache
def api_calls() -> list[Call]:
    routes, wrappers = client_routes(), hook_wrappers()
    out = []
    for func in functions():
        consts = _constants(modules()[func.path][1])
        for node in ast.walk(func.node):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            method = node.func.attr
            if method in routes:
                api_method, params = method, routes[method][2]
            elif method in wrappers:
                api_method, params = wrappers[method]
            else:
                continue
            http, route, _ = routes[api_method]
            values = {}
            for placeholder in re.findall(r"\{(\w+)\}", route):
                value = _argument(node, params, placeholder, consts)
                if placeholder in ("group", "plural", "version"):
                    assert isinstance(value, str), f"{func.where}:{node.lineno}: {method}: no literal {placeholder}"
                values[placeholder] = value if placeholder in ("group", "plural", "version") else placeholder.upper()
            attrs = request_attributes(http, re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], route))
            assert attrs, f"{func.where}:{node.lineno}: {method} ({route}) is not a resource request"
            group, resource, sub, verb, _, _ = attrs
            out.append(Call(func, node.lineno, method, api_method, group, resource, sub, verb))
    return out


# -- which component makes a call --------------------------------------------------------------------------------------
@functools.cache
def step_components() -> dict[str, frozenset[str]]:
    """step name -> where the DAGs run it (from the operators they run it with)."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "dags").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and _name(node.func).endswith("Operator")):
                continue
            step = next((k.value for k in node.keywords if k.arg == "step"), None)
            if isinstance(step, ast.Constant):
                assert _name(node.func) in STEP_RUNS_IN, f"{path.name}: where does {_name(node.func)} run a step?"
                out.setdefault(step.value, set()).update(STEP_RUNS_IN[_name(node.func)])
    return {k: frozenset(v) for k, v in out.items()}


def _root(func: Func) -> frozenset[str] | None:
    if any(b.endswith("Trigger") for b in func.bases):
        return frozenset({"triggerer"})
    if any(b.endswith("Operator") for b in func.bases):
        return frozenset({"worker"})
    if func.path.parent == ROOT / "pipeline_steps" / "steps" and not func.cls and func.name == "run":
        return step_components().get(func.path.stem.replace("_", "-"), frozenset()) | step_components().get(
            func.path.stem, frozenset()
        )
    return None


@functools.cache
def _called_names() -> dict[str, set[Func]]:
    """name -> the functions that call something of that name (built once)."""
    out: dict[str, set[Func]] = {}
    for other in functions():
        for node in ast.walk(other.node):
            if isinstance(node, ast.Call) and _name(node.func):
                out.setdefault(_name(node.func), set()).add(other)
    return out


@functools.cache
def _callers(func: Func) -> list[Func]:
    """Functions calling ``func`` by name: in its own module, or in a module that names its class (a method) or its
    module (a function), so a common name elsewhere is not taken for it."""
    mark = re.compile(rf"\b{re.escape(func.cls or func.path.stem)}\b")
    return sorted(
        (
            other
            for other in _called_names().get(func.name, ())
            if other is not func and (other.path == func.path or mark.search(modules()[other.path][0]))
        ),
        key=lambda f: f.where,
    )


def components(func: Func, seen: frozenset = frozenset()) -> frozenset[str]:
    root = _root(func)
    if root is not None:
        return root
    out: frozenset[str] = frozenset()
    for caller in _callers(func):
        if caller.where not in seen:
            out |= components(caller, seen | {func.where})
    return out


# -- the grants --------------------------------------------------------------------------------------------------------
def account(component: str) -> tuple[str, str]:
    if component in ACCOUNTS:
        return ACCOUNTS[component]
    return service_account(component), release()[1]


def role_grants(component: str) -> set[tuple]:
    name, namespace = account(component)
    return rbac_grants(shipped_rbac(), name, namespace)


def role_named(component: str) -> str:
    name, namespace = account(component)
    for d in shipped_rbac():
        if d["kind"] == "RoleBinding" and any((s["namespace"], s["name"]) == (namespace, name) for s in d["subjects"]):
            return d["roleRef"]["name"]
    return "-"


@functools.cache
def table() -> list[dict]:
    rows = []
    for call in api_calls():
        comps = components(call.func)
        assert comps, f"{call.func.where}:{call.line}: {call.method}: no component reaches this call"
        for comp in sorted(comps):
            grants = role_grants(comp)
            key = (comp, call.group, call.resource, call.sub, call.verb)
            names = sorted(g[5] for g in grants if len(g) == 6 and g[:5] == (*key[1:], K8S_NS))
            ok = granted(grants, call.group, call.resource, call.sub, call.verb, K8S_NS) or bool(names)
            rows.append(
                {
                    "component": comp,
                    "call": f"{call.func.where}:{call.line}",
                    "method": call.method,
                    "what": call.what,
                    "verb": call.verb,
                    "key": key,
                    "granted": ok,
                    "by": f"Role {role_named(comp)}" + (f" (resourceNames {names})" if names else "") if ok else "",
                    "why_not": NOT_GRANTED.get(key, ""),
                }
            )
    return rows


def print_table(rows: list[dict]) -> None:
    print("\ncomponent | call | client method | resource | verb | grant")
    for r in sorted(rows, key=lambda r: (r["component"], r["what"], r["verb"], r["call"])):
        grant = r["by"] if r["granted"] else f"NOT GRANTED: {r['why_not'] or 'MISSING'}"
        print(f"{r['component']} | {r['call']} | {r['method']} | {r['what']} | {r['verb']} | {grant}")


def test_every_api_call_is_granted_to_the_component_that_makes_it():
    rows = table()
    print_table(rows)
    missing = [r for r in rows if not r["granted"] and not r["why_not"]]
    assert not missing, "calls whose component's Role lacks the grant:\n" + "\n".join(
        f"{r['component']}: {r['verb']} {r['what']} at {r['call']} ({r['method']})" for r in missing
    )
    # the scan sees what the issue names: the RayJob hook's calls and doctor's PVC read
    seen = {(r["component"], r["what"], r["verb"]) for r in rows}
    assert {("worker", "rayjobs.ray.io", "create"), ("triggerer", "rayjobs.ray.io", "get")} <= seen
    assert ("worker", "persistentvolumeclaims", "get") in seen and ("triggerer", "secrets", "get") in seen


def test_no_grant_nobody_calls_and_no_stale_exception():
    rows = table()
    made = {r["key"] for r in rows}
    for comp in ("worker", "triggerer"):
        for grant in role_grants(comp):
            key = (comp, *grant[:4])
            assert key in made, f"Role {role_named(comp)} grants {grant[3]} {grant[1]}{grant[2]} that no code calls"
    stale = set(NOT_GRANTED) - made
    assert not stale, f"NOT_GRANTED lists calls the code no longer makes: {sorted(stale)}"
    granted_anyway = {r["key"] for r in rows if r["granted"]} & set(NOT_GRANTED)
    assert not granted_anyway, f"NOT_GRANTED lists calls a Role grants: {sorted(granted_anyway)}"


def test_the_scan_finds_a_new_call(tmp_path, monkeypatch):
    """A call added anywhere is found, and a component without the grant fails."""
    extra = tmp_path / "operators" / "triggers"
    extra.mkdir(parents=True)
    (extra / "new_trigger.py").write_text(
        "class PodWatchTrigger(JobPollTrigger):\n"
        "    async def poll(self):\n"
        "        return await self.core.list_namespaced_config_map('verl-pipeline')\n"
    )
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    caches = (modules, functions, api_calls, _called_names, _callers, table)
    for fn in caches:
        fn.cache_clear()
    monkeypatch.setattr(f"{__name__}.SOURCES", [tmp_path / "operators"])
    try:
        rows = table()
    finally:
        for fn in caches:
            fn.cache_clear()
    assert [(r["component"], r["what"], r["verb"], r["granted"]) for r in rows] == [
        ("triggerer", "configmaps", "list", False)
    ]


def test_the_ray_token_secret_is_the_one_the_deployment_renders():
    """The triggerer may read one Secret: the Ray token Secret the Helm values make every RayJob use."""
    values = yaml.safe_load((ROOT / "k8s" / "airflow" / "values.yaml").read_text())
    env = {e["name"]: e.get("value") for e in values["env"]}
    names = {g[5] for g in role_grants("triggerer") if len(g) == 6 and g[1] == "secrets"}
    assert names == {env["PIPELINE_RAY_AUTH_SECRET"]}
    assert not any(len(g) == 5 and g[1] == "secrets" for g in role_grants("triggerer")), "no Secret but that one"


def test_doctor_asks_for_exactly_the_workers_grants():
    from pipeline_steps.steps.doctor import VERBS

    grants = {g[:4] for g in role_grants("worker") if len(g) == 5}
    assert set(VERBS) == grants


def test_every_rendered_rayjob_is_httpmode(monkeypatch):
    """The triggerer needs no pod access because no rendered RayJob has a submitter pod (K8sJobMode)."""
    from tests.helpers.render import EXAMPLES, render

    template = yaml.safe_load((ROOT / "pipeline_steps" / "training" / "rayjob_template.yaml").read_text())
    assert template["spec"]["submissionMode"] == "HTTPMode"
    assert "submissionMode" not in (ROOT / "pipeline_steps" / "training" / "rayjob_manifest.py").read_text()
    monkeypatch.setenv("PIPELINE_TRAIN_IMAGE", "registry.example.com/verl-grpo-train@sha256:" + "0" * 64)
    for preset, mounts, bucket, dataset in EXAMPLES:
        _, job = render(preset, mounts, bucket, dataset)
        assert job["spec"]["submissionMode"] == "HTTPMode", preset
