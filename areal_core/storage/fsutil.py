"""fsspec helpers: a filesystem for a URL, atomic writes, retries.

S3 settings come from the environment only (never from a config file):

* ``AWS_ENDPOINT_URL_S3`` or else ``AWS_ENDPOINT_URL``: the endpoint (unset: AWS);
  it is passed to s3fs as ``endpoint_url`` explicitly, so that s3fs's instance
  cache never hands back a filesystem bound to another endpoint.
* ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (/ ``AWS_SESSION_TOKEN``);
  unset: botocore's usual credential chain.
* ``AWS_DEFAULT_REGION``; ``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE`` (botocore's own
  per-request retries; read by botocore itself).
* ``AREAL_S3_CONNECT_TIMEOUT`` / ``AREAL_S3_READ_TIMEOUT`` (seconds, defaults 5
  and 15) and ``AREAL_S3_RETRIES`` (s3fs's own retries, default 5).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import fsspec
from fsspec.exceptions import FSTimeoutError

from areal_core.storage.localize import is_local, local_path

log = logging.getLogger(__name__)
T = TypeVar("T")

_NOT_TRANSIENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


def _transient_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [OSError, ConnectionError, FSTimeoutError, TimeoutError]
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError

        types += [BotoConnectionError, HTTPClientError]
    except ImportError:
        pass
    try:
        from aiohttp import ClientError as AiohttpClientError

        types.append(AiohttpClientError)
    except ImportError:
        pass
    return tuple(types)


_TRANSIENT = _transient_types()
_TRANSIENT_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestTimeTooSkewed",
}


def is_transient(err: BaseException) -> bool:
    """True for errors worth retrying: I/O, connection, timeout, 5xx/throttling."""
    if isinstance(err, _NOT_TRANSIENT):
        return False
    if isinstance(err, _TRANSIENT):
        return True
    response = getattr(err, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code", "")
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0
        return code in _TRANSIENT_CODES or status >= 500
    return False


def retry(
    fn: Callable[[], T], retries: int = 5, backoff_s: float = 0.5, what: str = "operation", max_backoff_s: float = 30.0
) -> T:
    """Call ``fn``; on a transient error retry up to ``retries`` times with
    exponential backoff (``backoff_s * 2**attempt``). The last error propagates."""
    attempt = 0
    while True:
        try:
            return fn()
        except BaseException as err:
            if not is_transient(err) or attempt >= retries:
                raise
            delay = min(backoff_s * (2**attempt), max_backoff_s)
            log.warning(
                "%s failed (%s: %s); retry %d/%d in %.2fs", what, type(err).__name__, err, attempt + 1, retries, delay
            )
            time.sleep(delay)
            attempt += 1


# -- filesystems ---------------------------------------------------------------
def s3_options(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """s3fs constructor options from the environment (see module docstring)."""
    env = os.environ if env is None else env
    opts: dict[str, Any] = {}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        opts["endpoint_url"] = endpoint
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        opts["key"] = env["AWS_ACCESS_KEY_ID"]
        opts["secret"] = env["AWS_SECRET_ACCESS_KEY"]
        if env.get("AWS_SESSION_TOKEN"):
            opts["token"] = env["AWS_SESSION_TOKEN"]
    config: dict[str, Any] = {
        "connect_timeout": float(env.get("AREAL_S3_CONNECT_TIMEOUT", "5")),
        "read_timeout": float(env.get("AREAL_S3_READ_TIMEOUT", "15")),
    }
    opts["config_kwargs"] = config  # region: botocore reads AWS_DEFAULT_REGION itself
    return opts


_S3_SESSIONS: dict[tuple, Any] = {}
_SESSION_ENV = (
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE",
    "AWS_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
)


def _drop_expect_continue(request: Any, **_: Any) -> None:
    # botocore sends "Expect: 100-continue" with every PUT body. aiohttp waits for
    # the 100 response with no timeout, so a stalled endpoint hangs a write forever.
    # The header is not signed, so removing it after signing is safe.
    if "Expect" in request.headers:
        del request.headers["Expect"]


def _aio_session() -> Any:
    """One aiobotocore session per relevant environment (botocore reads the region
    and retry settings from the environment itself)."""
    key = tuple(os.environ.get(k) for k in _SESSION_ENV)
    session = _S3_SESSIONS.get(key)
    if session is None:
        from aiobotocore.session import AioSession

        session = AioSession()
        session.register("before-send.s3", _drop_expect_continue)
        _S3_SESSIONS[key] = session
    return session


def filesystem(url: str, env: Mapping[str, str] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path) for a local path, file:// or s3:// URL (others: fsspec defaults).

    s3fs's instance cache is kept (the options name the endpoint, credentials and
    timeouts), but callers must invalidate its listing cache before reading.
    """
    if is_local(url):
        return fsspec.filesystem("file", auto_mkdir=True), os.path.abspath(local_path(url))
    protocol = url.split("://", 1)[0]
    if protocol in ("s3", "s3a"):
        env_ = os.environ if env is None else env
        fs = fsspec.filesystem("s3", session=_aio_session(), **s3_options(env_))
        fs.retries = int(env_.get("AREAL_S3_RETRIES", "5"))
        return fs, fs._strip_protocol(url)
    return fsspec.core.url_to_fs(url)


