"""envd's filesystem surface, as the pinned SDK speaks it (``sandbox.files``): ``GET``/``POST /files`` (download, and
multipart upload: envd 0.3.0 has no octet-stream upload) and the Connect-RPC ``filesystem.Filesystem`` service
(``ListDir``, ``Stat``, ``MakeDir``, ``Remove``, ``Move``; watching is not served). Every path is confined to the
sandbox's directory by ``jailfs``; the sandbox is authorised as for ``/execute`` (``E2b-Sandbox-Id`` +
``X-Access-Token``).
"""

from __future__ import annotations

import asyncio
import os
from typing import Callable

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_connect as fs_connect
from e2b.envd.filesystem import filesystem_pb as fs_pb
from protobuf.wkt import Timestamp
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from pipeline_steps.sandbox.jailfs import CHUNK, FsError, Home

HTTP_STATUS = {"invalid": 400, "denied": 403, "not_found": 404, "exists": 409, "no_space": 507}
RPC_CODE = {"invalid": Code.INVALID_ARGUMENT, "denied": Code.PERMISSION_DENIED, "not_found": Code.NOT_FOUND}
RPC_CODE |= {"exists": Code.ALREADY_EXISTS, "no_space": Code.RESOURCE_EXHAUSTED}
FILE_TYPES = {"file": fs_pb.FileType.FILE, "dir": fs_pb.FileType.DIRECTORY, "symlink": fs_pb.FileType.SYMLINK}
RPC_STATUS = {401: Code.UNAUTHENTICATED, 410: Code.UNAVAILABLE, 502: Code.UNAVAILABLE}


class _TooLarge(Exception):
    pass


def _fs_response(exc: FsError) -> JSONResponse:
    status = HTTP_STATUS[exc.kind]
    return JSONResponse({"code": status, "message": str(exc)}, status_code=status)


async def _capped(stream, limit: int):
    seen = 0
    async for chunk in stream:
        seen += len(chunk)
        if seen > limit:
            raise _TooLarge
        yield chunk


def file_routes(sandbox_of: Callable, disk_mb: int):
    """Handlers for ``GET`` and ``POST /files``. ``sandbox_of(headers)`` -> (sandbox, error response)."""

    def home_of(request: Request):
        sb, err = sandbox_of(request.headers)
        # opened at once, with no await after the check: a late request keeps the old tmpfs, never a successor's
        return (None, err) if err else (Home(sb.workdir, sb.uid), None)

    async def read(request: Request):
        home, err = home_of(request)
        if err:
            return err
        try:
            with home:
                fd, _ = home.open_read(request.query_params.get("path", ""))
        except FsError as exc:
            return _fs_response(exc)

        async def chunks():
            try:
                while chunk := await asyncio.to_thread(os.read, fd, CHUNK):
                    yield chunk
            finally:
                os.close(fd)

        return StreamingResponse(chunks(), media_type="application/octet-stream")

    async def write(request: Request):
        home, err = home_of(request)
        if err:
            return err
        with home:
            # The whole upload is bounded by the disk it goes to (parts spill to a temp file past 1 MiB).
            stream = _capped(request.stream(), (disk_mb << 20) + (1 << 20))
            try:
                form = await MultiPartParser(request.headers, stream).parse()
            except _TooLarge:
                return JSONResponse({"code": 507, "message": f"upload exceeds the {disk_mb} MiB disk"}, 507)
            except MultiPartException as exc:
                return JSONResponse({"code": 400, "message": str(exc)}, 400)
            files = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
            given = request.query_params.get("path")
            written = []
            try:
                for upload in files:
                    path = given if given and len(files) == 1 else upload.filename or ""
                    jail_path = await asyncio.to_thread(home.write, path, upload.file)
                    written.append({"name": os.path.basename(jail_path), "type": "file", "path": jail_path})
            except FsError as exc:
                return _fs_response(exc)
            finally:
                await form.close()
        if not written:
            return JSONResponse({"code": 400, "message": "no file in the upload"}, 400)
        return JSONResponse(written)

    return read, write


def _entry(info: dict) -> fs_pb.EntryInfo:
    return fs_pb.EntryInfo(
        name=info["name"],
        type=FILE_TYPES[info["type"]],
        path=info["path"],
        size=info["size"],
        mode=info["mode"],
        permissions=info["permissions"],
        owner=info["owner"],
        group=info["group"],
        modified_time=Timestamp.from_datetime(info["modified"]),
        symlink_target=info.get("symlink_target"),
    )


def rpc_sandbox(sandbox_of: Callable, ctx):
    """The sandbox an RPC names, or the ConnectError the SDK maps as it maps envd's and the proxy's answers."""
    sb, err = sandbox_of(ctx.request_headers)
    if err is not None:
        raise ConnectError(RPC_STATUS.get(err.status_code, Code.UNAVAILABLE), err.body.decode())
    return sb


class FilesystemService(fs_connect.Filesystem):
    def __init__(self, sandbox_of: Callable):
        self.sandbox_of = sandbox_of

    async def _do(self, ctx, op: Callable):
        sb = rpc_sandbox(self.sandbox_of, ctx)
        home = Home(sb.workdir, sb.uid)  # at once after the check (see file_routes)
        try:
            with home:
                return await asyncio.to_thread(op, home)
        except FsError as exc:
            raise ConnectError(RPC_CODE[exc.kind], str(exc)) from None

    async def stat(self, request, ctx):
        return fs_pb.StatResponse(entry=_entry(await self._do(ctx, lambda h: h.stat(request.path))))

    async def list_dir(self, request, ctx):
        infos = await self._do(ctx, lambda h: h.list(request.path, request.depth or 1))
        return fs_pb.ListDirResponse(entries=[_entry(i) for i in infos])

    async def make_dir(self, request, ctx):
        def make(h: Home):
            if not h.make_dirs(h.relative(request.path)):
                raise FsError("exists", f"{request.path}: already exists")
            return h.stat(request.path)

        return fs_pb.MakeDirResponse(entry=_entry(await self._do(ctx, make)))

    async def remove(self, request, ctx):
        await self._do(ctx, lambda h: h.remove(request.path))
        return fs_pb.RemoveResponse()

    async def move(self, request, ctx):
        info = await self._do(ctx, lambda h: h.move(request.source, request.destination))
        return fs_pb.MoveResponse(entry=_entry(info))


def filesystem_app(sandbox_of: Callable):
    return fs_connect.FilesystemASGIApplication(FilesystemService(sandbox_of), read_max_bytes=1 << 20)
