"""A Dask future already done with a given outcome (a value, or an exception its ``result`` raises),
for tests that stand in for a Dask client's ``submit`` to decide what a reward batch comes back as."""

from __future__ import annotations


class DoneFuture:
    def __init__(self, outcome):
        self.outcome = outcome

    def result(self):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def add_done_callback(self, fn):
        fn(self)
