"""Models for the usage tests (issue 16.2). The model classes are logged with their source file, so
this module imports nothing from the tests package."""

from __future__ import annotations

import os
import time


class GatedLength:
    """The length of each text. Each replica scores its first ``fast_batches`` batches at once and
    every later one in ``delay`` seconds while the file ``gate`` exists: a budget test lets the first
    batches finish into complete parts (whatever order Ray Data hands blocks in), holds the job on
    the rest until its budget stops it, then removes the gate so the retry runs at full speed."""

    def __init__(self) -> None:
        self.calls = 0

    @classmethod
    def load(cls, path):
        return cls()

    def predict(self, batch, gate=None, fast_batches=0, delay=1.0):
        self.calls += 1
        if gate and self.calls > fast_batches and os.path.exists(gate):
            time.sleep(delay)
        return {"length": batch["text"].str.len().to_numpy()}
