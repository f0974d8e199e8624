"""Who may drive a rollout server: a bearer token on every request but ``/health``.

* A run makes a secret (``new_key``: ``secrets.token_urlsafe``) for the servers it launches and
  gives it to them in their environment (``API_KEY_ENV``), never on the command line (any user of
  the machine can read a process's argv). The embedded server takes it out of its environment at
  start; vLLM reads its own ``VLLM_API_KEY``; SGLang gets ``api-key`` in a config file of mode
  0600 (``--config``).
* The clients send it as ``Authorization: Bearer <key>``. A client made without a key uses the key
  of its URL in this process's ``KEYRING``: the servers this process started (``remember``), so
  code that starts a server and talks to it needs no key of its own.
* Servers the run did not start (``rollout.backend: external``, SGLang ``urls``) need their key
  from ``api_key_file`` (a file only its owner can read) or ``api_key_env`` (an environment
  variable); without one they are used only with ``allow_unauthenticated: true``, and a warning.

The server's check (``BearerAuth``) compares in constant time and answers a missing or wrong
token 401 with one line of JSON; ``/health`` stays open for probes.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat
import tempfile

from pydantic import Field, model_validator

from areal_core.configbase import Section

log = logging.getLogger(__name__)

API_KEY_ENV = "AREAL_ROLLOUT_API_KEY"  # the embedded server's key, in its environment
OPEN_PATHS = frozenset({"/health"})  # answered without a token


def new_key() -> str:
    return secrets.token_urlsafe(32)


KEYRING: dict[str, str] = {}  # base URL -> key, for the servers this process started


def remember(url: str, key: str) -> None:
    KEYRING[url.rstrip("/")] = key


def key_for(url: str) -> str | None:
    return KEYRING.get(url.rstrip("/"))


def bearer(key: str | None) -> dict[str, str]:
    """The request header that carries ``key`` (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def token_matches(header: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header carries ``key`` as a bearer token (constant time)."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())


UNAUTHORIZED = json.dumps(
    {
        "message": "missing or wrong API key: send Authorization: Bearer <the run's key>",
        "error": {
            "message": "missing or wrong API key: send Authorization: Bearer <the run's key>",
            "type": "unauthorized",
        },
    }
).encode()


class BearerAuth:
    """ASGI middleware: every HTTP request but ``OPEN_PATHS`` must carry ``key`` as a bearer token,
    else 401 with one line of JSON (the server's error shape: ``message`` and ``error``)."""

    def __init__(self, app, key: str):
        if not key:
            raise ValueError("BearerAuth needs a non-empty key")
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        if token_matches(header, self.key):
            return await self.app(scope, receive, send)
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                    (b"content-length", str(len(UNAUTHORIZED)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": UNAUTHORIZED})


def write_private_file(path: str, text: str) -> str:
    """Write ``text`` (a key, or a file holding one) to ``path`` readable by its owner alone (mode
    0600, made so before anything is in it, and renamed into place); returns the path."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".key-")  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text.rstrip("\n") + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def read_key_file(path: str) -> str:
    """The key in ``path``; refused (``ValueError``) if others than its owner may read it."""
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"{path}: an API key file must be readable by its owner alone (chmod 600), "
            f"but its mode is {stat.S_IMODE(mode):o}"
        )
    with open(path) as f:
        key = f.read().strip()
    if not key:
        raise ValueError(f"{path}: the API key file is empty")
    return key


class ServerAuthConfig(Section):
    """How the run authenticates to rollout servers it did not start (at most one of the two key
    sources; neither: the servers must be open, and ``allow_unauthenticated`` must say so)."""

    # a file holding the servers' key, readable by its owner alone (mode 0600), e.g. the one the
    # rollout-servers pool writes (areal_core/ops/serve.py)
    api_key_file: str | None = None
    # the name of an environment variable holding the servers' key (the key itself never goes in a config)
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    # use servers without a key: any process that can reach them can pause generation or load weights
    # into them; logged as a warning at start
    allow_unauthenticated: bool = False

    @model_validator(mode="after")
    def _one_source(self):
        if self.api_key_file and self.api_key_env:
            raise ValueError("give rollout.backend.api_key_file or api_key_env, not both")
        return self

    def needs_key(self) -> bool:
        """Whether servers must be given by ``urls`` with a key (the check runs where urls are set)."""
        return not (self.api_key_file or self.api_key_env or self.allow_unauthenticated)

    def resolve(self, what: str) -> str | None:
        """The key from the configured source (None: unauthenticated, with a warning); a missing
        file or variable is an error naming it. ``what`` names the servers in messages."""
        if self.api_key_file:
            return read_key_file(self.api_key_file)
        if self.api_key_env:
            key = os.environ.get(self.api_key_env, "").strip()
            if not key:
                raise ValueError(
                    f"rollout.backend.api_key_env: the environment variable {self.api_key_env} "
                    f"is not set (it should hold the key of {what})"
                )
            return key
        if self.allow_unauthenticated:
            log.warning(
                "%s are used without an API key (rollout.backend.allow_unauthenticated): any process "
                "that can reach them can pause generation or load weights into them",
                what,
            )
            return None
        raise ValueError(
            f"{what} need an API key: set rollout.backend.api_key_file or api_key_env, or allow_unauthenticated: true"
        )


UNAUTHENTICATED_MESSAGE = (
    "{what} have no API key: set rollout.backend.api_key_file (a file of mode 0600 holding "
    "their key) or api_key_env (an environment variable holding it), or "
    "allow_unauthenticated: true to use them open"
)
