"""Shared fixtures (an offline Hugging Face cache built from the shipped fixtures, the tiny local model, the
Kubernetes API stand-in behind an Airflow connection) and the suite's rules:

* markers: ``slow`` (real Airflow, Ray or training end to end, or a package built and installed), ``browser`` (starts Chromium), ``needs_root``
  (skipped, with the reason in the summary, when not root), ``budget(seconds)`` (the test's time budget);
* every test has a time budget (``budget`` marker; 120 s by default, 600 s for a ``slow`` test): a test that passes
  but took longer fails with the measured time, and pytest-timeout stops it at three times its budget;
* under pytest-xdist (``make test``: ``-n 4``) a module's tests stay on one worker (they may share module fixtures
  and order) unless the module is in ``SPLIT_MODULES``; the heaviest modules are handed out first, so the longest
  test does not start last, and none is queued behind another slow one;
* every process the tests start carries ``PIPELINE_TEST_RUN`` in its environment; one still alive when the run ends
  fails the run (after a grace period), with its command line, and is killed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

# inherited by xdist workers and by every process a test starts: how the end of the run finds what is left over
TEST_RUN = os.environ.setdefault("PIPELINE_TEST_RUN", uuid.uuid4().hex)
# the best-effort caches (checksums, the built tiny model) are this run's own, shared by its workers and the
# processes they start: every whole-DAG test stages the same tiny model, built once per run, never a user's cache
CACHE_DIR = Path(tempfile.gettempdir()) / f"pipeline-test-cache-{TEST_RUN}"
os.environ["PIPELINE_CACHE_DIR"] = str(CACHE_DIR)
# one torch (OpenMP) thread per process: four workers and their children already oversubscribe two cores, and torch's
# threads spin-wait when oversubscribed. Measured building the tiny tool model beside three busy processes:
# 55 s of CPU (78 s wall) with two threads, 18 s (36 s) with one. Set before any test imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
DEFAULT_BUDGET_S, SLOW_BUDGET_S = 120, 600


def budget_of(item) -> float:
    marker = item.get_closest_marker("budget")
    if marker:
        return float(marker.args[0])
    return SLOW_BUDGET_S if item.get_closest_marker("slow") else DEFAULT_BUDGET_S


# Modules whose tests each get a worker of their own (each test starts its own PostgreSQL and Airflow, or its own
# store server and Airflow home); every other module's tests stay on one worker, sharing its module fixtures.
SPLIT_MODULES = {"tests/test_postgres_profile.py", "tests/test_cloud_store_dag.py"}


def scope_of(nodeid: str) -> str:
    """The unit of work xdist hands to a worker: a test of a SPLIT_MODULES module, else a whole module."""
    module = nodeid.split("::")[0]
    return nodeid if module in SPLIT_MODULES else module


def pytest_xdist_make_scheduler(config, log):
    """xdist's loadscope scheduling with our scopes, in collection order (the heaviest first, as sorted below).

    Not ``--dist loadgroup``: xdist 3.8 marks a group by rewriting ``item._nodeid``, which pytest 9 no longer reads,
    so every test became its own group and a module's fixtures (an Airflow, a training run) ran once per worker.
    """
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            """xdist hands a worker its next scope while the current one's last tests still run (a worker holds
            its last test until it knows the next): queued behind a slow end-to-end test, the next scope waits for
            it. So a worker still busy with a slow scope gets the lightest scope left, and an otherwise idle one the
            heaviest: no slow test waits behind another."""
            if not hasattr(self, "_slow"):
                self._slow = _slow_scopes()
            busy = any(
                scope in self._slow and not all(unit.values())
                for scope, unit in self.assigned_work.get(node, {}).items()
            )
            if busy and self.workqueue:
                self.workqueue.move_to_end(next(reversed(self.workqueue)), last=False)
            super()._assign_work_unit(node)

    config.option.loadscopereorder = False  # xdist would re-sort the scopes by their number of tests
    return ModuleScheduling(config, log)


# each worker's collection writes the scopes holding slow tests here; the controller's scheduler reads it
SLOW_SCOPES = CACHE_DIR / "slow-scopes.json"


def _slow_scopes() -> set[str]:
    try:
        return set(json.loads(SLOW_SCOPES.read_text()))
    except (OSError, ValueError):
        return set()  # not written: every scope is treated alike, in the collection's order


def pytest_collection_modifyitems(config, items):
    weights: dict[str, tuple[float, float]] = {}
    for item in items:
        if item.get_closest_marker("needs_root") and os.geteuid() != 0:
            reason = item.get_closest_marker("needs_root").kwargs.get("reason", "")
            item.add_marker(pytest.mark.skip(reason=f"needs root ({reason}): run as root to include it"))
        budget = budget_of(item)
        if not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(budget * 3))
        # a scope's weight: its longest slow test's budget (the long end-to-end runs carry budgets set from their
        # measured times), then the sum of its slow tests' budgets and a second per fast test
        scope, slow = scope_of(item.nodeid), bool(item.get_closest_marker("slow"))
        longest, total = weights.get(scope, (0.0, 0.0))
        weights[scope] = (max(longest, budget if slow else 0.0), total + (budget if slow else 1.0))
    # heaviest scopes first (stable within one): the long end-to-end runs start while the short tests fill in
    order = {id(item): (tuple(-w for w in weights[scope_of(item.nodeid)]), i) for i, item in enumerate(items)}
    items.sort(key=lambda item: order[id(item)])
    if hasattr(config, "workerinput"):
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = SLOW_SCOPES.with_name(f".{SLOW_SCOPES.name}.{os.getpid()}")
        tmp.write_text(json.dumps(sorted(scope for scope, (longest, _) in weights.items() if longest)))
        os.replace(tmp, SLOW_SCOPES)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and report.passed and call.duration > budget_of(item):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} passed but took {call.duration:.1f} s, over its budget of {budget_of(item):.0f} s "
            "(pytest.mark.budget): find what got slower, or raise the budget with the measured figure"
        )


def _leftovers() -> list[tuple[int, str]]:
    """Processes (other than this one) whose environment carries this run's PIPELINE_TEST_RUN."""
    found, token = [], f"PIPELINE_TEST_RUN={TEST_RUN}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if token in (entry / "environ").read_bytes().split(b"\0"):
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                stat = (entry / "stat").read_text()
                if cmd and stat.rsplit(")", 1)[1].split()[0] != "Z":
                    found.append((int(entry.name), cmd[:160]))
        except OSError:
            continue
    return found


