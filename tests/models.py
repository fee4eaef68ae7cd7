"""Small real models and inputs for the tests, built in-process (no hub downloads)."""

from __future__ import annotations

import os
from pathlib import Path


class TextLength:
    """A plain Python model: the length of each text. A text ``fail-once:<path>`` makes the batch
    that holds it fail while that file exists, deleting it first (an injected, one-time fault that
    travels with the data, so it reaches the Ray workers wherever they run)."""

    @classmethod
    def load(cls, path):
        return cls()

    def predict(self, batch):
        for text in batch["text"]:
            if text.startswith("fail-once:") and os.path.exists(text[len("fail-once:"):]):
                os.remove(text[len("fail-once:"):])
                raise RuntimeError("injected failure for the retry test")
        if (batch["text"] == "boom").any():
            row = batch.index[batch["text"] == "boom"][0]
            raise ValueError(f"cannot score text 'boom' (row {row} of the batch)")
        return {"length": batch["text"].str.len().to_numpy()}


class SlowLength(TextLength):
    """TextLength at a fixed pace (0.5 s a batch), so a test can act while its job runs."""

    def predict(self, batch):
        import time

        time.sleep(0.5)
        return super().predict(batch)


class PidLength(TextLength):
    """TextLength that leaves a file named after its worker's pid in ``pid_dir`` and scores at a
    fixed pace, so a test can ``kill -9`` the Ray worker mid-job and see that a new one took over."""

    def predict(self, batch, pid_dir=None, delay=0.3):
        import time

        if pid_dir:
            Path(pid_dir, str(os.getpid())).touch()
        time.sleep(delay)
        return super().predict(batch)


def write_tickets(directory: Path, rows: int = 500, files: int = 4, bad_row: int | None = None,
                  fail_once_flag: Path | None = None) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    texts = [f"ticket {i}: " + "the export is slow " * (i % 7) for i in range(rows)]
    if bad_row is not None:
        texts[bad_row] = "boom"
    if fail_once_flag is not None:
        texts[rows // 2] = f"fail-once:{fail_once_flag}"
    table = pa.table({"ticket_id": pa.array(range(rows), pa.int64()), "text": texts})
    per = -(-rows // files)
    for n, start in enumerate(range(0, rows, per)):
        pq.write_table(table.slice(start, per), directory / f"tickets-{n:02d}.parquet")
    return directory


def tiny_mlp(features: int = 8):
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(features, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    return torch.jit.script(net.eval())
