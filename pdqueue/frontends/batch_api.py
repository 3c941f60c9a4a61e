"""OpenAI's Files and Batch API on the gateway: ``POST /v1/files`` (``purpose=batch``, a JSONL
upload, checked line by line), ``GET /v1/files/{id}`` and ``/content``, ``POST /v1/batches``,
``GET /v1/batches`` and ``/v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``.

Objects are OpenAI's (``file``, ``batch`` with ``request_counts``); a batch's output file
holds its lines answered with status 200, its error file the others, each line as
``pdqueue batch`` writes it. Files and batches belong to the tenant that made them (another
tenant gets a 404). The state is in Redis (``batch_store``), the runs in ``batch_runner``.
"""

from __future__ import annotations

import json
import time
import uuid
from email.parser import BytesParser
from email.policy import HTTP

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdqueue.frontends import http_errors as errs
from pdqueue.frontends.batch_input import URLS
from pdqueue.frontends.batch_runner import ENDED
from pdqueue.frontends.batch_store import RETENTION_S, BatchKeys, check_upload, output_file_batch
from pdqueue.frontends.openai_compat import OpenAIError, bad_request

__all__ = ["BatchAPI", "MAX_UPLOAD_BYTES"]

MAX_UPLOAD_BYTES = 200 << 20   # OpenAI's limit for a batch input file
COMPLETION_WINDOWS = ("24h",)
_TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
          "cancelling_at", "cancelled_at")


def _not_found(what: str, given: str, param: str) -> OpenAIError:
    return OpenAIError(404, f"No such {what} object: {given!r}", "invalid_request_error", param,
                       f"{what.lower()}_not_found")


def _text(raw: dict) -> dict:
    return {k.decode(): v.decode() for k, v in raw.items()}


