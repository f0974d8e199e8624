"""Which training problems are also evaluation problems (so they can be left out of training).

The same problem comes in different dress in different sets: the LeetCode sets wrap it in an
instruction and a code stub, LiveCodeBench writes subscripts as ``a_i`` where LeetCode writes
``ai``, one copy has the examples and constraints inline and another not, and LeetCode
rewords statements over the years. Two problems are taken to be the same when

* their record ids are equal, or
* their normalised statements are equal (:func:`statement_key`: the statement before its
  first example, lower case, letters and digits only), or
* at least half of the shorter normalised statement's 30-character runs occur in the
  other (a copy with a sentence changed), or
* they share their entry point (the function the tests call) and at least 30 % of those
  runs (a reworded copy, or the "I" and "II" versions of a LeetCode problem).

The thresholds come from the LiveCodeBench / LeetCode train and test files: real copies
share 45-100 % of their runs, different problems up to about 20 % (a few share stock phrases,
up to 57 % for statements of a line or two, which the rule then also drops: leaving out a
training problem too many costs little, training on an evaluation problem costs the
evaluation its meaning).
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from areal_core.data.records import Record

RUN = 30  # characters of a normalised statement compared as one unit
SAME_SHARE = 0.5  # share of the shorter statement's runs that makes two problems the same
SAME_ENTRY_SHARE = 0.3  # the same, for two problems whose tests call the same function
_LEETCODE_HEADER = (
    "please solve the programming task below using a self-contained code snippet in a markdown code block."
)
_STUB_FOOTER = re.compile(r"please complete the following python code precisely:|complete the code below\.")
_FIRST_EXAMPLE = re.compile(r"\bexample\s*1\s*:|\bsample input\s*1\b|\binput\s*\n\s*the input is given")
_ENTRY_CALL = re.compile(r"check\(\s*(?:Solution\(\)\.)?([A-Za-z_]\w*)\s*\)")


def statement_key(text: str) -> str:
    """The problem statement without its wrapping, examples, case, spacing or punctuation."""
    t = unicodedata.normalize("NFKC", text).lower().replace(_LEETCODE_HEADER, "")
    t = _STUB_FOOTER.split(t, maxsplit=1)[0]
    t = _FIRST_EXAMPLE.split(t, maxsplit=1)[0]
    return "".join(re.findall(r"[a-z0-9]+", t))


def entry_point(record: Record) -> str | None:
    """The function a code record's tests call, if they name one."""
    for t in record.tests or []:
        if t["testtype"] == "functional":
            return t["fn_name"]
        if t["testtype"] == "assert":
            calls = _ENTRY_CALL.findall(t["code"])
            if calls:
                return calls[-1]
    return record.meta.get("entry_point")


def _runs(key: str) -> set[str]:
    return {key[i : i + RUN] for i in range(max(1, len(key) - RUN + 1))}


@dataclass(frozen=True)
class Overlap:
    train_id: str
    eval_id: str
    why: str  # "same id", "same statement", "shared text NN%", "same entry point, shared text NN%"

    def as_dict(self) -> dict:
        return {"train_id": self.train_id, "eval_id": self.eval_id, "why": self.why}


class EvalProblems:
    """An index of evaluation problems that training problems are checked against."""

    def __init__(self, records: Iterable[Record]):
        self.records = list(records)
        self.ids = {r.id: r for r in self.records}
        self.keys = {statement_key(r.prompt): r for r in self.records}
        self.entries = [entry_point(r) for r in self.records]
        self.n_runs = []
        self.by_run: dict[str, list[int]] = defaultdict(list)
        for j, r in enumerate(self.records):
            runs = _runs(statement_key(r.prompt))
            self.n_runs.append(len(runs))
            for run in runs:
                self.by_run[run].append(j)

    def match(self, record: Record) -> Overlap | None:
        """The evaluation problem ``record`` is the same as (see the module docstring), or None."""
        if record.id in self.ids:
            return Overlap(record.id, record.id, "same id")
        key = statement_key(record.prompt)
        if key in self.keys:
            return Overlap(record.id, self.keys[key].id, "same statement")
        runs = _runs(key)
        shared = Counter(j for run in runs for j in self.by_run.get(run, ()))
        entry = entry_point(record)
        best: tuple[float, int, str] | None = None
        for j, n in shared.items():
            share = n / min(len(runs), self.n_runs[j])
            if share >= SAME_SHARE:
                why = f"shared text {share:.0%}"
            elif share >= SAME_ENTRY_SHARE and entry is not None and entry == self.entries[j]:
                why = f"same entry point {entry}, shared text {share:.0%}"
            else:
                continue
            if best is None or share > best[0]:
                best = (share, j, why)
        return None if best is None else Overlap(record.id, self.records[best[1]].id, best[2])


def split_off_overlaps(train: list[Record], held_out: Iterable[Record]) -> tuple[list[Record], list[Overlap]]:
    """``(train records that are no evaluation problem, the overlaps found)``."""
    index = EvalProblems(held_out)
    kept, dropped = [], []
    for r in train:
        hit = index.match(r)
        if hit is None:
            kept.append(r)
        else:
            dropped.append(hit)
    return kept, dropped
