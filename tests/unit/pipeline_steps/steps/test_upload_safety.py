"""Upload sources hold regular files only, the destination never lies in the source, and the remedy a corrupted
download prints works. Real CLI, real file:// store (and the OSS test server for the FIFO case).

Before: a FIFO hung the upload until the timeout; a symlink to /dev/urandom wrote without bound; a symlink to a file
outside the source uploaded that file; a symlinked directory was skipped silently; ``--dest`` inside ``--src``
withdrew the committed manifest on the second run and nested the store in the version on the third; a stored file
changed in place (same size and mtime) made ``download`` fail and tell the user to re-upload, which sent 0 bytes.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.step_cli import assert_refused, run_step


def _src(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "train.parquet").write_bytes(b"PAR1" + b"x" * 1000)
    (src / "sub" / "stats.json").write_text("{}")
    return src


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda src, tmp: os.mkfifo(src / "pipe"), "not a regular file"),
        (lambda src, tmp: (src / "random").symlink_to("/dev/urandom"), "outside the source"),
        (lambda src, tmp: (src / "leak").symlink_to(tmp / "secret.txt"), "outside the source"),
        (lambda src, tmp: (src / "linkdir").symlink_to(tmp / "elsewhere"), "outside the source"),
        (lambda src, tmp: (src / "inner").symlink_to(src / "sub"), "directory or special file"),
        (lambda src, tmp: (src / "dangling").symlink_to(tmp / "nope"), "broken symlink"),
    ],
    ids=["fifo", "dev-urandom", "file-outside", "dir-outside", "dir-inside", "dangling"],
)
def test_non_regular_sources_are_refused_before_any_byte_is_sent(tmp_path, make, needle):
    src = _src(tmp_path)
    (tmp_path / "secret.txt").write_text("not for the store")
    (tmp_path / "elsewhere").mkdir()
    make(src, tmp_path)
    dest = tmp_path / "store" / "v1"
    code, _, err = run_step("upload", "--src", src, "--dest", f"file://{dest}")
    assert_refused(code, err, needle)
    assert not dest.exists() or not any(dest.rglob("*"))


def test_a_symlink_to_a_file_inside_the_source_uploads_that_file(tmp_path):
    src = _src(tmp_path)
    (src / "alias.parquet").symlink_to(src / "train.parquet")
    dest = tmp_path / "store" / "v1"
    code, s, err = run_step("upload", "--src", src, "--dest", f"file://{dest}")
    assert code == 0, err
    assert (dest / "alias.parquet").read_bytes() == (src / "train.parquet").read_bytes()
    assert not (dest / "alias.parquet").is_symlink()


def test_dest_inside_or_equal_to_src_is_refused(tmp_path):
    src = _src(tmp_path)
    for dest, needle in ((src / "store" / "v1", "lies inside the input --src"), (src, "is the input --src")):
        code, _, err = run_step("upload", "--src", src, "--dest", f"file://{dest}")
        assert_refused(code, err, needle)
    assert sorted(p.name for p in src.iterdir()) == ["sub", "train.parquet"]


def test_the_remedy_a_corrupted_download_prints_works(tmp_path):
    src = _src(tmp_path)
    dest = tmp_path / "store" / "v1"
    code, _, err = run_step("upload", "--src", src, "--dest", f"file://{dest}")
    assert code == 0, err
    stored = dest / "train.parquet"
    st = stored.stat()
    data = bytearray(stored.read_bytes())
    data[10] ^= 0xFF  # flip bits in place, same size; then restore the mtime
    stored.write_bytes(bytes(data))
    os.utime(stored, ns=(st.st_atime_ns, st.st_mtime_ns))
    from pipeline_steps.errors import TransientError
    from pipeline_steps.store import open_store

    store = open_store(f"file://{dest}")
    with pytest.raises(TransientError, match="re-upload it"):
        store.download_dir(f"file://{dest}", tmp_path / "copy")
    code, s, err = run_step("upload", "--src", src, "--dest", f"file://{dest}")  # the remedy
    assert code == 0, err
    assert s["uploaded"] == 1 and s["bytes_uploaded"] >= 1004  # the corrupted file was re-read and repaired
    open_store(f"file://{dest}").download_dir(f"file://{dest}", tmp_path / "copy2")
    assert (tmp_path / "copy2" / "train.parquet").read_bytes() == (src / "train.parquet").read_bytes()


def test_store_files_get_one_mode_and_a_killed_writers_temp_files_are_cleaned(tmp_path):
    """Before: manifests and pointers (written via mkstemp) were 0600 while data files were 0644; a killed upload
    left ``.tmp-*`` files inside the committed version for good. Now every stored file gets the same mode (0666
    minus the umask, as open() gives) and the next upload of the version removes a dead writer's temp file (while
    a live writer's stays)."""
    import subprocess
    import sys

    from pipeline_steps.store import open_store

    src = _src(tmp_path)
    version = tmp_path / "store" / "datasets" / "x" / "v1"
    dest = f"file://{version}"
    old = os.umask(0o022)
    try:
        code, _, err = run_step("upload", "--src", src, "--dest", dest)
        assert code == 0, err
        open_store(dest).write_bytes(f"file://{tmp_path / 'store' / 'datasets' / 'x' / 'latest.json'}", b"{}")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "store").rglob("*") if p.is_file()}
    assert set(modes.values()) == {0o644}, modes

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = version / f".tmp-train.parquet.{dead.pid}"  # what copy_file leaves when killed mid-copy
    live = version / f".tmp-other.parquet.{os.getpid()}"  # a writer that is still running
    stale.write_bytes(b"partial")
    live.write_bytes(b"in progress")
    code, _, err = run_step("upload", "--src", src, "--dest", dest)
    assert code == 0, err
    assert not stale.exists() and live.exists()
