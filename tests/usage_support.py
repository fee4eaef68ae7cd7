"""Models and helpers for the usage and asset tests (issue 16.2+3). The model classes are logged
with their source file, so this module imports nothing from the tests package."""

from __future__ import annotations

import os
import time


class GatedLength:
    """The length of each text; a batch holding a ticket numbered ``params["slow_from"]`` or above
    (texts ``"ticket <n>: ..."``, as ``tests.models.write_tickets`` writes them) takes
    ``params["delay"]`` seconds a batch while the file ``params["gate"]`` exists. A budget test lets
    the fast rows finish into complete parts, holds the job on the slow ones until its budget stops
    it, then removes the gate so the retry runs at full speed."""

    @classmethod
    def load(cls, path):
        return cls()

    def predict(self, batch, gate=None, slow_from=None, delay=1.0):
        if gate and slow_from is not None and os.path.exists(gate):
            numbers = batch["text"].str.extract(r"^ticket (\d+):", expand=False).astype(float)
            if (numbers >= slow_from).any():
                time.sleep(delay)
        return {"length": batch["text"].str.len().to_numpy()}
