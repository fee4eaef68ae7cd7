"""Models for the usage tests. The model classes are logged with their source file, so this module
imports nothing from the tests package."""

from __future__ import annotations

import fcntl
import os


class GatedLength:
    """The length of each text. Each replica scores its first ``fast_batches`` batches at once and
    every later one only once it can take a shared lock on the file ``gate``: a budget test holds
    the gate's exclusive lock, so the first batches finish into complete parts (whatever order Ray
    Data hands blocks in) and the rest wait until the budget stops the job; the retry, with the lock
    released, runs at full speed. A lock, not a sleep: the replica waits exactly as long as the test
    says."""

    def __init__(self) -> None:
        self.calls = 0

    @classmethod
    def load(cls, path):
        return cls()

    def predict(self, batch, gate=None, fast_batches=0):
        self.calls += 1
        if gate and self.calls > fast_batches and os.path.exists(gate):
            with open(gate) as held:
                fcntl.flock(held, fcntl.LOCK_SH)  # blocks while the test holds LOCK_EX
        return {"length": batch["text"].str.len().to_numpy()}
