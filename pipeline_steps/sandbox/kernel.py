"""One sandbox's persistent Python interpreter (standard library only).

The server starts it inside bubblewrap (``pool.jail_command``): a root of its own that holds only the Python
installation (read-only), the sandbox's directory as ``/home/user``, a private ``/tmp`` and ``/dev``, new network,
pid, IPC and UTS namespaces, in the sandbox's cgroup. It still runs as root there, so before any untrusted code it:

1. remounts ``/proc`` with ``hidepid=2`` (bubblewrap's init, pid 1, runs as root: not even listed);
2. sets resource limits per process (CPU seconds, address space, processes, open files, file size, no core files;
   the cgroup bounds the sandbox as a whole);
3. sets ``no_new_privs``, then takes the sandbox's own uid/gid with no supplementary groups (which drops every
   capability).

Protocol: requests are JSON lines, events JSON lines (the server passes them as this process's stdin and stdout,
which are moved to higher fds at start); fds 0-2 are ``/dev/null``, so only Python-level ``sys.stdout`` /
``sys.stderr`` output is captured (output of child processes is dropped). A ``code`` request is a notebook cell:
events use the E2B code interpreter's NDJSON shapes (``stdout``, ``stderr``, ``result`` with IPython's formats,
``error``, ``number_of_executions``). An ``argv`` request runs a command (envd's ``commands.run``) as a child of
this process, so in the same jail, uid, cgroup and limits: ``cmd_start``, ``cmd_data`` (base64), ``cmd_end``. Both
end with ``done``. The output cap here only saves work: the server enforces it on what it reads.
"""

import ast
import base64
import builtins
import ctypes
import io
import json
import os
import resource
import sys
import time
import traceback

MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
PR_SET_NO_NEW_PRIVS = 38
HOME = "/home/user"


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def confine(cfg):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    _check(libc.mount(b"proc", b"/proc", b"proc", flags, b"hidepid=2"), "mount /proc")

    mb = 1024 * 1024
    limits = {
        resource.RLIMIT_CPU: (cfg["cpu_seconds"], cfg["cpu_seconds"] + 1),
        resource.RLIMIT_AS: (cfg["memory_mb"] * mb,) * 2,
        resource.RLIMIT_NPROC: (cfg["max_processes"],) * 2,
        resource.RLIMIT_NOFILE: (cfg["max_open_files"],) * 2,
        resource.RLIMIT_FSIZE: (cfg["max_file_mb"] * mb,) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, value in limits.items():
        resource.setrlimit(which, value)

    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
    uid = cfg["uid"]
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    os.chdir(HOME)


class _Events:
    """Writes events to fd 4; caps each execution's output so a flood costs CPU time, not memory or bandwidth."""

    def __init__(self, fd, max_output):
        self.out = os.fdopen(fd, "w", buffering=1, encoding="utf-8")
        self.max_output = max_output
        self.sent = 0
        self.dropped = 0

    def emit(self, **event):
        self.out.write(json.dumps(event) + "\n")

    def text(self, kind, text):
        room = self.max_output - self.sent
        if room <= 0:
            self.dropped += len(text)
            return
        if len(text) > room:
            self.dropped += len(text) - room
            text = text[:room]
        self.sent += len(text)
        self.emit(type=kind, text=text, timestamp=int(time.time() * 1e9))


class _Stream(io.TextIOBase):
    def __init__(self, events, kind):
        self.events, self.kind = events, kind

    def writable(self):
        return True

    def write(self, s):
        if s:
            self.events.text(self.kind, str(s))
        return len(s)


# IPython's rich display methods and the code interpreter's result keys (png/jpeg/pdf travel as base64).
REPR_METHODS = {"html": "_repr_html_", "markdown": "_repr_markdown_", "svg": "_repr_svg_", "png": "_repr_png_"}
REPR_METHODS |= {"jpeg": "_repr_jpeg_", "pdf": "_repr_pdf_", "latex": "_repr_latex_", "json": "_repr_json_"}
REPR_METHODS |= {"javascript": "_repr_javascript_"}
MIME_KEYS = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg"}
MIME_KEYS |= {"image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex"}
MIME_KEYS |= {"application/json": "json", "application/javascript": "javascript"}


def _encoded(key, data):
    if isinstance(data, (bytes, bytearray)):
        return base64.b64encode(data).decode() if key in ("png", "jpeg", "pdf") else bytes(data).decode()
    return data


def _is_figure(obj):
    return type(obj).__module__.startswith("matplotlib.") and hasattr(obj, "savefig") and hasattr(obj, "axes")


def formats(obj):
    """What IPython's display formatter makes of ``obj``: ``text`` (repr) and every rich format it defines; a
    matplotlib figure as PNG, as the inline backend shows it."""
    out = {"text": repr(obj)}
    if _is_figure(obj):
        buf = io.BytesIO()
        obj.savefig(buf, format="png", bbox_inches="tight")
        out["png"] = base64.b64encode(buf.getvalue()).decode()
        return out
    bundle = getattr(obj, "_repr_mimebundle_", None)
    if callable(bundle) and not isinstance(obj, type):
        data = bundle()
        data = data[0] if isinstance(data, tuple) else data
        for mime, value in (data or {}).items():
            if mime in MIME_KEYS and value is not None:
                out[MIME_KEYS[mime]] = _encoded(MIME_KEYS[mime], value)
    for key, name in REPR_METHODS.items():
        method = getattr(obj, name, None)
        if key not in out and callable(method) and not isinstance(obj, type):
            value = method()
            value = value[0] if isinstance(value, tuple) else value  # (data, metadata), as IPython allows
            if value is not None:
                out[key] = _encoded(key, value)
    return out


def _publish(events, obj, main):
    try:
        data = formats(obj)
        json.dumps(data)  # a _repr_*_ that returned something JSON cannot carry
    except Exception as exc:  # a broken _repr_*_ costs its format, not the cell (IPython warns the same way)
        events.text("stderr", f"[display formatter failed: {type(exc).__name__}: {exc}]\n")
        data = {"text": repr(obj)}
    events.emit(type="result", is_main_result=main, **data)


def _flush_figures(events, skip=None):
    """Figures the cell left open through pyplot are shown and closed at its end, as the inline backend does."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for num in plt.get_fignums():
        fig = plt.figure(num)
        if fig is not skip:
            _publish(events, fig, main=False)
    plt.close("all")


def run_cell(code, namespace, events):
    """Run ``code`` like a notebook cell: a trailing expression's value is the result, ``display(obj)`` and open
    pyplot figures are display data."""
    value = None
    try:
        tree = ast.parse(code, "<cell>", "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<cell>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace)
            if value is not None:
                _publish(events, value, main=True)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt included: the interpreter keeps serving
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:  # the cell's frames only
            tb = tb.tb_next
        tb = "".join(traceback.format_exception(type(exc), exc, tb))
        events.emit(type="error", name=type(exc).__name__, value=str(exc), traceback=tb)
    try:
        _flush_figures(events, skip=value)
    except Exception as exc:
        events.text("stderr", f"[figures not shown: {type(exc).__name__}: {exc}]\n")


def install_display(events):
    """IPython's ``display()`` builtin: each object as display data (not the cell's main result)."""

    def display(*objs, **_ignored):
        for obj in objs:
            _publish(events, obj, main=False)

    builtins.display = display


def run_command(request, events):
    """Run ``argv`` to its end, streaming its output; the server kills it (not this process) on a timeout."""
    import selectors  # here: a sandbox that never runs a command does not pay for them at start or in memory
    import subprocess

    env = {**os.environ, **{str(k): str(v) for k, v in (request.get("env") or {}).items()}}
    try:
        proc = subprocess.Popen(
            request["argv"],
            cwd=request.get("cwd") or HOME,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        events.emit(type="cmd_error", message=f"{type(exc).__name__}: {exc}")
        return
    events.emit(type="cmd_start", pid=proc.pid)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    # Until both pipes close, or the command has exited and its pipes are drained (a child it left in the
    # background may hold them open: that child dies with the call).
    while sel.get_map():
        ready = sel.select(timeout=0.05)
        for key, _ in ready:
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                sel.unregister(key.fileobj)
            elif events.sent < events.max_output:
                events.sent += len(chunk)
                events.emit(type="cmd_data", stream=key.data, data=base64.b64encode(chunk).decode())
            else:  # counted, so the server's truncation note also covers output cut exactly at the cap
                events.dropped += len(chunk)
        if not ready and proc.poll() is not None:
            break
    sel.close()
    proc.stdout.close()
    proc.stderr.close()
    events.emit(type="cmd_end", exit_code=proc.wait(), dropped=events.dropped)


def main():
    cfg = json.loads(sys.argv[1])
    requests_fd, events_fd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    events = _Events(events_fd, cfg["max_output_bytes"])
    try:
        confine(cfg)
    except Exception as exc:  # told to the server in one line: it refuses the sandbox instead of running it open
        events.emit(type="fatal", message=f"{type(exc).__name__}: {exc}")
        sys.exit(1)
    sys.stdout, sys.stderr = _Stream(events, "stdout"), _Stream(events, "stderr")
    sys.stdin = open(os.devnull)
    install_display(events)
    namespace = {"__name__": "__main__"}
    count = 0
    events.emit(type="ready")
    for line in os.fdopen(requests_fd, "r", encoding="utf-8"):
        request = json.loads(line)
        events.sent = events.dropped = 0
        if "argv" in request:
            run_command(request, events)
            events.emit(type="done")
            continue
        count += 1
        # The sandbox's envVars and this call's env_vars hold for this cell only, as E2B's run_code(envs=...) does.
        env = {str(k): str(v) for k, v in (request.get("env") or {}).items()}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        run_cell(request["code"], namespace, events)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if events.dropped:
            events.emit(
                type="stderr",
                text=f"\n[output truncated: {events.dropped} more characters dropped]\n",
                timestamp=int(time.time() * 1e9),
            )
        events.emit(type="number_of_executions", execution_count=count)
        events.emit(type="done")


if __name__ == "__main__":
    main()
