"""Continuous-batching decoder with a KV cache: the core of the embedded rollout server.

Requests join the running batch at the next step (at most ``max_running`` run,
the rest wait FIFO) and leave as soon as they finish. With a KV budget (``kv_budget``,
``rollout.kv_budget``) a request is admitted only while the KV positions reserved by the
running requests stay within it; see "KV-cache-aware admission" below. Each loop iteration is one
step: queued commands are applied, then either the sequences that need it are
prefilled (new ones, or all of them after a weight update) or every running
sequence decodes one token.

Output conventions (what the trainer relies on):

* ``output_ids`` include the token that stopped the sequence (a stop token or
  the model's EOS), so the trainer trains on it; ``finish_reason.matched`` names it.
* ``output_token_logprobs[i][0]`` is the behaviour logprob of token ``i``: its logprob
  under the distribution it was drawn from, ``log_softmax(logits / temperature)``
  renormalised over the tokens top-k/top-p keep (temperature 0: ``log_softmax(logits)``);
  see ``sampling.py``.
* ``output_token_versions[i]`` is the engine's weight version when token ``i``
  was sampled; ``weight_version`` is the version when the request finished.

Weight updates, by ``weight_update`` mode (``WeightUpdateMode`` in ``rollout/backend.py``):

* ``reprefill`` (AReaL's interruptible generation): the update is applied between two
  steps, the KV cache is dropped and every unfinished sequence (prompt + tokens so far)
  is prefilled again with the new weights; its next token is sampled from that prefill.
* ``keep_kv`` (PipelineRL's in-flight update): the update is applied between two steps
  and decoding goes on over the KV cache computed by the old weights; the next token is
  sampled by the new weights and carries the new version.
* ``drain``: admission stops, the running sequences finish under the old weights, then
  the update is applied and admission resumes (the synchronous baseline); while paused
  in that mode the update waits for ``resume()``.

KV-cache-aware admission: a request's KV cache grows to at most prompt + generated so far +
max remaining new tokens = prompt + ``max_new_tokens`` positions (:func:`kv_reserve`), the same
over its whole life, so it reserves that from admission until it finishes or is aborted. The
head of the queue is admitted while the reservations of the running requests plus its own stay
within the budget; a request that does not fit waits, and the requests behind it wait too (FIFO:
a large request at the head is never overtaken, so it starts as soon as enough running ones
finish). A request larger than the whole budget is refused at submit with a
:class:`RequestError` naming both sizes (the server answers 400; other requests go on). While
a budget is set, the cache starts empty and each prefill sizes it for the longest reservation
running, instead of a head start of rows and positions that doubles as tokens arrive: for
requests of one length it then allocates at most the budget (:attr:`RolloutEngine.kv_cache_bytes`);
mixed lengths allocate more, since every row of the cache is as long as the longest.
Weight updates do not change reservations: ``reprefill`` rebuilds the same positions,
``keep_kv`` keeps them, ``drain`` admits nothing until the update is live.

Threading: :meth:`start` runs the loop in a background thread; :meth:`submit`
and the commands are thread-safe and return ``concurrent.futures.Future``s.
With ``start=False`` the caller drives the loop with :meth:`step`.

This module holds the engine's API, its loop and the application of commands and weight
updates; the batch itself (admission, prefill, decode, retiring and aborting sequences) is
``engine_batch.BatchSteps``, and the small helpers are in ``engine_parts``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future

import torch

from areal_core.models.decoder_weights import load_served_model
from areal_core.models.digest import weights_sha256
from areal_core.rollout.backend import DEFAULT_WEIGHT_UPDATE, WeightUpdateMode, weight_update_mode
from areal_core.rollout.backends.embedded.engine_batch import BatchSteps
from areal_core.rollout.backends.embedded.engine_parts import EngineStopped, kv_reserve, requests_snapshot
from areal_core.rollout.backends.embedded.engine_parts import deliver as _deliver
from areal_core.rollout.backends.embedded.kv_forward import (
    KVForward,
    apply_weights,
    eos_token_ids,
    read_weights,
)
from areal_core.rollout.backends.embedded.sampling import BatchSampler, RequestError, Sequence, new_sequence
from areal_core.rollout.backends.embedded.weight_receiver import check_weights
from areal_core.rollout.config import KVBudget
from areal_core.rollout.protocol import ModelInfo, SamplingParams
from areal_core.storage.localize import localize
from areal_core.trainer.lora import AdapterMerger

__all__ = ["EngineStopped", "RequestError", "RolloutEngine", "kv_reserve"]

log = logging.getLogger(__name__)


def kv_bytes_per_token(kv: KVForward) -> int:
    """Bytes of K and V one position takes over all layers: 2 x layers x kv_heads x head_dim x dtype."""
    return 2 * len(kv.layers) * kv.n_kv * kv.head_dim * kv.dtype.itemsize


class RolloutEngine(BatchSteps):
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        model_path: str = "",
        max_running: int = 256,
        weight_update: WeightUpdateMode = DEFAULT_WEIGHT_UPDATE,
        weight_version: int = 0,
        kv_slots: int | None = None,
        kv_capacity: int | None = None,
        prefill_tokens: int = 8192,
        seed: int = 0,
        kv_budget: KVBudget | None = None,
        batch_invariant: bool = False,
        weight_hashes: bool = False,
        start: bool = True,
    ):
        if max_running < 1:
            raise ValueError("max_running must be >= 1")
        weight_update_mode(weight_update)
        model.eval()
        # the cache's first rows and positions; with a budget none ahead of what admission reserved
        if kv_slots is None:
            kv_slots = 16 if kv_budget is None else 1
        if kv_capacity is None:
            kv_capacity = 256 if kv_budget is None else 1
        self.kv = KVForward(
            model,
            max_slots=max_running,
            init_slots=kv_slots,
            init_capacity=kv_capacity,
            batch_invariant=batch_invariant,
        )
        self.kv_bytes_per_token = kv_bytes_per_token(self.kv)
        self.kv_budget = kv_budget
        self.kv_budget_tokens: int | None = None if kv_budget is None else kv_budget.in_tokens(self.kv_bytes_per_token)
        if self.kv_budget_tokens == 0:
            raise ValueError(
                f"kv_budget of {kv_budget.bytes} bytes holds no KV position of this model "
                f"({self.kv_bytes_per_token} bytes per token)"
            )
        self.model_path = model_path
        self.max_running = max_running
        self.weight_update = weight_update
        self._drains = weight_update == "drain"  # updates wait for the running sequences
        self.prefill_tokens = prefill_tokens
        self.eos_ids = eos_token_ids(model)
        self.vocab_size = self.kv.vocab_size
        self.n_logits = model.lm_head.out_features
        self.version = weight_version
        self.generated_tokens = 0
        self._steps = 0
        self._generator = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._commands: deque[tuple[str, object, Future]] = deque()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._updates: deque[tuple[tuple[dict, int, str], Future]] = deque()
        self._sampler: BatchSampler | None = None  # the decode batch's; None when the batch changed
        self.device = self.kv.device  # the model's: cache, logits and sampling live there
        self._lens = self._tokens = torch.empty(0, dtype=torch.long)  # valid while _sampler is set
        self._max_len = 0
        self._needs_prefill = False
        self._any_finished = False
        self._paused = False
        self._closed = False
        self.last_update_stall_s: float | None = None  # the engine loop's time in the last update
        self.busy_s = 0.0  # the engine loop's time prefilling, decoding and applying weights (cost ledger)
        self.reprefilled_tokens = 0  # positions prefilled again because an update replaced the K/V under them
        self._adapters = AdapterMerger(weight_version)  # LoRA updates: merged into the base captured at the first
        # version -> weights_sha256 of what went live (EngineConfig.weight_hashes); None: not hashed
        self.weight_hashes: dict[int, str] | None = {weight_version: weights_sha256(model)} if weight_hashes else None
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    @classmethod
    def from_pretrained(
        cls, model_path: str, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", **kwargs
    ) -> RolloutEngine:
        """Load a Hugging Face model folder (local path or fsspec URL) onto ``device``: its weights only,
        where :mod:`~areal_core.models.decoder_weights` describes the model (the engine runs its own forward)."""
        return cls(load_served_model(model_path, dtype).to(device), model_path=model_path, **kwargs)

    # -- state ---------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def max_positions(self) -> int:
        return self.kv.max_positions

    @property
    def kv_reserved_tokens(self) -> int:
        """KV positions reserved by the running requests (:func:`kv_reserve`); read between steps."""
        return sum(kv_reserve(s) for s in self._running)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache has allocated now (K/V of every layer and the mask)."""
        return sum(t.nbytes for t in self.kv.kv) + self.kv.mask.nbytes

    def info(self) -> ModelInfo:
        return ModelInfo(
            model_path=self.model_path,
            weight_version=self.version,
            max_running=self.max_running,
            running=self.running,
            waiting=self.waiting,
            paused=self._paused,
            weight_update=self.weight_update,
            generated_tokens=self.generated_tokens,
            eos_token_id=self.eos_ids[0] if self.eos_ids else None,
            last_update_stall_s=self.last_update_stall_s,
            busy_s=self.busy_s,
            reprefilled_tokens=self.reprefilled_tokens,
            kv_budget_tokens=self.kv_budget_tokens,
            weight_hashes=dict(self.weight_hashes or {}),
        )

    def alive(self) -> bool:
        return not self._closed and (self._thread is None or self._thread.is_alive())

    # -- thread-safe API -------------------------------------------------------
    def submit(
        self,
        input_ids: list[int],
        sampling: SamplingParams | dict | None = None,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> Future:
        """Queue a request; the future resolves to a :class:`GenerateResponse`. A request with
        ``sampling_seed`` draws each token from its seed and position (keyed sampling, ``sampling.py``),
        the others from the engine's generator (``seed``).

        Raises :class:`RequestError` for a request that cannot run here.
        """
        return self.submit_many([(input_ids, sampling, rid)], return_logprob)[0]

    def submit_many(self, jobs: list[tuple], return_logprob: bool = True) -> list[Future]:
        """Queue several requests ``(input_ids, sampling, rid)`` together (they join the
        same step); all are checked first, so a bad one queues none. One future each."""
        futs = [Future() for _ in jobs]
        seqs = [
            new_sequence(
                ids,
                sampling,
                rid,
                return_logprob,
                fut,
                vocab_size=self.vocab_size,
                max_positions=self.max_positions,
                eos_ids=self.eos_ids,
            )
            for (ids, sampling, rid), fut in zip(jobs, futs)
        ]
        for s in seqs:
            self._check_fits_budget(s)
        with self._lock:
            if self._closed:
                raise EngineStopped("the rollout engine is shut down")
            self._waiting.extend(seqs)
        self._wake.set()
        return futs

    def _check_fits_budget(self, s: Sequence) -> None:
        """Refuse a request that could never be admitted: it reserves more than the whole budget."""
        budget = self.kv_budget_tokens
        if budget is None or kv_reserve(s) <= budget:
            return
        need, bpt = kv_reserve(s), self.kv_bytes_per_token
        raise RequestError(
            f"request {s.rid}: prompt ({len(s.prompt)} tokens) + max_new_tokens ({s.max_new}) = {need} tokens "
            f"({need * bpt} bytes) of KV cache exceed the whole kv_budget of {self.kv_budget.describe(bpt)}"
        )

    def pause(self) -> Future:
        """Stop decoding after the current step; requests stay queued."""
        return self._command("pause")

    def resume(self) -> Future:
        return self._command("resume")

    def snapshot_requests(self) -> Future:
        """Resolves to a :class:`RequestsSnapshot`: every unfinished request's output so far."""
        return self._command("snapshot")

    def abort_all(self) -> Future:
        """Finish every queued and running request now with finish_reason ``abort``."""
        return self._command("abort")

    def abort_request(self, rid: str) -> Future:
        """Finish the queued or running request ``rid`` now with finish_reason ``abort`` (its
        output so far is delivered). Resolves to whether such a request was found."""
        return self._command("abort_rid", rid)

    def update_weights_from_tensors(self, named: dict[str, torch.Tensor], version: int, label: str) -> Future:
        """Load weights given in memory (checked here, in the caller's thread) as ``version``;
        ``label`` says where they came from. The future resolves once they are live.

        LoRA adapters (``<module>.lora_A`` and the pre-scaled ``.lora_B``) are merged here, into the
        base values of those weights captured at the first adapter update (``lora.AdapterMerger``):
        the engine then decodes over plain merged weights, as fast as without adapters."""
        staged = self._adapters.stage(self.kv.model, check_weights(self.kv.model, named, label), label, version)
        return self._command("update", (staged, int(version), label))

    def update_weights(self, model_path: str, version: int) -> Future:
        """Load new weights (HF folder or fsspec URL of safetensors) as ``version``.

        The folder is read and checked here, in the caller's thread (raising
        ``FileNotFoundError`` / ``ValueError`` for a bad one); the returned
        future resolves once the engine decodes with the new weights.
        """
        named = read_weights(self.kv.model, localize(model_path))
        staged = self._adapters.stage(self.kv.model, named, model_path, version)
        return self._command("update", (staged, int(version), model_path))

    def _command(self, kind: str, arg: object = None) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise EngineStopped("the rollout engine is shut down")
            self._commands.append((kind, arg, fut))
        self._wake.set()
        return fut

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="rollout-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop; queued and running requests end with ``abort``. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("engine thread still busy after %.0fs; aborting its requests anyway", timeout_s)
        self._abort_requests()
        self._fail_commands(EngineStopped("the rollout engine is shut down"))

    def _fail_commands(self, error: BaseException) -> None:
        while self._commands:
            _deliver(self._commands.popleft()[2], error=error)
        while self._updates:
            _deliver(self._updates.popleft()[1], error=error)

    def _loop(self) -> None:
        try:
            while not self._closed:
                if not self.step():
                    self._wake.wait()
                    self._wake.clear()
        except BaseException as e:  # a bug outside a model step: fail everything instead of hanging callers
            log.exception("engine loop crashed")
            with self._lock:
                self._closed = True
            error = EngineStopped(f"the rollout engine crashed: {e!r}")
            self._fail_running(error)
            while self._waiting:
                _deliver(self._waiting.popleft().future, error=error)
            self._fail_commands(error)
            raise

    # -- one step ------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> bool:
        """Apply queued commands, then prefill or decode once. Returns whether work remains."""
        self._apply_commands()
        self._apply_ready_updates()
        if self._paused:
            return False
        self._admit()
        if self._running:
            t0 = time.perf_counter()
            try:
                if self._needs_prefill:
                    self._prefill_step()
                else:
                    self._decode_step()
            except Exception as e:  # not swallowed: every running request gets the error
                log.exception("engine step failed; failing %d running requests", len(self._running))
                self._fail_running(e)
            self.busy_s += time.perf_counter() - t0
            self._retire()
            self._apply_ready_updates()
        blocked = self._drains and bool(self._updates)
        return bool(self._running) or (bool(self._waiting) and not blocked)

    def _apply_commands(self) -> None:
        while self._commands:
            kind, arg, fut = self._commands.popleft()
            result = None
            if kind == "pause":
                self._paused = True
            elif kind == "resume":
                self._paused = False
            elif kind == "abort":
                self._abort_requests()
            elif kind == "abort_rid":
                result = self._abort_one(arg)
            elif kind == "snapshot":  # between two steps: every sequence's lists agree
                with self._lock:
                    result = requests_snapshot(self.version, self._running + list(self._waiting))
            elif kind == "update":
                self._updates.append((arg, fut))
                continue  # resolved when applied
            _deliver(fut, result)

    def _apply_ready_updates(self) -> None:
        while self._updates and not (self._drains and self._running):
            (staged, version, path), fut = self._updates.popleft()
            t0 = time.perf_counter()
            apply_weights(self.kv.model, staged)
            self.kv.weights_changed()
            self.version, self.model_path = version, path
            if self.weight_hashes is not None:
                self.weight_hashes[version] = weights_sha256(self.kv.model)
            if self._running and self.weight_update == "reprefill":  # the cache holds the old weights' K/V
                self.reprefilled_tokens += sum(s.cache_len for s in self._running)
                self.kv.release()
                for s in self._running:
                    s.needs_prefill = True
                self._needs_prefill = True
            if self.device.type == "cuda":  # the copies are queued, not done: time what the loop will wait for
                torch.cuda.synchronize(self.device)
            self.last_update_stall_s = time.perf_counter() - t0
            self.busy_s += self.last_update_stall_s
            log.debug(
                "weights of version %d live (%d sequences in flight, %s)",
                version,
                len(self._running),
                self.weight_update,
            )
            _deliver(fut, None)
