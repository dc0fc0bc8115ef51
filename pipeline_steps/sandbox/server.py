"""A local E2B-compatible sandbox server: the routes the pinned ``e2b`` 2.50.0 / ``e2b-code-interpreter`` 2.10.0
SDKs call, served on one port (give the SDK ``E2B_API_URL`` and ``E2B_SANDBOX_URL`` both pointing at it).

Control plane (header ``X-API-KEY``): ``POST /sandboxes`` (the route OpenKruise's sandbox-manager serves too),
``GET /v2/sandboxes`` (``Sandbox.list``; ``GET /sandboxes`` too), ``GET /sandboxes/{id}``, ``DELETE /sandboxes/{id}``,
``POST /sandboxes/{id}/timeout``, ``POST /sandboxes/{id}/connect`` (``Sandbox.connect``).
Sandbox plane (headers ``E2b-Sandbox-Id``, ``E2b-Sandbox-Port``, ``X-Access-Token``: with ``E2B_SANDBOX_URL`` set
the SDK sends every envd and code-interpreter request to that one URL and names the sandbox in these headers):
``GET /health`` (envd's, ``is_running``), ``POST /execute`` (the code interpreter's NDJSON stream), envd's files
(``envd.py``) and commands (``commands.py``).
With ``--debug-sandbox`` on port 49999, the SDK's debug mode (``E2B_DEBUG=true``: no control plane, requests to
``localhost:49999``) reaches one standing sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hmac
import json
import logging
import time
import urllib.parse

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route

from pipeline_steps.host_guard import LoopbackHostMiddleware
from pipeline_steps.sandbox.commands import process_app
from pipeline_steps.sandbox.envd import file_routes, filesystem_app
from pipeline_steps.sandbox.pool import RUNNING, Pool

log = logging.getLogger(__name__)

ENVD_VERSION = "0.3.0"  # the envd version the SDK is told; it gates features: multipart uploads, no stdin close
MAX_TIMEOUT = 24 * 3600


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat()


class _OutputCap:
    """The output cap, enforced on what the server reads from the interpreter (code in the sandbox can change
    anything in its own process, the interpreter's own cap included): stdout and stderr are cut to the cap; other
    events (results, errors) have a budget of the same size, and one that does not fit is dropped."""

    def __init__(self, max_bytes: int):
        self.text_room = self.other_room = max_bytes
        self.dropped = 0
        self.counted = False  # the execution count gets through once whatever the budget

    def admit(self, event: dict) -> dict | None:
        if not isinstance(event, dict) or event.get("type") == "ready":
            return None
        if event.get("type") in ("stdout", "stderr") and isinstance(event.get("text"), str):
            text = event["text"]
            if len(text) > self.text_room:
                self.dropped += len(text) - self.text_room
                text = text[: self.text_room]
                if not text:
                    return None
            self.text_room -= len(text)
            return {**event, "text": text}
        size = len(json.dumps(event))
        if event.get("type") == "number_of_executions" and not self.counted:
            self.counted = True
        elif size > self.other_room:
            self.dropped += size
            return None
        else:
            self.other_room -= size
        return event

    def notice(self) -> dict:
        text = f"\n[output truncated by the server: {self.dropped} more characters dropped]\n"
        return {"type": "stderr", "text": text, "timestamp": int(time.time() * 1e9)}


def build_app(pool: Pool, api_key: str, templates: set[str], debug_sandbox: bool = False) -> Starlette:
    def authorised(request: Request) -> bool:
        return hmac.compare_digest(request.headers.get("x-api-key", "").encode(), api_key.encode())

    def sandbox_of(headers):
        """The running sandbox a sandbox-plane request names, or an error response (502 = unknown, as E2B's proxy
        answers; 410 = killed or expired here)."""
        sandbox_id = headers.get("e2b-sandbox-id", "")
        sb = pool.running.get(sandbox_id)
        if sb is None:
            if sandbox_id in pool.ended:
                return None, _error(410, f"sandbox {sandbox_id} has ended ({pool.ended[sandbox_id]})")
            return None, _error(502, "sandbox not found or not running")
        token = headers.get("x-access-token", "")
        if not hmac.compare_digest(token.encode(), sb.access_token.encode()):
            return None, _error(401, "invalid access token")
        return sb, None

    def created(sb) -> dict:
        return {
            "templateID": sb.template,
            "sandboxID": sb.sandbox_id,
            "clientID": "local",
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": sb.access_token,
            "domain": None,
        }

    def described(sb) -> dict:
        lim = pool.limits
        return {
            "templateID": sb.template,
            "sandboxID": sb.sandbox_id,
            "clientID": "local",
            "startedAt": _iso(sb.started_at),
            "endAt": _iso(sb.end_at),
            "envdVersion": ENVD_VERSION,
            "cpuCount": lim.cpus,
            "memoryMB": lim.memory_mb,
            "diskSizeMB": lim.disk_mb,
            "state": "running",
            "metadata": sb.metadata,
        }

    async def create(request: Request):
        if not authorised(request):
            return _error(401, "Invalid API key")
        body = await request.json()
        template = str(body.get("templateID") or "")
        if template not in templates:
            return _error(400, f"template {template!r} not found; this server serves {sorted(templates)}")
        timeout = min(int(body.get("timeout") or 300), MAX_TIMEOUT)
        try:
            sb = await pool.acquire(
                template, timeout, dict(body.get("metadata") or {}), dict(body.get("envVars") or {})
            )
        except RuntimeError as exc:
            return _error(503, str(exc))
        return JSONResponse(created(sb), status_code=201)

    async def detail(request: Request):
        if not authorised(request):
            return _error(401, "Invalid API key")
        sb = pool.running.get(request.path_params["sandbox_id"])
        if sb is None:
            return _error(404, "sandbox not found")
        return JSONResponse(described(sb))

    async def listing(request: Request):
        """``Sandbox.list``: running sandboxes (none is ever paused here), filtered by state, template and metadata
        (the SDK sends ``k=v&...``, each key and value quoted once more), newest first unless ``order=asc``; the page
        token is the offset of the next page."""
        if not authorised(request):
            return _error(401, "Invalid API key")
        q = request.query_params
        states = set(filter(None, q.get("state", "").split(",")))
        pairs = urllib.parse.parse_qsl(q.get("metadata", ""))
        wanted = {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}
        found = [
            sb
            for sb in pool.running.values()
            if (not states or "running" in states)
            and q.get("template", sb.template) == sb.template
            and all(sb.metadata.get(k) == v for k, v in wanted.items())
        ]
        found.sort(key=lambda sb: sb.started_at, reverse=q.get("order", "desc") != "asc")
        try:
            start, limit = int(q.get("nextToken") or 0), max(1, min(int(q.get("limit") or 100), 1000))
        except ValueError:
            return _error(400, "nextToken and limit must be integers")
        page = found[start : start + limit]
        more = {"x-next-token": str(start + limit)} if start + limit < len(found) else {}
        return JSONResponse([described(sb) for sb in page], headers=more)

    async def connect(request: Request):
        """``Sandbox.connect``: a running sandbox's access again; its timeout is only ever extended, as E2B does. A
        killed or expired sandbox is gone (404), as on E2B once it is not paused."""
        if not authorised(request):
            return _error(401, "Invalid API key")
        sb = pool.running.get(request.path_params["sandbox_id"])
        if sb is None or sb.state != RUNNING:
            return _error(404, f"sandbox {request.path_params['sandbox_id']} not found")
        body = await request.json() if await request.body() else {}
        timeout = min(int(body.get("timeout") or 300), MAX_TIMEOUT)
        sb.end_at = max(sb.end_at, time.time() + timeout)
        return JSONResponse(created(sb), status_code=200)

    async def delete(request: Request):
        if not authorised(request):
            return _error(401, "Invalid API key")
        if not await pool.kill(request.path_params["sandbox_id"]):
            return _error(404, "sandbox not found")
        return Response(status_code=204)

    async def set_timeout(request: Request):
        if not authorised(request):
            return _error(401, "Invalid API key")
        sb = pool.running.get(request.path_params["sandbox_id"])
        if sb is None:
            return _error(404, "sandbox not found")
        timeout = int((await request.json()).get("timeout") or 0)
        sb.end_at = time.time() + min(timeout, MAX_TIMEOUT)
        return Response(status_code=204)

    async def health(request: Request):
        if "e2b-sandbox-id" not in request.headers:  # the server's own readiness probe; capacity: the pre-flight's
            body = {"ok": True, "running": len(pool.running), "warm": len(pool.warm), "capacity": pool.max_sandboxes}
            return JSONResponse(body)
        _, err = sandbox_of(request.headers)
        if err is not None and err.status_code == 410:  # the SDK's is_running() reads 502 as "not running"
            return _error(502, "sandbox not running")
        return err or Response(status_code=204)

    async def execute(request: Request):
        sb, err = sandbox_of(request.headers)
        if err:
            return err
        body = await request.json()
        code = body.get("code")
        if not isinstance(code, str):
            return _error(400, "body must hold the code to run as a string")
        env = {**sb.env_vars, **(body.get("env_vars") or {})}
        if sb.state != RUNNING:  # ended while this request's body was on its way
            return _error(410, f"sandbox {sb.sandbox_id} has ended ({pool.ended.get(sb.sandbox_id, 'killed')})")
        return StreamingResponse(_execution(sb, code, env), media_type="application/x-ndjson")

    async def _execution(sb, code: str, env: dict):
        """Stream one execution; on timeout, disconnect or a dead interpreter, kill it all and start afresh."""
        limit = pool.limits.exec_timeout
        async with sb.lock:  # one execution at a time, as in a Jupyter kernel
            if sb.state != RUNNING:  # killed or expired while this request waited for the previous one
                yield _event_error("SandboxError", f"sandbox {sb.sandbox_id} has {sb.state}", lost=False)
                return
            finished = False
            cap = _OutputCap(pool.limits.max_output_bytes)
            try:
                sb.cgroup.freeze(False)  # frozen between calls
                if sb.kernel is None or sb.kernel.proc.returncode is not None:
                    sb.kernel = await pool.spawn_kernel(sb)
                async with asyncio.timeout(limit):
                    async for event in sb.kernel.run(code, env):
                        event = cap.admit(event)
                        if event is not None:
                            yield json.dumps(event) + "\n"
                finished = True
            except TimeoutError:
                yield _event_error("TimeoutError", f"execution exceeded {limit:g} s")
            except (EOFError, ValueError, RuntimeError, OSError) as exc:
                # died (CPU limit, crash), wrote a malformed or oversized line, or could not be (re)started
                yield _event_error("SandboxError", f"the interpreter stopped: {exc}")
            finally:
                # shielded: on a client disconnect the cancellation would otherwise cut the kill short
                with anyio.CancelScope(shield=True):
                    if finished:
                        await pool.end_of_call(sb)  # processes the call started do not outlive it
                    else:
                        await pool.kill_processes(sb)
            if cap.dropped:
                yield json.dumps(cap.notice()) + "\n"

    def _event_error(name: str, value: str, lost: bool = True) -> str:
        if lost:
            value += "; all its processes were killed and its variables are lost (files in its directory remain)"
        return json.dumps({"type": "error", "name": name, "value": value, "traceback": ""}) + "\n"

    read_file, write_file = file_routes(sandbox_of, pool.limits.disk_mb)
    routes = [
        Route("/sandboxes", create, methods=["POST"]),
        Route("/sandboxes", listing, methods=["GET"]),
        Route("/v2/sandboxes", listing, methods=["GET"]),
        Route("/sandboxes/{sandbox_id}", detail, methods=["GET"]),
        Route("/sandboxes/{sandbox_id}", delete, methods=["DELETE"]),
        Route("/sandboxes/{sandbox_id}/timeout", set_timeout, methods=["POST"]),
        Route("/sandboxes/{sandbox_id}/connect", connect, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/execute", execute, methods=["POST"]),
        Route("/files", read_file, methods=["GET"]),
        Route("/files", write_file, methods=["POST"]),
        Mount("/filesystem.Filesystem", app=filesystem_app(sandbox_of)),
        Mount("/process.Process", app=process_app(pool, sandbox_of)),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await pool.start()
        if debug_sandbox:
            await pool.acquire_debug()
        try:
            yield
        finally:
            await pool.close()

    # on a loopback port, a Host that is not a loopback name is refused (DNS rebinding): pipeline_steps/host_guard
    return Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(LoopbackHostMiddleware)])
