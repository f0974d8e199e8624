"""The running batch of :class:`~areal_core.rollout.backends.embedded.engine.RolloutEngine`,
step by step: admission from the queue under the KV budget, a prefill or a decode of one
token, recording what was sampled, and delivering and compacting away the sequences that
finished or were aborted (or failing them all when a step raised)."""

from __future__ import annotations

import torch

from areal_core.rollout.backends.embedded.engine_parts import EngineStopped, kv_reserve, prefill_groups
from areal_core.rollout.backends.embedded.engine_parts import deliver as _deliver
from areal_core.rollout.backends.embedded.sampling import BatchSampler, Sequence


class BatchSteps:
    """The engine's batch bookkeeping, mixed into ``RolloutEngine``, whose ``__init__`` sets every
    attribute used here; the main ones: ``kv`` (the ``KVForward`` cache), the queue ``_waiting``
    (guarded by ``_lock``, since ``submit`` appends to it from other threads), the batch
    ``_running`` (row ``i`` of the cache holds ``_running[i]``), ``_sampler`` with the decode
    tensors ``_lens``, ``_tokens`` and ``_max_len``, and the flags ``_needs_prefill`` and
    ``_any_finished``. The engine loop calls these methods; ``shutdown`` aborts through them."""

    def _admit(self) -> None:
        if not self._waiting or (self._drains and self._updates):
            return  # nothing to admit, or draining the running sequences before an update
        room = self.max_running - len(self._running)
        free = self._kv_free()
        while room > 0 and self._waiting:
            s = self._waiting[0]
            if s.future.cancelled():
                self._waiting.popleft()
                continue
            if kv_reserve(s) > free:
                break  # FIFO: the head waits for running requests to finish; nothing overtakes it
            self._waiting.popleft()
            self._running.append(s)
            room -= 1
            free -= kv_reserve(s)
            self._needs_prefill = True
            self._sampler = None

    def _kv_free(self) -> float:
        """KV positions the budget leaves for new requests (inf without a budget)."""
        if self.kv_budget_tokens is None:
            return float("inf")
        return self.kv_budget_tokens - self.kv_reserved_tokens

    def _prefill_step(self) -> None:
        run = self._running
        toks = {i: s.prompt + s.out for i, s in enumerate(run) if s.needs_prefill}
        # identical token lists (a fresh group's answers to one prompt) are run once; the copies take
        # that row's cache and logits, and sample their own next tokens from them
        first: dict[tuple[int, ...], int] = {}
        copies: dict[int, list[int]] = {}
        for i, t in toks.items():
            j = first.setdefault(tuple(t), i)
            if j != i:
                copies.setdefault(j, []).append(i)
        lengths = {i: len(toks[i]) for i in first.values()}
        self.kv.ensure(len(run), self._cache_length(lengths))
        for g in prefill_groups(lengths, self.prefill_tokens):
            logits = self.kv.prefill(g, [toks[i] for i in g])
            rows, src = [], []
            for k, i in enumerate(g):
                dup = copies.get(i, [])
                self.kv.move_rows(dup, [i] * len(dup), lengths[i])
                rows += [i, *dup]
                src += [k] * (1 + len(dup))
            seqs = [run[i] for i in rows]
            for i, s in zip(rows, seqs):
                s.cache_len = len(toks[i])
                s.needs_prefill = False
            sampler = BatchSampler([s.sampling for s in seqs], self.n_logits, self._generator, self.device)
            tokens, logprobs = sampler.sample(
                logits[src] if len(src) > len(g) else logits, next_positions(sampler, seqs)
            )
            self._record(seqs, tokens.tolist(), logprobs.tolist())
        self._needs_prefill = False
        self._sampler = None  # the decode batch's tensors are rebuilt from the sequences

    def _cache_length(self, lengths: dict[int, int]) -> int:
        """Positions the cache needs for this prefill: room for the next token; with a budget, the
        longest reservation running, so that decoding never grows (doubles) it."""
        if self.kv_budget_tokens is None:
            return max(lengths.values()) + 1
        return max(kv_reserve(s) for s in self._running)

    def _decode_step(self) -> None:
        """One token for every running sequence. While the batch stays the same (``_sampler`` set),
        its last tokens and cache lengths stay in tensors from one step to the next."""
        run = self._running
        if self._sampler is None:
            self._sampler = BatchSampler([s.sampling for s in run], self.n_logits, self._generator, self.device)
            self._lens = torch.tensor([s.cache_len for s in run], device=self.device)
            self._tokens = torch.tensor([s.out[-1] for s in run], device=self.device)
            self._max_len = max(s.cache_len for s in run)
        logits = self.kv.decode(self._tokens, self._lens, self._max_len + 1)
        self._lens += 1
        self._max_len += 1
        self._tokens, logprobs = self._sampler.sample(logits, next_positions(self._sampler, run))
        self._record(run, self._tokens.tolist(), logprobs.tolist(), cached=1)

    def _record(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float], cached: int = 0) -> None:
        """Append each sequence's new token; ``cached``: positions each one just added to the KV cache."""
        v = self.version
        finished = False
        for s, t, lp in zip(seqs, tokens, logprobs):
            out = s.out
            out.append(t)
            s.logprobs.append(lp)
            s.versions.append(v)
            s.cache_len += cached
            if t in s.stop:
                s.finish = ("stop", t)
                finished = True
            elif len(out) >= s.max_new:
                s.finish = ("length", None)
                finished = True
        self._any_finished |= finished
        self.generated_tokens += len(tokens)
        self._steps += 1
        if self._steps % 32 == 0:  # callers that gave up (cancelled futures) leave the batch
            for s in seqs:
                if s.finish is None and s.future.cancelled():
                    s.finish = ("abort", None)
                    self._any_finished = True

    def _retire(self) -> None:
        """Deliver finished sequences and compact the survivors into rows 0..n-1."""
        if not self._any_finished:
            return
        self._any_finished = False
        run = self._running
        n = len(run)
        done = [i for i, s in enumerate(run) if s.finish is not None]
        if not done:
            return
        finished = [run[i] for i in done]
        keep = n - len(done)
        holes = [i for i in done if i < keep]
        movers = [j for j in range(keep, n) if run[j].finish is None]
        if holes:
            self.kv.move_rows(holes, movers, max(run[j].cache_len for j in movers))
        for h, m in zip(holes, movers):
            run[h] = run[m]
        del run[keep:]
        self._sampler = None
        if not run and not self._waiting:
            self.kv.release()
        for s in finished:
            self._finish(s)

    def _finish(self, s: Sequence) -> None:
        _deliver(s.future, s.response(self.version))

    def _abort_requests(self) -> None:
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
        running, self._running = self._running, []
        self._sampler = None
        self._needs_prefill = False
        self.kv.release()
        for s in running + waiting:
            s.finish = ("abort", None)
            self._finish(s)

    def _abort_one(self, rid: str) -> bool:
        with self._lock:
            queued = next((s for s in self._waiting if s.rid == rid), None)
            if queued is not None:
                self._waiting.remove(queued)
        if queued is not None:
            queued.finish = ("abort", None)
            self._finish(queued)
            return True
        running = next((s for s in self._running if s.rid == rid and s.finish is None), None)
        if running is None:
            return False
        running.finish = ("abort", None)  # delivered and compacted away by the next _retire
        self._any_finished = True
        self._retire()
        return True

    def _fail_running(self, error: BaseException) -> None:
        running, self._running = self._running, []
        self._sampler = None
        self._needs_prefill = False
        self._any_finished = False
        self.kv.release()
        # a stopped engine is the server's state (restartable: 503), any other error the request's
        err = error if isinstance(error, EngineStopped) else RuntimeError(f"generation failed in the engine: {error!r}")
        for s in running:
            _deliver(s.future, error=err)


def next_positions(sampler: BatchSampler, seqs: list[Sequence]) -> list[int] | None:
    """Each sequence's absolute position of its next token, where a row is seeded (keyed sampling)."""
    return [len(s.prompt) + len(s.out) for s in seqs] if sampler.seeded else None
