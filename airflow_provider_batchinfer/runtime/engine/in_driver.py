"""Jobs scored in the driver process, without an actor pool.

On the embedded Ray (the local launcher's own Ray, on the Airflow worker's machine) the driver runs
on the only Ray node. A job's fixed cost there is mostly Ray's: the actor pool's replica is a fresh
Ray worker process that imports torch and loads the model, beside fresh read and write workers
and Ray Data's executor (~7 CPU-seconds per job on two cores, for workers Ray never reuses across
jobs). Two kinds of job gain nothing from paying it, and are scored here instead:

- a job whose pool is **one CPU replica** (``JobSpec.replicas=1``, the default): the pool would run
  the same one model copy in another process on this same machine;
- a **small** job (at most ``JobSpec.in_driver_max_rows`` rows to score, default 1,000 or
  ``BATCHINFER_IN_DRIVER_MAX_ROWS``), whatever its replicas: the pool's start-up is most of its time.

The driver runs the same :class:`MeteredReplica` with the same arguments, between a reader thread
and a writer thread (``in_driver_io.py``) that overlap reading, scoring and writing as Ray Data's
operators do. A flavor whose predictor takes concurrent calls (``concurrent_calls``: XGBoost, and
the ONNX Runtime text encoder of ``JobSpec.backend``) is loaded with one thread and called from as
many threads as the job has, batches kept in order: independent one-thread calls share the cores
with the reader and writer better than one call whose threads wait for each other
(``flavors/xgboost_booster.py``, ``flavors/optimized_text.py``). Unless the job sets
``JobSpec.max_batch_rows``, an XGBoost call takes a whole batch of up to
``Tuning.concurrent_batch_rows`` (``runtime/tuning.py``). Parts are named and checksummed as
Ray's write tasks name theirs, and the commit protocol after them is unchanged.
``in_driver_max_rows=0`` sends every job to the actor pool.

Kept on the pool: GPU jobs (Ray owns the GPUs), vLLM, incremental reuse and a budget guard (their
machinery is Ray-side), and any named cluster (its nodes do the work). The driver holds no Ray
reservation: concurrent jobs scored in their drivers share the machine's cores the way any
processes do, instead of queueing for a reservation.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from types import SimpleNamespace
from typing import Any

from airflow_provider_batchinfer.contract import placement
from airflow_provider_batchinfer.runtime.engine.in_driver_io import (
    Pipe,
    Worker,
    driver_batch_rows,
    read_batches,
    write_parts,
)
from airflow_provider_batchinfer.runtime.engine.progress import ProgressLog
from airflow_provider_batchinfer.runtime.errors import JobError
from airflow_provider_batchinfer.runtime.job import CheckedJob, PipelineRun
from airflow_provider_batchinfer.runtime.model import usage
from airflow_provider_batchinfer.runtime.planning import resources
from airflow_provider_batchinfer.runtime.planning.pipeline import ActorPool, size_actor_pool

log = logging.getLogger("batchinfer.runtime")
EMBEDDED_ENV = placement.EMBEDDED_RAY_ENV  # set by the local launcher for a driver on the embedded default
MAX_ROWS_ENV = placement.MAX_ROWS_ENV
DEFAULT_MAX_ROWS = placement.DEFAULT_MAX_ROWS


class InDriverSettingError(JobError):
    """``BATCHINFER_IN_DRIVER_MAX_ROWS`` is not a whole number: no retry fixes the environment."""

    permanent = True


def max_rows(spec_value: int | None, environ: Mapping[str, str] = os.environ) -> int:
    """The job's own ``in_driver_max_rows``, else the deployment's, else 1,000."""
    value = placement.max_rows_setting(spec_value, environ)
    if value is None:
        raw = environ.get(MAX_ROWS_ENV, "").strip()
        raise InDriverSettingError(
            f"{MAX_ROWS_ENV}={raw!r} is not a whole number of rows >= 0; write e.g. {MAX_ROWS_ENV}=1000, or 0 to "
            "run every job on the actor pool"
        )
    return value


def why_not(checked: CheckedJob, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why this job runs on the actor pool, or None when the driver scores it: the spec's reasons
    (``contract/placement.py``, which the local launcher also reads to leave Ray unstarted), then the
    rows'. A job with nothing to score (RESUME found every row done) is "scored" here too: nothing
    to do needs no Ray."""
    limit = max_rows(checked.job.job_spec.in_driver_max_rows, environ)
    return placement.spec_reason(checked.job, limit, environ) or placement.rows_reason(
        checked.job, checked.todo_rows, limit
    )


