"""The suite's rules, and the shared fixtures' registration (``pytest_plugins`` below: the fixtures live in
tests/helpers/, see tests/README.md):

* markers: ``slow`` (real Airflow, Ray or training end to end, a package built and installed, or any test over about
  5 s of CPU: a model built, merged or evaluated, verl imported in a subprocess), ``browser``
  (starts Chromium), ``needs_root`` (skipped, with the reason in the summary, when not root), ``budget(seconds)``
  (the test's time budget);
* every test has a time budget (``budget`` marker; 120 s by default, 600 s for a ``slow`` test): a test that passes
  but took longer fails with the measured time, and pytest-timeout stops it at three times its budget;
  ``PIPELINE_TEST_BUDGET_SCALE`` multiplies every budget (two suites sharing one machine);
* under pytest-xdist (``make test`` and ``make test-fast``; the worker counts and why are in the Makefile) a
  module's tests stay on one worker (they may share module fixtures and order) unless the module is in
  ``SPLIT_MODULES``; the heaviest modules are handed out first, so the longest test does not start last, and none is
  queued behind another slow one;
* a process the tests started (below pytest, or carrying the run's ``PIPELINE_TEST_RUN``) still alive when the run
  ends fails the run (after a grace period), with its command line, and is killed (tests/helpers/leftovers.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# asserts in the helpers report their values as a test's own do (their modules are imported by the tests, not collected)
pytest.register_assert_rewrite("tests.helpers")

from tests.helpers.budget import scaled  # noqa: E402 (after the line above, so its asserts are rewritten too)
from tests.helpers.leftovers import TEST_RUN  # noqa: E402

# the shared fixtures, usable by name in every test module (tests/README.md: tests/helpers/)
pytest_plugins = [
    "tests.helpers.model_fixtures",  # hub_cache, offline_hub, tiny_model, tiny_vl_model
    "tests.helpers.k8s_connection",  # k8s_api
    "tests.helpers.storage_servers",  # oss_server, gcs_server, oss_seaweed_server
    "tests.helpers.store_under_test",  # backend: file://, oss://, gs:// (parametrized)
    "tests.helpers.train_local_runs",  # assets: the tiny model, a gsm8k parquet and a varied reward
    "tests.helpers.operator_runs",  # ray_cluster: a private local Ray cluster per module
    "tests.helpers.doctor_cluster",  # cluster: a ready ACK cluster on the Kubernetes API stand-in
    "tests.helpers.postgres",  # postgres: a PostgreSQL 15 cluster per module
    "tests.helpers.leftovers",  # no process the tests started outlives the run
]

# the best-effort caches (checksums, the built tiny model) are this run's own, shared by its workers and the
# processes they start: every whole-DAG test stages the same tiny model, built once per run, never a user's cache
CACHE_DIR = Path(tempfile.gettempdir()) / f"pipeline-test-cache-{TEST_RUN}"
os.environ["PIPELINE_CACHE_DIR"] = str(CACHE_DIR)
# one torch (OpenMP) thread per process: the workers and their children already oversubscribe two cores, and
# torch's threads spin-wait when oversubscribed. Measured building the tiny tool model beside three busy processes:
# 55 s of CPU (78 s wall) with two threads, 18 s (36 s) with one. Set before any test imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the test Airflows parse each DAG file once and not again every 30 s: no test edits a DAG file under a running
# Airflow, and the re-parses were half of an idle Airflow's CPU (measured over 90 s: 8.3 s of CPU with Airflow's
# default, 4.3 s with this; the DAG processor alone 4.3 s -> 0.8 s), times a dozen Airflows in one run
os.environ.setdefault("AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL", "600")
DEFAULT_BUDGET_S, SLOW_BUDGET_S = 120, 600


def budget_of(item) -> float:
    marker = item.get_closest_marker("budget")
    if marker:
        return scaled(float(marker.args[0]))
    return scaled(SLOW_BUDGET_S if item.get_closest_marker("slow") else DEFAULT_BUDGET_S)


# Modules whose tests each get a worker of their own (each test starts its own store server and Airflow home); every
# other module's tests stay on one worker, sharing its module fixtures.
SPLIT_MODULES = {"tests/e2e/test_cloud_store_dag.py"}


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


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: only the tests that run weigh their scope
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
        # measured times), then the sum of its slow tests' budgets, of its fast tests' explicit budgets (a fast test
        # that waits long says so with one) and a second per other fast test
        scope, slow = scope_of(item.nodeid), bool(item.get_closest_marker("slow"))
        longest, total = weights.get(scope, (0.0, 0.0))
        weighed = budget if slow or item.get_closest_marker("budget") else 1.0
        weights[scope] = (max(longest, budget if slow else 0.0), total + weighed)
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


_TINY_MODEL_BUILD: list = []  # the controller's background build of the tiny model (pytest_sessionstart)


def pytest_sessionstart(session):
    """``make test`` (xdist, slow tests selected): build the tiny model once, in a process of its own started before
    the workers. A dozen whole-DAG tests stage it; without this, the first of them built it inside its budget while
    the others waited on the build lock. Not awaited here: the workers start and collect while it builds (about 20 s
    of one core that used to pass before any worker started), and a test that stages it first waits on the build
    cache's lock (pipeline_steps/local/build_cache.py), then takes the built model."""
    config = session.config
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    if "not slow" in (config.getoption("markexpr") or ""):
        return
    import subprocess
    import sys

    code = "import sys; from pipeline_steps.local import tiny_model; tiny_model.build_cached(*sys.argv[1:3])"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    log = open(CACHE_DIR / "tiny-model-build.log", "w")  # noqa: SIM115 (closed at the session's end)
    argv = [sys.executable, "-c", code, str(CACHE_DIR), str(CACHE_DIR / "uncached")]
    _TINY_MODEL_BUILD.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), log))


@pytest.hookimpl(tryfirst=True)  # before the leftover check: the build is a process the run started
def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller checks once, after all workers
        return
    for proc, log in _TINY_MODEL_BUILD:
        killed = proc.poll() is None  # a run that ended before the build did (-x, Ctrl-C)
        if killed:
            proc.kill()
        proc.wait()
        log.close()
        if proc.returncode and not killed:  # the tests that staged the model failed on it too; say why here
            print(f"\nthe tiny model's build failed (exit {proc.returncode}):\n{Path(log.name).read_text()[-3000:]}")
    shutil.rmtree(CACHE_DIR, ignore_errors=True)
