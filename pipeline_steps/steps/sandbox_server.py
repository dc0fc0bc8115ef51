"""``sandbox-server``: the local E2B-compatible code sandbox server (see ``pipeline_steps.sandbox.server``).

The API key is read from ``$PIPELINE_SANDBOX_API_KEY`` (never from the command line: any local user can read a
process's arguments, sandboxes included). Runs until SIGTERM/SIGINT, then kills every sandbox.
"""

from __future__ import annotations

import os

from pipeline_steps import settings
from pipeline_steps.constants import LOCAL_SANDBOX_MAX
from pipeline_steps.errors import UserError
from pipeline_steps.sandbox import KEY_ENV


def add_arguments(p):
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=49999)
    p.add_argument("--state-dir", required=True, help="where sandbox directories live (hidden from sandboxes)")
    p.add_argument("--hide", action="append", default=[], help="a directory sandboxes must not see (repeatable)")
    p.add_argument("--template", action="append", default=None, help="template names served (code-interpreter-v1)")
    p.add_argument("--warm", type=int, default=2, help="sandboxes kept started ahead of requests")
    p.add_argument("--max-sandboxes", type=int, default=LOCAL_SANDBOX_MAX)
    p.add_argument(
        "--uid-base",
        type=int,
        default=1_500_000,
        help="sandboxes run as unused uids from here up (claimed machine-wide)",
    )
    p.add_argument("--exec-timeout", type=float, default=30.0, help="wall-clock seconds per run_code")
    p.add_argument("--cpu-seconds", type=int, default=300, help="CPU seconds per interpreter lifetime")
    p.add_argument(
        "--memory-mb", type=int, default=1024, help="memory of a sandbox's processes together (and per process)"
    )
    p.add_argument("--cpus", type=int, default=1, help="CPUs a sandbox's processes get together")
    p.add_argument(
        "--disk-mb", type=int, default=256, help="size of a sandbox's directory (a tmpfs: counted as its memory)"
    )
    p.add_argument("--max-processes", type=int, default=64)
    p.add_argument("--max-open-files", type=int, default=128)
    p.add_argument("--max-file-mb", type=int, default=64)
    p.add_argument(
        "--debug-sandbox",
        action="store_true",
        help="serve the E2B SDK's debug mode (E2B_DEBUG=true) one standing sandbox; use with --port 49999",
    )
    p.add_argument("--max-output-bytes", type=int, default=1024 * 1024, help="output kept per run_code")


def run(args) -> dict:
    key = settings.get(KEY_ENV) or ""
    if not key:
        raise UserError(f"set ${KEY_ENV} to the API key clients must send")
    if os.geteuid() != 0:
        raise UserError("sandbox-server must run as root: it gives each sandbox its own uid, namespaces and cgroup")
    import shutil

    if shutil.which("bwrap") is None:
        raise UserError("sandbox-server needs bubblewrap: apt-get install bubblewrap")
    if args.cpus < 1 or args.memory_mb < 16 or args.max_processes < 4 or args.disk_mb < 1:
        raise UserError("--cpus and --disk-mb must be at least 1, --memory-mb at least 16, --max-processes at least 4")
    if args.warm < 0 or args.max_sandboxes < 1 or args.warm > args.max_sandboxes:
        raise UserError("--warm must be between 0 and --max-sandboxes (at least 1)")
    import uvicorn

    from pipeline_steps.sandbox.cgroups import CgroupError, Cgroups
    from pipeline_steps.sandbox.pool import Limits, Pool
    from pipeline_steps.sandbox.server import build_app

    try:
        Cgroups()  # fails here, in one line, rather than at the first sandbox
    except CgroupError as exc:
        raise UserError(str(exc)) from None

    limits = Limits(
        cpu_seconds=args.cpu_seconds,
        memory_mb=args.memory_mb,
        cpus=args.cpus,
        disk_mb=args.disk_mb,
        max_processes=args.max_processes,
        max_open_files=args.max_open_files,
        max_file_mb=args.max_file_mb,
        max_output_bytes=args.max_output_bytes,
        exec_timeout=args.exec_timeout,
    )
    pool = Pool(args.state_dir, args.hide, limits, args.warm, args.max_sandboxes, args.uid_base)
    app = build_app(pool, key, set(args.template or ["code-interpreter-v1"]), debug_sandbox=args.debug_sandbox)
    # Idle connections are kept longer than the SDK keeps them pooled (E2B_KEEPALIVE_EXPIRY, 300 s): with uvicorn's
    # 5 s, a request sent on a pooled connection as the server closed it failed ("connection closed before message
    # completed"; seen on the kill after `make bench`'s 5 s of run_code).
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=310,
    )
    return {"host": args.host, "port": args.port}
