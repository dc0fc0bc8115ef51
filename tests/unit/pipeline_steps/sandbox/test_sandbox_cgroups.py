"""The cgroup v2 side of the sandbox cgroups. This machine runs cgroup v1 (v2's hierarchy is mounted with no
controllers), so v1 is tested for real through the sandbox server
(tests/unit/pipeline_steps/sandbox/test_sandbox_limits.py); here a directory tree laid out as a v2 container's cgroup
stands in for cgroupfs, to check which files the code writes and what into (the kernel's side, refusing or applying
them, is not exercised)."""

from __future__ import annotations

from pipeline_steps.sandbox.cgroups import PARENT, Cgroups


def _v2_tree(tmp_path, procs="11\n12\n"):
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    own = tmp_path / "kubepods" / "pod1"
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids\n")
    (own / "cgroup.subtree_control").write_text("\n")
    (own / "cgroup.procs").write_text(procs)
    return own


def test_v2_moves_own_processes_to_a_leaf_and_delegates(tmp_path):
    own = _v2_tree(tmp_path)
    cg = Cgroups(root=tmp_path, own={"": "/kubepods/pod1"})
    assert cg.version == 2
    # "no internal processes": ours went to a leaf before the controllers were handed to children
    assert (own / "server" / "cgroup.procs").read_text() in ("11", "12")
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert (own / PARENT / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"

    sb = cg.sandbox(1_500_007)
    d = own / PARENT / "uid-1500007"
    d.mkdir()
    (d / "memory.swap.max").write_text("max\n")  # present when the kernel has swap accounting
    sb.create(memory_mb=512, max_processes=32, cpus=2)
    assert (d / "memory.max").read_text() == str(512 << 20)
    assert (d / "memory.swap.max").read_text() == "0"
    assert (d / "pids.max").read_text() == "32"
    assert (d / "cpu.max").read_text() == "200000 100000"
    assert sb.procs_files() == [str(d / "cgroup.procs")]
    assert cg.leftovers() == [1_500_007]


def test_v1_is_detected_without_v2_controllers(tmp_path):
    for c in ("memory", "pids", "cpu", "freezer"):
        (tmp_path / c).mkdir()
    (tmp_path / "memory" / "a").mkdir()  # the server's own memory cgroup, as here (/process_api/...)
    cg = Cgroups(root=tmp_path, own={"memory": "/a", "pids": "/", "cpu": "/", "freezer": "/"})
    assert cg.version == 1
    assert cg.bases["memory"] == tmp_path / "memory" / "a" / PARENT
    sb = cg.sandbox(5)
    sb.create(memory_mb=64, max_processes=8, cpus=1)
    mem = tmp_path / "memory" / "a" / PARENT / "uid-5"
    assert (mem / "memory.limit_in_bytes").read_text() == str(64 << 20)
    assert (tmp_path / "cpu" / PARENT / "uid-5" / "cpu.cfs_quota_us").read_text() == "100000"
    assert len(sb.procs_files()) == 4  # the new process joins every hierarchy
