"""Small real models and inputs for the tests, built in-process (no hub downloads)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class TextLength:
    """A plain Python model: the length of each text. A text ``fail-once:<path>`` makes the batch
    that holds it fail while that file exists, deleting it first (an injected, one-time fault that
    travels with the data, so it reaches the Ray workers wherever they run)."""

    @classmethod
    def load(cls, path):
        return cls()

    def predict(self, batch):
        for text in batch["text"]:
            if text.startswith("fail-once:") and os.path.exists(text[len("fail-once:") :]):
                os.remove(text[len("fail-once:") :])
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


class WhereLength(TextLength):
    """TextLength plus ``LENGTH_OFFSET`` from the scoring process's environment, leaving a file named
    after that process's pid in ``pid_dir``: which process scored a job, with which environment."""

    def predict(self, batch, pid_dir=None, delay=0.0):
        import time

        if pid_dir:
            Path(pid_dir, str(os.getpid())).touch()
        time.sleep(delay)
        out = super().predict(batch)
        return {"length": out["length"] + int(os.environ.get("LENGTH_OFFSET", "0"))}


def write_tickets(
    directory: Path, rows: int = 500, files: int = 4, bad_row: int | None = None, fail_once_flag: Path | None = None
) -> Path:
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


def job_file(
    run_dir,
    model,
    registry_root: str,
    inputs,
    *,
    input_spec=None,
    job_spec=None,
    attempt: str = "t01test",
    job_id: str = "batchinfer-test",
    file_roots=(),
    ray_address: str | None = None,
    resume: bool = False,
    try_number: int = 1,
):
    """A job file as the operator writes it (``contract.JobFile``), for driving the runtime directly.

    ``model`` is a registry ``ModelVersion`` (or anything with ``to_dict()`` in the registry's shape)."""
    from airflow_provider_batchinfer.contract import JobFile, ModelRef, RunOwner
    from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec

    return JobFile(
        job_id=job_id,
        attempt=attempt,
        launcher="local",
        run_dir=str(run_dir),
        input_locations=tuple(str(i) for i in inputs),
        input_spec=input_spec or InputSpec(),
        job_spec=job_spec or JobSpec(),
        model=ModelRef.from_dict(model.to_dict()),
        registry_root=registry_root,
        airflow=RunOwner(dag_id="bi_tests", task_id="infer", run_id="r1", try_number=try_number),
        file_roots=tuple(str(r) for r in file_roots),
        ray_address=ray_address,
        resume=resume,
    )


def ticket_job(tmp_path, registry, model, name: str, rows: int, *, ray_address: str | None = None, **spec):
    """``(run dir, JobFile)``: ``rows`` tickets in 4 files scored by ``model``, ids in ``ticket_id``,
    model calls of 20 rows and progress every 2 s; ``spec`` overrides the JobSpec."""
    from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec

    inputs = write_tickets(tmp_path / f"in-{name}", rows=rows, files=4)
    run_dir = tmp_path / f"out-{name}"
    run_dir.mkdir()
    job = job_file(
        run_dir,
        model,
        registry.root,
        [inputs],
        job_id=f"batchinfer-{name}",
        attempt=f"t01{name}",
        input_spec=InputSpec(id_column="ticket_id"),
        job_spec=JobSpec(**{"max_batch_rows": 20, "progress_interval_s": 2, **spec}),
        ray_address=ray_address,
    )
    return run_dir, job


def write_job_file(job) -> str:
    """Claim ``job``'s run directory for it (``_job.json`` and its commit token, as the operator
    does); the job file's location."""
    from airflow_provider_batchinfer.contract import JOB_SPEC_FILE
    from airflow_provider_batchinfer.store.commit import rundir
    from airflow_provider_batchinfer.store.stage import Stage

    run_dir = Stage.open(job.run_dir)
    earlier = rundir.read_claim(run_dir) if job.resume else None
    if earlier is not None:  # a RESUME of the same result (``rundir.prepare``): its claim's lineage goes on
        import dataclasses

        job = dataclasses.replace(job, resumable=(*earlier.resumable_attempts, job.attempt))
    rundir.claim(run_dir, job)
    return run_dir.child(JOB_SPEC_FILE).location


def committed_manifest(location: str) -> dict | None:
    """The validated ``_SUCCESS`` of a run directory in its serialized form (what goes to XCom),
    or None while it has none."""
    from airflow_provider_batchinfer.store.committed import read_valid_manifest

    manifest = read_valid_manifest(location)
    return None if manifest is None else manifest.to_dict()


def model_job(tmp_path: Path, registry, mv) -> Any:
    """A minimal job file for model version ``mv`` of ``registry``, with ``<tmp_path>/run`` created."""
    from airflow_provider_batchinfer.contract import JobFile, ModelRef, RunOwner
    from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec

    (tmp_path / "run").mkdir(exist_ok=True)
    return JobFile(
        job_id="j",
        attempt="t01abc",
        launcher="local",
        run_dir=str(tmp_path / "run"),
        input_locations=(str(tmp_path / "in"),),
        input_spec=InputSpec(),
        job_spec=JobSpec(),
        model=ModelRef(
            name=mv.name, version=mv.version, flavor=mv.flavor, sha256=mv.sha256, uri=mv.uri, signature=mv.signature
        ),
        registry_root=str(registry.root),
        airflow=RunOwner(dag_id="d", task_id="t", run_id="r", try_number=1, map_index=-1),
    )
