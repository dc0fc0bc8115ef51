"""File operations on one sandbox's directory, done by the (root) server on the host but confined to what the jail
shows as ``/home/user``.

A path is mapped lexically to a path below the sandbox's directory (anything else is refused), then resolved by the
kernel with ``openat2(RESOLVE_BENEATH)`` from a descriptor of that directory: a symlink the sandbox's code planted
(``ln -s /etc`` or ``../slot-3``) cannot lead out, even if it is swapped in while the server walks the path. The
directory is a tmpfs of the sandbox's disk size, so what is written here is bounded as the code's own writes are.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import errno
import os
import posixpath
import shutil
import stat

HOME = "/home/user"
SYS_OPENAT2 = 437  # the same number on every architecture (added after the syscall tables were unified)
RESOLVE_NO_XDEV, RESOLVE_NO_MAGICLINKS, RESOLVE_BENEATH = 0x01, 0x02, 0x08
CHUNK = 1 << 20


class FsError(Exception):
    """``kind``: ``invalid``, ``denied``, ``not_found``, ``exists``, ``no_space``."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _openat2(dirfd: int, rel: str, flags: int, mode: int = 0) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)
    for _ in range(16):  # EAGAIN: a concurrent rename made the kernel unsure the walk stayed beneath
        fd = _libc.syscall(SYS_OPENAT2, dirfd, rel.encode(), ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err != errno.EAGAIN:
            break
    raise OSError(err, os.strerror(err), rel)


def _fs_error(exc: OSError, path: str) -> FsError:
    if exc.errno in (errno.EXDEV, errno.ELOOP):
        return FsError("denied", f"{path}: leads outside {HOME}")
    if exc.errno == errno.ENOENT:
        return FsError("not_found", f"{path}: no such file or directory")
    if exc.errno == errno.EEXIST:
        return FsError("exists", f"{path}: already exists")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return FsError("no_space", f"{path}: the sandbox's disk is full")
    if exc.errno in (errno.ENOTDIR, errno.EISDIR, errno.ENOTEMPTY, errno.EINVAL, errno.ENAMETOOLONG):
        return FsError("invalid", f"{path}: {exc.strerror}")
    return FsError("denied", f"{path}: {exc.strerror}")


class Home:
    """The sandbox's directory as its code sees it. Open it while the sandbox is known to be running (then a late
    request keeps the old tmpfs, never a successor's) and close it after the operation."""

    def __init__(self, workdir, uid: int):
        self.uid = uid
        self.root = os.open(workdir, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)

    def close(self):
        os.close(self.root)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ paths

    @staticmethod
    def relative(path: str) -> str:
        """``path`` (absolute, or relative to the home as envd takes it) below the home, or FsError."""
        if not path or "\0" in path:
            raise FsError("invalid", "empty path or a path with a NUL byte")
        norm = posixpath.normpath(path if path.startswith("/") else f"{HOME}/{path}")
        if norm == HOME:
            return "."
        if not norm.startswith(HOME + "/"):
            raise FsError("denied", f"{path}: only {HOME} is reachable")
        return norm[len(HOME) + 1 :]

    @staticmethod
    def jail_path(rel: str) -> str:
        return HOME if rel == "." else f"{HOME}/{rel}"

    def _parent(self, rel: str, create: bool = False) -> tuple[int, str]:
        """A descriptor of ``rel``'s directory (made, owned by the sandbox, if ``create``) and its last name."""
        if rel == ".":
            raise FsError("invalid", f"{HOME} itself cannot be replaced or removed")
        head, name = posixpath.split(rel)
        if create and head:
            self.make_dirs(head)
        try:
            return _openat2(self.root, head or ".", os.O_PATH | os.O_DIRECTORY), name
        except OSError as exc:
            raise _fs_error(exc, self.jail_path(rel)) from None

    # ------------------------------------------------------------------ operations

    def make_dirs(self, rel: str) -> bool:
        """``mkdir -p``; False if it was already a directory."""
        made = False
        parts = rel.split("/") if rel != "." else []
        for i in range(len(parts)):
            sub = "/".join(parts[: i + 1])
            try:
                os.close(_openat2(self.root, sub, os.O_PATH | os.O_DIRECTORY))
                continue
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise _fs_error(exc, self.jail_path(sub)) from None
            parent, name = self._parent(sub)
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
                os.chown(name, self.uid, self.uid, dir_fd=parent, follow_symlinks=False)
                made = True
            except OSError as exc:
                raise _fs_error(exc, self.jail_path(sub)) from None
            finally:
                os.close(parent)
        return made

    def open_read(self, path: str) -> tuple[int, int]:
        """A descriptor of a regular file and its size."""
        rel = self.relative(path)
        try:
            fd = _openat2(self.root, rel, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)  # a FIFO must not block
        except OSError as exc:
            raise _fs_error(exc, path) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise FsError("invalid", f"{path}: not a regular file")
        return fd, st.st_size

    def write(self, path: str, source) -> str:
        """Copy the binary file object ``source`` to ``path`` (parents made); returns its path in the jail."""
        rel = self.relative(path)
        if rel == ".":
            raise FsError("invalid", f"{HOME} is a directory")
        if "/" in rel:
            self.make_dirs(posixpath.dirname(rel))
        try:
            fd = _openat2(self.root, rel, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY, 0o644)
        except OSError as exc:
            raise _fs_error(exc, path) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise FsError("invalid", f"{path}: not a regular file")
            os.ftruncate(fd, 0)
            os.fchown(fd, self.uid, self.uid)
            while chunk := source.read(CHUNK):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
        except OSError as exc:
            os.ftruncate(fd, 0)  # a write the disk could not hold gives its space back
            raise _fs_error(exc, path) from None
        finally:
            os.close(fd)
        return self.jail_path(rel)

    def entry(self, dirfd: int, name: str, jail_path: str) -> dict:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "symlink" if stat.S_ISLNK(st.st_mode) else "file"
        who = {self.uid: "user", 0: "root"}
        info = {
            "name": posixpath.basename(jail_path) or "/",
            "type": kind,
            "path": jail_path,
            "size": st.st_size,
            "mode": stat.S_IMODE(st.st_mode),
            "permissions": stat.filemode(st.st_mode),
            "owner": who.get(st.st_uid, str(st.st_uid)),
            "group": who.get(st.st_gid, str(st.st_gid)),
            "modified": dt.datetime.fromtimestamp(st.st_mtime, dt.timezone.utc),
        }
        if kind == "symlink":  # told, never followed here
            info["symlink_target"] = os.readlink(name, dir_fd=dirfd)
        return info

    def stat(self, path: str) -> dict:
        rel = self.relative(path)
        if rel == ".":
            return self.entry(self.root, ".", HOME) | {"name": "user"}
        parent, name = self._parent(rel)
        try:
            return self.entry(parent, name, self.jail_path(rel))
        except OSError as exc:
            raise _fs_error(exc, path) from None
        finally:
            os.close(parent)

    def list(self, path: str, depth: int = 1) -> list[dict]:
        rel = self.relative(path)
        try:
            fd = _openat2(self.root, rel, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise _fs_error(exc, path) from None
        out: list[dict] = []
        try:
            self._walk(fd, self.jail_path(rel), max(depth, 1), out)
        finally:
            os.close(fd)
        return out

    def _walk(self, fd: int, jail_dir: str, depth: int, out: list[dict]):
        for name in sorted(os.listdir(fd)):
            try:
                info = self.entry(fd, name, f"{jail_dir.rstrip('/')}/{name}")
            except FileNotFoundError:  # removed meanwhile
                continue
            out.append(info)
            if depth > 1 and info["type"] == "dir":
                try:
                    sub = _openat2(fd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                except OSError:
                    continue
                try:
                    self._walk(sub, info["path"], depth - 1, out)
                finally:
                    os.close(sub)

    def remove(self, path: str):
        rel = self.relative(path)
        parent, name = self._parent(rel)
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=parent)  # descriptor-based: does not follow symlinks out
            else:
                os.unlink(name, dir_fd=parent)
        except OSError as exc:
            raise _fs_error(exc, path) from None
        finally:
            os.close(parent)

    def move(self, source: str, destination: str) -> dict:
        src_rel, dst_rel = self.relative(source), self.relative(destination)
        src_parent, src_name = self._parent(src_rel)
        try:
            dst_parent, dst_name = self._parent(dst_rel, create=True)
            try:
                os.rename(src_name, dst_name, src_dir_fd=src_parent, dst_dir_fd=dst_parent)
                return self.entry(dst_parent, dst_name, self.jail_path(dst_rel))
            except OSError as exc:
                raise _fs_error(exc, source) from None
            finally:
                os.close(dst_parent)
        finally:
            os.close(src_parent)