class BatchAPI:
    """The routes; ``gw``: the gateway (its tenant check, counts, Redis client and runner)."""

    def __init__(self, gw):
        self.gw = gw
        self.bkeys = BatchKeys(gw.keys)

    def routes(self) -> list[Route]:
        files, batches = self._endpoint("files"), self._endpoint("batches")
        return [Route("/v1/files", files(self.upload), methods=["POST"]),
                Route("/v1/files/{file_id}", files(self.file), methods=["GET"]),
                Route("/v1/files/{file_id}/content", files(self.content), methods=["GET"]),
                Route("/v1/batches", batches(self.create), methods=["POST"]),
                Route("/v1/batches", batches(self.list_batches), methods=["GET"]),
                Route("/v1/batches/{batch_id}", batches(self.batch), methods=["GET"]),
                Route("/v1/batches/{batch_id}/cancel", batches(self.cancel), methods=["POST"])]

    def _endpoint(self, endpoint: str):
        """A route's handler: the tenant's key, OpenAI errors, the count by ``endpoint``."""
        return lambda handler: self._handler(endpoint, handler)

    def _handler(self, endpoint: str, handler):
        return errs.tenant_route(self.gw, endpoint, "Batch API", handler)

    @property
    def r(self):
        return self.gw.client.redis

    # ---- files ------------------------------------------------------------------------------
    async def upload(self, request: Request, tenant: str) -> Response:
        purpose, filename, data = await _form(request)
        if purpose != "batch":
            raise bad_request(f"purpose must be 'batch' (this server keeps files for the Batch API only), got "
                              f"{purpose!r:.40}", "purpose")
        info, urls, problems = check_upload(data)
        if not info.lines:
            raise bad_request("the file has no request lines", "file", "invalid_file_format")
        if problems:
            raise bad_request(f"{filename}: not a Batch API input file (one {{\"custom_id\", \"method\": \"POST\", "
                              f"\"url\", \"body\"}} per line): {'; '.join(problems)}", "file", "invalid_file_format")
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        meta = {"id": file_id, "bytes": len(data), "created_at": int(time.time()), "filename": filename,
                "purpose": "batch", "tenant": tenant, "lines": info.lines, "sha256": info.sha256,
                "urls": ",".join(urls)}
        pipe = self.r.pipeline(transaction=True)
        pipe.set(self.bkeys.file(file_id), data, ex=RETENTION_S)
        pipe.hset(self.bkeys.file_meta(file_id), mapping=meta)
        pipe.expire(self.bkeys.file_meta(file_id), RETENTION_S)
        await pipe.execute()
        return JSONResponse(_file_object(meta))

    async def _file_meta(self, file_id: str, tenant: str, param: str = "file_id") -> dict:
        derived = output_file_batch(file_id)
        if derived is not None:
            record = await self._batch_record(derived[0], tenant, quiet=True)
            key = "output_file_id" if derived[1] == "output" else "error_file_id"
            if record is not None and record.get(key) == file_id:
                items = await self.r.lrange(self._lines_key(derived), 0, -1)
                return {"id": file_id, "bytes": sum(len(i) for i in items), "created_at":
                        int(record.get("completed_at") or record.get("cancelled_at") or record["created_at"]),
                        "filename": f"{derived[0]}_{derived[1]}.jsonl", "purpose": "batch_output",
                        "tenant": tenant}
            raise _not_found("File", file_id, param)
        meta = _text(await self.r.hgetall(self.bkeys.file_meta(file_id)))
        if not meta or meta.get("tenant") != tenant:
            raise _not_found("File", file_id, param)
        return meta

    def _lines_key(self, derived: tuple[str, str]) -> str:
        return self.bkeys.out(derived[0]) if derived[1] == "output" else self.bkeys.err(derived[0])

    async def file(self, request: Request, tenant: str) -> Response:
        return JSONResponse(_file_object(await self._file_meta(request.path_params["file_id"], tenant)))

    async def content(self, request: Request, tenant: str) -> Response:
        file_id = request.path_params["file_id"]
        await self._file_meta(file_id, tenant)
        derived = output_file_batch(file_id)
        if derived is not None:
            data = b"".join(await self.r.lrange(self._lines_key(derived), 0, -1))
        else:
            data = await self.r.get(self.bkeys.file(file_id))
            if data is None:
                raise _not_found("File", file_id, "file_id")
        return Response(data, media_type="application/jsonl")

    # ---- batches ----------------------------------------------------------------------------
    async def create(self, request: Request, tenant: str) -> Response:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad_request(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
        window, metadata = body.get("completion_window", "24h"), body.get("metadata")
        if not isinstance(file_id, str) or not file_id:
            raise bad_request("input_file_id is required (the id POST /v1/files returned)", "input_file_id")
        if endpoint not in URLS:
            raise bad_request(f"endpoint must be one of {', '.join(URLS)}, got {endpoint!r:.60}", "endpoint")
        if window not in COMPLETION_WINDOWS:
            raise bad_request(f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}, got {window!r:.20}",
                              "completion_window")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and
                                         all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise bad_request("metadata must be an object of at most 16 string values", "metadata")
        meta = await self._file_meta(file_id, tenant, "input_file_id")
        if meta.get("purpose") != "batch":
            raise bad_request(f"{file_id} is not a batch input file (purpose {meta.get('purpose')!r})",
                              "input_file_id")
        others = sorted(set(meta.get("urls", "").split(",")) - {endpoint, ""})
        if others:
            raise bad_request(f"{file_id} has lines for {', '.join(others)}; this batch's endpoint is {endpoint} "
                              f"(a batch runs one endpoint)", "endpoint")
        batch_id = f"batch_{uuid.uuid4().hex[:24]}"
        now = int(time.time())
        record = {"id": batch_id, "endpoint": endpoint, "input_file_id": file_id, "completion_window": window,
                  "status": "validating", "created_at": now, "expires_at": now + 24 * 3600, "tenant": tenant,
                  "total": meta.get("lines", "0"), "metadata": json.dumps(metadata)}
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.bkeys.batch(batch_id), mapping=record)
        pipe.expire(self.bkeys.batch(batch_id), RETENTION_S)
        pipe.expire(self.bkeys.file(file_id), RETENTION_S)   # the input outlives its batch
        pipe.expire(self.bkeys.file_meta(file_id), RETENTION_S)
        pipe.zadd(self.bkeys.batches, {batch_id: now})
        pipe.sadd(self.bkeys.active, batch_id)
        await pipe.execute()
        self.gw.batches.kick()
        return JSONResponse(await self._batch_object(batch_id, tenant))

    async def _batch_record(self, batch_id: str, tenant: str, quiet: bool = False) -> dict | None:
        record = _text(await self.r.hgetall(self.bkeys.batch(batch_id)))
        if not record or record.get("tenant") != tenant:
            if quiet:
                return None
            raise _not_found("Batch", batch_id, "batch_id")
        return record

    async def _batch_object(self, batch_id: str, tenant: str) -> dict:
        record = await self._batch_record(batch_id, tenant)
        pipe = self.r.pipeline(transaction=False)
        pipe.llen(self.bkeys.out(batch_id))
        pipe.llen(self.bkeys.err(batch_id))
        completed, failed = await pipe.execute()
        obj = {"id": batch_id, "object": "batch", "endpoint": record["endpoint"],
               "errors": json.loads(record["errors"]) if record.get("errors") else None,
               "input_file_id": record["input_file_id"], "completion_window": record["completion_window"],
               "status": record["status"], "output_file_id": record.get("output_file_id"),
               "error_file_id": record.get("error_file_id"),
               "request_counts": {"total": int(record.get("total", 0)), "completed": completed, "failed": failed},
               "metadata": json.loads(record.get("metadata") or "null")}
        obj.update({t: int(record[t]) if record.get(t) else None for t in _TIMES})
        return obj

    async def batch(self, request: Request, tenant: str) -> Response:
        return JSONResponse(await self._batch_object(request.path_params["batch_id"], tenant))

    async def list_batches(self, request: Request, tenant: str) -> Response:
        try:
            limit = int(request.query_params.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise bad_request("limit must be an integer in 1..100", "limit")
        after = request.query_params.get("after")
        ids = [i.decode() for i in await self.r.zrevrange(self.bkeys.batches, 0, -1)]
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        data = []
        for batch_id in ids:
            if len(data) > limit:
                break
            if await self._batch_record(batch_id, tenant, quiet=True) is not None:
                data.append(await self._batch_object(batch_id, tenant))
        page = data[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(data) > limit})

    async def cancel(self, request: Request, tenant: str) -> Response:
        batch_id = request.path_params["batch_id"]
        record = await self._batch_record(batch_id, tenant)
        if record["status"] in ENDED:
            raise OpenAIError(409, f"batch {batch_id} is {record['status']}: only a batch that has not ended can be "
                                   f"cancelled", "invalid_request_error", "batch_id", "batch_not_cancellable")
        if record["status"] != "cancelling":
            await self.r.hset(self.bkeys.batch(batch_id), mapping={"status": "cancelling",
                                                                  "cancelling_at": int(time.time())})
            self.gw.batches.kick()
        return JSONResponse(await self._batch_object(batch_id, tenant))


