"""Math grading: extract a response's final answer, decide equivalence with math-verify.

The final answer is the content of the last ``\\boxed{...}`` (nested braces
allowed), else GSM8K's ``#### N``, else "the answer is X". Both it and the
reference are handed to math-verify as LaTeX (``$\\boxed{...}$``), so
``0.5`` equals ``\\frac{1}{2}``, ``(x+1)^2`` equals ``x^2+2x+1`` and ``1,000``
equals ``1000``.

Time limits: math-verify's own timeouts use ``signal.alarm``, which works in a
process's main thread only. In the main thread we use them directly. Anywhere
else (Dask workers run tasks in threads) the comparison runs in a helper
process (``python -m areal_core.reward.math``) that uses them in its main
thread, and is killed and replaced if it does not answer within the hard
limit, so a pathological expression can never hang a worker.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time

from areal_core.reward.result import RewardResult

TIMEOUT_S = 5  # math-verify's own limit, per parse and per comparison
HARD_LIMIT_S = 3 * TIMEOUT_S + 5  # helper process: kill it after this long without an answer
HELPER_PROCESSES = 2

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*([^\n]+)", re.IGNORECASE)

logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns once when its own timeout is off


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}``, nested braces matched."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start : i - 1].strip()
    return None


def _clean_tail(ans: str) -> str:
    ans = ans.strip().strip("$").strip()
    ans = re.sub(r"[.。]\s*$", "", ans).strip()  # a sentence's full stop, not a decimal point
    return ans.strip("$").strip()


_BOLD = re.compile(r"\\textbf\s*\{([^{}]*)\}")


def _tidy(ans: str) -> str:
    """Drop what is formatting, not mathematics: bold text and a sentence's final full stop."""
    ans = _BOLD.sub(r"\1", ans).strip()
    return re.sub(r"(?<![.\\])\.$", "", ans).strip()


def extract_final_answer(response: str) -> str | None:
    """The final answer in a response, or None when it states none."""
    answer = _extract(response)
    return _tidy(answer) or None if answer is not None else None


def _extract(response: str) -> str | None:
    boxed = last_boxed(response)
    if boxed:
        return boxed
    hashes = _HASHES.findall(response)
    if hashes:
        return _clean_tail(hashes[-1]).replace("$", "") or None
    said = _ANSWER_IS.findall(response)
    if said:
        return _clean_tail(said[-1]) or None
    return None


def _normalize(s: str) -> str:
    return re.sub(r"\s+", "", s).strip("$")


def _as_latex(ans: str) -> str:
    return f"$\\boxed{{{ans}}}$"


def verify_answer(answer: str, reference: str, timeout_s: int = TIMEOUT_S) -> tuple[bool, str]:
    """(equivalent?, reason) with math-verify's signal timeouts: main thread only."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # raise_on_error=False: a parse error or a timeout gives an empty parse / False
    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold = parse(_as_latex(reference), config, parsing_timeout=timeout_s)
    if not gold:
        return False, "reference could not be parsed"
    pred = parse(_as_latex(answer), config, parsing_timeout=timeout_s)
    if not pred:
        return False, "answer could not be parsed"
    ok = verify(gold, pred, timeout_seconds=timeout_s)
    return bool(ok), "ok" if ok else "wrong answer"


class _Helper:
    """One helper process answering ``{"answer", "reference"}`` lines with ``[ok, reason]`` lines."""

    def __init__(self) -> None:
        # -I: the package as installed, never a module from the worker's folder or PYTHONPATH (no math.py or
        # json.py standing in for the standard one); the helper flushes each answer itself
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-m", "areal_core.reward.math"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # exits at EOF: when its parent is gone
        self._buf = b""

    def ask(self, answer: str, reference: str, limit_s: float) -> tuple[bool, str] | None:
        """The verdict, or None if the helper did not answer within ``limit_s`` (it is then dead)."""
        self.proc.stdin.write((json.dumps({"answer": answer, "reference": reference}) + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + limit_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                self.kill()
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                self.kill()
                raise RuntimeError("math-verify helper process exited unexpectedly")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        ok, reason = json.loads(line)
        return bool(ok), reason

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class _HelperPool:
    def __init__(self, size: int):
        self._idle: queue.LifoQueue[_Helper] = queue.LifoQueue()
        self._slots = threading.Semaphore(size)

    def verify(self, answer: str, reference: str, limit_s: float = HARD_LIMIT_S) -> tuple[bool, str]:
        with self._slots:
            try:
                helper = self._idle.get_nowait()
            except queue.Empty:
                helper = _Helper()
            verdict = helper.ask(answer, reference, limit_s)
            if verdict is None:  # killed: a fresh helper next time
                return False, "timeout (helper process killed)"
            self._idle.put(helper)
            return verdict

    def warm(self) -> None:
        """Have one helper started, with math-verify imported, waiting in the pool."""
        if self.verify("0", "0") != (True, "ok"):
            raise RuntimeError("the math-verify helper process did not confirm 0 = 0")


_pool: _HelperPool | None = None
_pool_lock = threading.Lock()


def _helper_pool() -> _HelperPool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _HelperPool(HELPER_PROCESSES)
        return _pool


def warm_helper() -> None:
    """Start this process's first helper in the background (a Python process importing
    math-verify: a second or more), so that the first answer needing one does not wait for
    it; returns at once. The reward service runs it on its workers when the run's data holds
    math (`RewardService.warm_up`)."""
    threading.Thread(target=_helper_pool().warm, name="math-verify helper start", daemon=True).start()


def equivalent(answer: str, reference: str) -> tuple[bool, str]:
    """Is ``answer`` equivalent to ``reference``? Safe to call from any thread."""
    if _normalize(answer) == _normalize(reference):
        return True, "ok"
    if threading.current_thread() is threading.main_thread():
        return verify_answer(answer, reference)
    return _helper_pool().verify(answer, reference)


def grade_math_result(response: str, reference: str | int) -> RewardResult:
    """Grade a response against a reference answer; keeps the parsed answer and the reason."""
    reference = str(reference).strip()
    if not reference:
        raise ValueError("empty math reference answer")
    answer = extract_final_answer(response)
    if answer is None:
        return RewardResult(correct=False, parsed=None, reason="no answer found")
    ok, reason = equivalent(answer, reference)
    return RewardResult(correct=ok, parsed=answer, reason=reason)


def grade_math(response: str, reference: str | int) -> bool:
    """True iff the response's final answer is mathematically equivalent to ``reference``."""
    return grade_math_result(response, reference).correct


def _helper_main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        ok, reason = verify_answer(req["answer"], req["reference"])
        sys.stdout.write(json.dumps([ok, reason]) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _helper_main()