def pytest_sessionstart(session):
    """``make test`` (xdist, slow tests selected): build the tiny model once, before any worker starts. A dozen
    whole-DAG tests stage it at their start; built inside them it costs the first of them minutes of their budgets
    while the others wait on the build lock."""
    config = session.config
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    if "not slow" in (config.getoption("markexpr") or ""):
        return
    from pipeline_steps.local import tiny_model

    started = time.monotonic()
    tiny_model.build_cached(CACHE_DIR, CACHE_DIR / "uncached")
    print(f"\ntiny model built once for this run in {time.monotonic() - started:.0f} s ({CACHE_DIR})")


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller checks once, after all workers
        return
    shutil.rmtree(CACHE_DIR, ignore_errors=True)
    deadline = time.monotonic() + 30  # Ray and Airflow processes take a few seconds to exit after their stop
    left = _leftovers()
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left = _leftovers()
    if left:
        for pid, _ in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        lines = "\n".join(f"  {pid}: {cmd}" for pid, cmd in left)
        sys.stderr.write(
            f"\n{len(left)} process(es) started by the tests were still alive at the end (killed):\n{lines}\n"
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


pytest_plugins = ["tests.storage_servers"]  # the object-store server fixtures

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory):
    """A Hugging Face cache (HF_HUB_CACHE) holding every fixture repository; the Hub itself is unreachable here."""
    from pipeline_steps.local import offline_hub as local_hub

    cache = tmp_path_factory.mktemp("hf-cache")
    index = local_hub.build_cache(local_hub.FIXTURES, cache)
    return {"path": cache, "index": index}


@pytest.fixture
def offline_hub(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache["path"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from pipeline_steps.local import tiny_model

    # without the format warm-up: the random-weight model the trainer and step tests were written against (its
    # responses vary in form, which their rewards rely on); tests/test_learning.py builds the warmed-up default
    return tiny_model.build(tmp_path_factory.mktemp("tiny") / "model", format_warmup_steps=0)


K8S_CONN_ID = "k8s_standin"
K8S_NAMESPACE = "training"
RAYJOB_CRD = ROOT / "k8s" / "crds" / "ray.io_rayjobs.v1.7.0.yaml"


@pytest.fixture
def k8s_api(tmp_path, monkeypatch):
    """tests/k8s_api_stand_in.py's API server (RayJobs checked against the vendored KubeRay v1.7.0 CRD),
    reached through the Airflow connection ``k8s_standin`` (namespace ``training``)."""
    from tests.k8s_api_stand_in import StandIn

    api = StandIn(crd_file=RAYJOB_CRD)
    api.start()
    kube_config = api.kube_config(tmp_path / "kubeconfig", namespace=K8S_NAMESPACE)
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{K8S_CONN_ID.upper()}",
        json.dumps(
            {"conn_type": "kubernetes", "extra": {"kube_config_path": str(kube_config), "namespace": K8S_NAMESPACE}}
        ),
    )
    try:
        yield api
    finally:
        api.stop()


def run_step(*args, env=None, check=None, cwd=ROOT):
    """Run ``python -m pipeline_steps ...`` as a user would; returns (exit code, summary dict, stderr)."""
    full_env = dict(os.environ, **(env or {}))
    p = subprocess.run(
        [sys.executable, "-m", "pipeline_steps", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=600,
    )
    lines = p.stdout.strip().splitlines()
    summary = json.loads(lines[-1]) if lines else None
    if check is not None:
        assert p.returncode == check, f"exit {p.returncode}, stderr:\n{p.stderr[-3000:]}"
    return p.returncode, summary, p.stderr


def assert_refused(code: int, err: str, *needles: str) -> None:
    """A step refused bad input as users should see it: exit 2, one stderr line naming it, no traceback."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