def why_here(checked: CheckedJob, environ: Mapping[str, str] = os.environ) -> str:
    """For the job log: which of the two rules sent a job that ``why_not`` let through here."""
    spec = checked.job.job_spec
    limit = max_rows(spec.in_driver_max_rows, environ)
    if checked.todo_rows <= limit:
        return f"at most in_driver_max_rows={limit:,} rows on the embedded Ray"
    return "one CPU replica on the embedded Ray, which would run in another process on this machine"


def _direct(target: Any) -> Any:
    """``target`` answering ``obj.method.remote(...)`` by calling the method: the counter the
    replica reports to, without an actor. Calls hold a lock, as an actor runs one call at a time:
    concurrent model calls report to it from several threads."""
    lock = threading.Lock()

    def locked(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return method(*args, **kwargs)

        return call

    class Direct:
        def __getattr__(self, name: str) -> Any:
            return SimpleNamespace(remote=locked(getattr(target, name)))

    return Direct()


def scoring_threads(checked: CheckedJob, pool: ActorPool) -> int:
    """How many model calls run at once in the driver: the job's threads for a CPU job whose
    flavor takes concurrent calls (each call then on one thread), else one call on all of them."""
    from airflow_provider_batchinfer.runtime.model.flavors import flavor, is_optimized, optimized_backend

    if pool["device"] != "cpu" or pool["threads"] <= 1:
        return 1
    name, backend = checked.job.model.flavor, checked.job.job_spec.backend
    if is_optimized(backend):
        optimized = optimized_backend(name)
        concurrent = optimized is not None and optimized.concurrent_calls
    else:
        concurrent = flavor(name).concurrent_calls
    return int(pool["threads"]) if concurrent else 1


def scored_in_order(
    score: Callable[[Any], Any], batches: Iterable[tuple[int, Any]], workers: int
) -> Generator[tuple[int, Any], None, None]:
    """``(tag, score(batch))`` for each ``(tag, batch)``, in the batches' order, with up to
    ``workers`` calls running at once (one more waits, so no thread idles between batches). A call
    that raised raises here when its turn comes: the batches before it were handed on, the ones
    after are dropped (those not started are cancelled; the running ones finish first)."""
    if workers <= 1:
        for tag, batch in batches:
            yield tag, score(batch)
        return
    pending: deque[tuple[int, Future[Any]]] = deque()
    with ThreadPoolExecutor(workers, thread_name_prefix="batchinfer-score") as executor:
        try:
            for tag, batch in batches:
                pending.append((tag, executor.submit(score, batch)))
                if len(pending) > workers:
                    tag, done = pending.popleft()
                    yield tag, done.result()
            while pending:
                tag, done = pending.popleft()
                yield tag, done.result()
        finally:
            for _, waiting in pending:
                waiting.cancel()


def whole_batch_calls(checked: CheckedJob, workers: int) -> bool:
    """Whether each concurrent model call takes its whole batch: one-thread calls wait for no other
    thread, and a flavor whose own predictor takes them and whose CPU calls gain from size
    (``concurrent_calls`` and ``cpu_call_rows``: XGBoost) spends less CPU per row in longer ones.
    Only while the job leaves ``JobSpec.max_batch_rows`` unset (a set one is the most rows of a
    call, always); other concurrent predictors (the ONNX Runtime text encoder) keep their calls."""
    from airflow_provider_batchinfer.runtime.model.flavors import flavor, is_optimized

    spec = checked.job.job_spec
    if workers <= 1 or spec.max_batch_rows is not None or is_optimized(spec.backend):
        return False
    declared = flavor(checked.job.model.flavor)
    return declared.concurrent_calls and declared.cpu_call_rows is not None


def run(checked: CheckedJob) -> Any:
    """Score the job here and return what :func:`driver.run_pipeline` returns for the pool."""
    from airflow_provider_batchinfer.runtime.output import commit

    spec = checked.job.job_spec
    pool = size_actor_pool(spec, resources.reservation(spec, 1))
    workers = scoring_threads(checked, pool)
    batch = driver_batch_rows(checked, concurrent_calls=workers > 1)
    max_rows = batch if whole_batch_calls(checked, workers) else checked.call_rows
    calls = min(batch, max_rows)
    threads = f"{workers} one-thread model calls at a time" if workers > 1 else f"{pool['threads']} thread(s)"
    print(
        f"[batchinfer] scoring {checked.todo_rows:,} rows in the driver process, no actor pool "
        f"({why_here(checked)}); {threads}, batches of {batch:,} rows, model calls of at most {calls:,} rows",
        flush=True,
    )
    counter = usage.UsageCounter()
    meter = usage.Meter(checked.job, pool, None, checked.todo_rows)
    progress = ProgressLog(counter.get, checked.todo_rows, spec.progress_interval_s)
    started = time.monotonic()
    with meter:
        try:
            parts, error_parts = _stream(checked, pool, counter, progress, (batch, max_rows), workers)
        finally:
            progress.stop()
    meter.stats = counter.summary()
    done = time.monotonic()
    written = commit.Written(parts=parts, error_parts=error_parts)
    steady = progress.steady_rate(done, written.rows + written.error_rows)  # else: shorter than one report
    return PipelineRun(
        written=written,
        pool=pool,
        ray_ready_at=started,
        pipeline_s=done - started,
        steady_rows_per_s=steady if steady is not None else counter.reported_rate(),
        placements=[{"node_id": "driver", "node_ip": "127.0.0.1", "replicas": 1}],
        waited_s=0.0,
        meter=meter,
    )


def _stream(
    checked: CheckedJob,
    pool: ActorPool,
    counter: Any,
    progress: ProgressLog,
    rows: tuple[int, int | None],
    workers: int = 1,
) -> tuple[list, list]:
    """Reader thread -> the replica, in this thread (or ``workers`` threads, :func:`scored_in_order`)
    -> writer thread; the model loads while the reader reads ahead. A model error stops the reader,
    lets the writer finish the rows scored before it (whole parts that RESUME keeps, as the pool's
    finished write tasks leave theirs) and is raised; a reader's or writer's error stops the rest
    and is raised. ``rows``: the rows per batch read and the replica's ``max_rows`` (see :func:`run`)."""
    from airflow_provider_batchinfer.runtime.engine.pool_dataset import replica_kwargs

    batch_rows, max_rows = rows

    inbox, outbox = Pipe(), Pipe()

    def writer_side() -> Any:
        try:
            return write_parts(checked, outbox)
        except BaseException:
            outbox.aborted.set()  # wakes the model's thread if it waits to hand over a batch
            raise

    reader = Worker(lambda: read_batches(checked, inbox, batch_rows), "batchinfer-read")
    writer = Worker(writer_side, "batchinfer-write")
    reader.start()
    writer.start()
    try:
        kwargs = dict(replica_kwargs(checked, pool, _direct(counter)), max_rows=max_rows)
        replica = usage.MeteredReplica(**(dict(kwargs, threads=1) if workers > 1 else kwargs))
        progress.start()
        with closing(scored_in_order(replica, inbox, workers)) as scored:
            for file_index, table in scored:
                outbox.put((file_index, table))
    except BaseException:
        inbox.aborted.set()
        if outbox.aborted.is_set():  # the writer failed (our put saw Aborted): its error is the job's
            writer.result()
            raise
        try:
            outbox.close()
            writer.result()
        except Exception:  # the first error is the one reported
            log.debug("writer stopped after the job failed", exc_info=True)
        raise
    outbox.close()
    return writer.result()
