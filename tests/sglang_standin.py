"""A stand-in for SGLang 0.5.x's HTTP contract. It is NOT SGLang and runs no model.

It speaks the fields of SGLang's native API as read from SGLang's source (sgl-project/sglang:
python/sglang/srt/managers/io_struct.py, entrypoints/http_server.py, managers/tokenizer_manager.py,
utils/weight_versions.py, managers/schedule_batch.py, sampling/sampling_params.py), so that
``areal_core.rollout.backends.sglang`` can be tested without CUDA. Unknown request fields are
refused with 400 (SGLang answers validation errors with 400), to catch a client that sends a
name SGLang does not have.

The "model" is trivial and deterministic: the next token is ``(last token + 1) % VOCAB``, its
logprob ``token_logprob(token, version)``, one token every ``step_s`` seconds. Weight versions
are string labels as in SGLang; ``/update_weights_from_disk`` and
``/update_weights_from_distributed`` set a new one, and every response carries the spans of
versions over its output tokens (``weight_versions``, end exclusive). Pause modes: ``abort``
ends every in-flight request at once with finish ``abort`` and its partial output;
``in_place`` and ``retract`` hold requests until ``/continue_generation`` (the stand-in has no
KV cache, so the two differ only in name); new requests wait while paused. A weight update
while not paused waits for the in-flight requests to finish (modelled on SGLang's model-update
lock; not checked against a live server). Run as ``python -m sglang_standin --model-path ...
--port ...`` (the flags of ``sglang.launch_server`` the launcher sends) or in-process with
:class:`SGLangContractStandIn`. With an API key (``--config`` YAML ``api-key``, or ``api_key=``),
every path but ``/health*`` and ``/metrics*`` needs ``Authorization: Bearer <key>``, else 401
``{"error": "Unauthorized"}``, as SGLang's ``add_api_key_middleware`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web

VOCAB = 1000

# /generate fields of SGLang's GenerateReqInput the stand-in accepts (a subset of io_struct.py's)
GENERATE_FIELDS = {
    "rid",
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "stream",
}
# SGLang SamplingParams' API fields (sampling/sampling_params.py)
SAMPLING_FIELDS = {
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "custom_params",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
}
UPDATE_DISK_FIELDS = {
    "rid",
    "model_path",
    "load_format",
    "abort_all_requests",
    "weight_version",
    "is_async",
    "torch_empty_cache",
    "keep_pause",
    "recapture_cuda_graph",
    "token_step",
    "flush_cache",
    "manifest",
}
INIT_GROUP_FIELDS = {"rid", "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
UPDATE_DIST_FIELDS = {
    "rid",
    "names",
    "dtypes",
    "shapes",
    "group_name",
    "flush_cache",
    "abort_all_requests",
    "weight_version",
    "load_format",
    "torch_empty_cache",
}

# A /generate response shaped like a real SGLang 0.5.x one, built from its source, not recorded
# from a server: the body is {"text", "output_ids", "meta_info"} (tokenizer_manager.py,
# _handle_batch_output); meta_info's id / finish_reason / prompt_tokens / weight_version /
# num_retractions (same file), completion_tokens / cached_tokens, output_token_logprobs as
# (logprob, token_id, text) with text None unless return_text_in_logprobs
# (detokenize_logprob_tokens), finish_reason from FINISH_LENGTH.to_json (schedule_batch.py),
# weight_versions from add_weight_versions_to_meta_info (utils/weight_versions.py). Here the
# weights went from version "3" to "4" after the 2nd of 5 output tokens.
SGLANG_GENERATE_RESPONSE_FIXTURE: dict[str, Any] = {
    "text": " the answer is",
    "output_ids": [279, 4226, 374, 220, 19],
    "meta_info": {
        "id": "6f1c0f6bde0a4d3c9a1d2e8f7b6a5c4d",
        "finish_reason": {"type": "length", "length": 5},
        "prompt_tokens": 7,
        "weight_version": "4",
        "num_retractions": 0,
        "completion_tokens": 5,
        "cached_tokens": 0,
        "e2e_latency": 0.0731,
        "output_token_logprobs": [
            [-0.312, 279, None],
            [-1.07, 4226, None],
            [-0.0042, 374, None],
            [-2.5, 220, None],
            [-0.61, 19, None],
        ],
        "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}],
    },
}
# The same request cut short by a pause in abort mode (FINISH_ABORT.to_json)
SGLANG_ABORTED_RESPONSE_FIXTURE: dict[str, Any] = {
    "text": " the",
    "output_ids": [279],
    "meta_info": {
        "id": "6f1c0f6bde0a4d3c9a1d2e8f7b6a5c4d",
        "finish_reason": {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
        "prompt_tokens": 7,
        "weight_version": "3",
        "num_retractions": 0,
        "completion_tokens": 1,
        "cached_tokens": 0,
        "output_token_logprobs": [[-0.312, 279, None]],
        "weight_versions": [{"version": "3", "start": 0, "end": 1}],
    },
}


def token_logprob(token: int, version: str) -> float:
    return -0.1 * (1 + (token + int(version)) % 7)


def version_spans(events: list[tuple[str, int]], current: str, n: int) -> list[dict]:
    """Spans of versions over ``n`` output tokens; ``events``: (version before an update, tokens
    generated by then), in order."""
    spans: list[dict] = []
    for version, upto in [*events, (current, n)]:
        end = min(upto, n)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = end
        else:
            spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


class _Request:
    def __init__(self, rid: str, prompt: list[int], sp: dict, return_logprob: bool):
        self.rid, self.prompt, self.sp, self.return_logprob = rid, prompt, sp, return_logprob
        self.out: list[int] = []
        self.lps: list[float] = []
        self.events: list[tuple[str, int]] = []
        self.abort: str | None = None


def _bad(message: str, status: int = 400) -> web.Response:
    return web.json_response(
        {"object": "error", "message": message, "type": "Bad Request", "code": status}, status=status
    )


def _unknown(body: Any, allowed: set[str], what: str) -> str | None:
    if not isinstance(body, dict):
        return f"{what} must be a JSON object"
    extra = sorted(set(body) - allowed)
    return f"{what}: unknown field(s) {extra}" if extra else None


class SGLangContractStandIn:
    """A stand-in for SGLang's HTTP contract (not SGLang). ``start()`` serves it on a thread."""

    def __init__(
        self,
        weight_version: str = "0",
        model_path: str = "standin-model",
        step_s: float = 0.002,
        host: str = "127.0.0.1",
        port: int = 0,
        vocab: int = VOCAB,
        api_key: str | None = None,
    ):
        self.version, self.model_path, self.step_s, self.vocab = weight_version, model_path, step_s, vocab
        self.api_key = api_key
        self.host, self.port = host, port
        self.pause_mode: str | None = None
        self.active: dict[str, _Request] = {}
        self.log: list[tuple[str, Any]] = []  # (path, request body) of every POST
        self.fail_next: tuple[int, dict] | None = None  # the next /generate answers this
        self.mutate_next: Callable[[Any], Any] | None = None  # applied to the next /generate answer
        self.groups: set[str] = set()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._thread: threading.Thread | None = None

    def app(self) -> web.Application:
        @web.middleware
        async def api_key(request, handler):  # SGLang's: OPTIONS, /health* and /metrics* are open
            open_path = request.method == "OPTIONS" or request.path.startswith(("/health", "/metrics"))
            if self.api_key and not open_path and request.headers.get("Authorization") != f"Bearer {self.api_key}":
                return web.json_response({"error": "Unauthorized"}, status=401)
            return await handler(request)

        app = web.Application(middlewares=[api_key])
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_post("/pause_generation", self._pause)
        app.router.add_post("/continue_generation", self._continue)
        app.router.add_post("/update_weights_from_disk", self._update_from_disk)
        app.router.add_post("/init_weights_update_group", self._init_group)
        app.router.add_post("/update_weights_from_distributed", self._update_from_distributed)
        app.router.add_post("/abort_request", self._abort_request)
        return app

    async def _body(self, request: web.Request) -> Any:
        body = await request.json() if request.can_read_body else {}
        self.log.append((request.path, body))
        return body

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _model_info(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.version,
            }
        )

    async def _generate(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if err := _unknown(body, GENERATE_FIELDS, "GenerateReqInput"):
            return _bad(err)
        ids, sps, rids = body.get("input_ids"), body.get("sampling_params") or {}, body.get("rid")
        single = isinstance(ids, list) and bool(ids) and all(isinstance(t, int) for t in ids)
        if not single and not (
            isinstance(ids, list)
            and ids
            and all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in ids)
        ):
            return _bad("input_ids must be a non-empty list of ints or a list of such lists")
        prompts = [ids] if single else ids
        sps = sps if isinstance(sps, list) else [sps] * len(prompts)
        rids = [rids] if single else rids
        if rids is None or len(rids) != len(prompts) or len(sps) != len(prompts):
            return _bad("rid and sampling_params need one entry per prompt")
        for sp in sps:
            if err := _unknown(sp, SAMPLING_FIELDS, "sampling_params"):
                return _bad(err)
        if self.fail_next is not None:
            (status, answer), self.fail_next = self.fail_next, None
            return web.json_response(answer, status=status)
        await self._resumed.wait()  # new requests wait while paused
        reqs = [_Request(r, p, sp, bool(body.get("return_logprob"))) for r, p, sp in zip(rids, prompts, sps)]
        for r in reqs:
            self.active[r.rid] = r
        try:
            outs = await asyncio.gather(*(self._decode(r) for r in reqs))
        finally:
            for r in reqs:
                self.active.pop(r.rid, None)
        answer: Any = outs[0] if single else outs
        if self.mutate_next is not None:
            answer, self.mutate_next = self.mutate_next(answer), None
        return web.json_response(answer)

    async def _decode(self, r: _Request) -> dict:
        stop, max_new = set(r.sp.get("stop_token_ids") or ()), int(r.sp.get("max_new_tokens", 128))
        finish: dict
        while True:
            if r.abort is not None:
                finish = {"type": "abort", "message": r.abort, "status_code": None, "err_type": None}
                break
            if self.pause_mode in ("in_place", "retract"):
                await self._resumed.wait()
                continue
            if len(r.out) >= max_new:
                finish = {"type": "length", "length": max_new}
                break
            await asyncio.sleep(self.step_s)
            if r.abort is not None or self.pause_mode is not None:
                continue  # paused or aborted during the step: this token was not sampled
            tok = ((r.out or r.prompt)[-1] + 1) % self.vocab
            r.out.append(tok)
            r.lps.append(token_logprob(tok, self.version))
            if tok in stop:
                finish = {"type": "stop", "matched": tok}
                break
        spans = version_spans(r.events, self.version, len(r.out))
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": finish,
            "prompt_tokens": len(r.prompt),
            "weight_version": spans[-1]["version"],
            "num_retractions": 0,
            "completion_tokens": len(r.out),
            "cached_tokens": 0,
            "weight_versions": spans,
        }
        if r.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.lps, r.out)]
        return {"text": "", "output_ids": list(r.out), "meta_info": meta}

    async def _pause(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        mode = body.get("mode", "abort")
        if err := _unknown(body, {"rid", "mode"}, "PauseGenerationReqInput"):
            return _bad(err)
        if mode not in ("abort", "retract", "in_place"):
            return _bad(f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place'].")
        self.pause_mode = mode
        self._resumed.clear()
        if mode == "abort":
            for r in self.active.values():
                r.abort = "Aborted"
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        if err := _unknown(await self._body(request), {"rid", "torch_empty_cache"}, "ContinueGenerationReqInput"):
            return _bad(err)
        self.pause_mode = None
        self._resumed.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _set_version(self, version: str | None) -> int:
        """Apply an update (after the in-flight requests when not paused); returns how many requests
        were held."""
        while self.pause_mode is None and self.active:  # noqa: ASYNC110 - the stand-in's step clock polls
            await asyncio.sleep(self.step_s)
        if version is not None:
            for r in self.active.values():
                if r.out:
                    r.events.append((self.version, len(r.out)))
            self.version = version
        return len(self.active)

    async def _update_from_disk(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if err := _unknown(body, UPDATE_DISK_FIELDS, "UpdateWeightFromDiskReqInput"):
            return _bad(err)
        if not body.get("model_path") or str(body["model_path"]).startswith("/missing"):
            return web.json_response(
                {
                    "success": False,
                    "message": f"Failed to load weights from {body.get('model_path')!r}",
                    "num_paused_requests": 0,
                },
                status=400,
            )
        if self.pause_mode == "in_place" and self.active and body.get("flush_cache", True):
            return web.json_response(
                {
                    "success": False,
                    "message": "cannot flush the cache while requests are held in place",
                    "num_paused_requests": 0,
                },
                status=400,
            )
        if body.get("abort_all_requests"):
            for r in self.active.values():
                r.abort = "Aborted"
        held = await self._set_version(body.get("weight_version"))
        msg = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            msg += f" Weight version updated to {body['weight_version']}."
        self.model_path = body["model_path"]
        return web.json_response({"success": True, "message": msg, "num_paused_requests": held})

    async def _init_group(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if err := _unknown(body, INIT_GROUP_FIELDS, "InitWeightsUpdateGroupReqInput"):
            return _bad(err)
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
        if missing:
            return _bad(f"missing field(s) {missing}")
        self.groups.add(body.get("group_name", "weight_update_group"))
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def _update_from_distributed(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if err := _unknown(body, UPDATE_DIST_FIELDS, "UpdateWeightsFromDistributedReqInput"):
            return _bad(err)
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (
            isinstance(names, list)
            and isinstance(dtypes, list)
            and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)
        ):
            return _bad("names, dtypes and shapes must be lists of one length")
        if body.get("group_name", "weight_update_group") not in self.groups:
            return web.json_response({"success": False, "message": "no such weight update group"}, status=400)
        await self._set_version(body.get("weight_version"))
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def _abort_request(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if err := _unknown(body, {"rid", "abort_all", "finished_reason", "abort_message"}, "AbortReq"):
            return _bad(err)
        rid, abort_all = body.get("rid") or "", bool(body.get("abort_all"))
        for r in self.active.values():
            if abort_all or (rid and r.rid.startswith(rid)):  # SGLang matches rids by prefix
                r.abort = "Aborted"
        return web.Response(status=200)

    # -- serving on a thread of this process -------------------------------------------------
    def start(self) -> str:
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def serve() -> None:
            self._runner = web.AppRunner(self.app(), shutdown_timeout=1.0)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.port)
            await site.start()
            self.port = self._runner.addresses[0][1]

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(serve())
            ready.set()
            loop.run_forever()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="sglang-standin", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the SGLang stand-in did not start")
        return self.url

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the server's loop (its state is only touched there)."""

        async def go() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(go(), self._loop).result(5)

    def stop(self) -> None:
        if self._thread is None:
            return

        async def shutdown() -> None:
            for r in self.active.values():
                r.abort = "server stopped"
            self._resumed.set()
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._thread = None


def main(argv: list[str] | None = None) -> None:
    """Serve the stand-in in the foreground, taking ``sglang.launch_server``'s flags that our
    launcher sends (an unknown flag is an error, as in SGLang's argparse)."""
    p = argparse.ArgumentParser("sglang-contract-standin")
    p.add_argument("--model-path", required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--config", default=None)  # SGLang's YAML of server args; the stand-in reads api-key
    a = p.parse_args(argv)
    key = None
    if a.config:
        import yaml

        with open(a.config) as f:
            key = (yaml.safe_load(f) or {}).get("api-key")
    standin = SGLangContractStandIn(weight_version=a.weight_version, model_path=a.model_path, api_key=key)
    web.run_app(standin.app(), host=a.host, port=a.port, print=None, shutdown_timeout=1.0)


if __name__ == "__main__":
    main()