def _file_object(meta: dict) -> dict:
    return {"id": meta["id"], "object": "file", "bytes": int(meta["bytes"]), "created_at": int(meta["created_at"]),
            "expires_at": int(meta["created_at"]) + RETENTION_S, "filename": meta["filename"],
            "purpose": meta["purpose"], "status": "processed", "status_details": None}


async def _form(request: Request) -> tuple[str, str, bytes]:
    """(purpose, filename, the file's bytes) of a multipart/form-data upload; OpenAIError
    400 (or 413 over ``MAX_UPLOAD_BYTES``) otherwise."""
    ctype = request.headers.get("content-type", "")
    if not ctype.lower().startswith("multipart/form-data"):
        raise bad_request(f"POST /v1/files takes multipart/form-data (fields file and purpose), got "
                          f"{ctype[:60] or 'no content-type'!r}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_UPLOAD_BYTES + 65536:
            raise OpenAIError(413, f"the file is larger than {MAX_UPLOAD_BYTES >> 20} MiB", "invalid_request_error",
                              "file", "file_too_large")
    message = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + ctype.encode("latin-1") + b"\r\n\r\n" + body)
    purpose, filename, data = None, None, None
    for part in message.iter_parts() if message.is_multipart() else ():
        name = part.get_param("name", header="content-disposition")
        if name == "purpose":
            purpose = (part.get_payload(decode=True) or b"").decode("utf-8", "replace").strip()
        elif name == "file":
            filename, data = part.get_filename() or "upload.jsonl", part.get_payload(decode=True) or b""
    if data is None:
        raise bad_request("the upload has no file field", "file")
    if purpose is None:
        raise bad_request("purpose is required ('batch')", "purpose")
    if len(data) > MAX_UPLOAD_BYTES:
        raise OpenAIError(413, f"the file is larger than {MAX_UPLOAD_BYTES >> 20} MiB", "invalid_request_error",
                          "file", "file_too_large")
    return purpose, filename, data