def is_local_fs(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


def join(url: str, *parts: str) -> str:
    out = url.rstrip("/")
    for p in parts:
        out += "/" + p.strip("/")
    return out


def invalidate(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Forget cached listings for ``path`` (and its parents), so new objects are seen."""
    fs.invalidate_cache(path)


# -- atomic writes / reads ----------------------------------------------------
def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask (read by setting it and putting it back, once, at import)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# the mode a plain open() gives a new file, which an atomic write keeps (mkstemp's is 0600: a run
# folder on a shared cluster would be unreadable to the rest of the team)
_FILE_MODE = 0o666 & ~_umask()


def _local_replace_from(dest: str, write: Callable[[Any], None]) -> None:
    folder = os.path.dirname(dest) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(dest) + ".", suffix=".tmp")
    try:
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        _fsync_dir(folder)  # the rename itself is durable before anything written after it
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


FileData = bytes | Callable[[str], None]
"""A file's contents for a checkpoint: its bytes, or a callable that writes the file at the path it
is given (so that a large file, the optimizer state, is serialized on the writer's thread, straight
into the file)."""


def write_local_file(path: str, data: FileData) -> None:
    """Write ``data`` (``FileData``) as the new local file ``path``, creating its folders."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if callable(data):
        data(path)
        return
    with open(path, "wb") as f:
        f.write(data)


def pipe_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` at ``path`` on ``fs`` so it appears whole or not at all.

    Local: temp file in the same folder, fsync, os.replace. S3: one PUT (atomic).
    """
    if is_local_fs(fs):
        _local_replace_from(path, lambda f: f.write(data))
    else:
        fs.pipe_file(path, data)
        invalidate(fs, path)


def write_parquet_atomic(df, path: str | os.PathLike) -> None:
    """A pandas frame to ``path`` (local or fsspec URL) as parquet, atomically."""
    write_bytes_atomic(str(path), df.to_parquet(index=False))


def write_bytes_atomic(url: str, data: bytes, retries: int = 0, backoff_s: float = 0.5) -> None:
    """Write ``data`` at ``url`` atomically (see pipe_atomic), retrying transient errors."""
    fs, path = filesystem(url)
    retry(lambda: pipe_atomic(fs, path, data), retries=retries, backoff_s=backoff_s, what=f"write {url}")


def write_text_atomic(url: str, text: str, retries: int = 0, backoff_s: float = 0.5) -> None:
    write_bytes_atomic(url, text.encode("utf-8"), retries=retries, backoff_s=backoff_s)


def write_json_atomic(url: str, obj: Any, retries: int = 0, backoff_s: float = 0.5) -> None:
    write_text_atomic(url, json.dumps(obj, indent=2, sort_keys=True) + "\n", retries=retries, backoff_s=backoff_s)


def read_bytes(url: str) -> bytes:
    """The object at ``url``, bypassing s3fs's listing cache."""
    fs, path = filesystem(url)
    invalidate(fs, path)
    return fs.cat_file(path)


def read_json(url: str) -> Any:
    """Parse the JSON object at ``url``; ValueError naming the URL if it is not JSON."""
    data = read_bytes(url)
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{url}: not valid JSON ({err})") from err


def put_file_atomic(fs: fsspec.AbstractFileSystem, src: str, dest: str) -> None:
    """Copy local file ``src`` to ``dest`` on ``fs`` so it appears whole or not at all."""
    if is_local_fs(fs):

        def _copy(f):
            with open(src, "rb") as s:
                while chunk := s.read(8 << 20):
                    f.write(chunk)

        _local_replace_from(dest, _copy)
    else:  # S3: a PUT, or a multipart upload completed at the end: both atomic
        fs.put_file(src, dest)
        invalidate(fs, dest)


def move_file_atomic(fs: fsspec.AbstractFileSystem, src: str, dest: str) -> None:
    """Rename local file ``src`` to ``dest`` (same filesystem), durably: the file's data
    is fsynced before the rename, the folder after it."""
    if not is_local_fs(fs):
        raise ValueError(f"move_file_atomic: {dest} is not on a local filesystem")
    with open(src, "rb+") as f:
        os.fsync(f.fileno())
    folder = os.path.dirname(dest) or "."
    os.makedirs(folder, exist_ok=True)
    os.replace(src, dest)
    _fsync_dir(folder)


def ensure_bucket(url: str, env: Mapping[str, str] | None = None) -> str:
    """Create the bucket of an s3:// URL if it does not exist. Returns the bucket name."""
    if not url.startswith(("s3://", "s3a://")):
        raise ValueError(f"not an s3:// URL: {url}")
    fs, path = filesystem(url, env=env)
    bucket = path.split("/", 1)[0]
    invalidate(fs, bucket)
    if not fs.exists(bucket):
        try:
            fs.mkdir(bucket)
        except FileExistsError:  # created meanwhile
            pass
        invalidate(fs, bucket)
    return bucket
