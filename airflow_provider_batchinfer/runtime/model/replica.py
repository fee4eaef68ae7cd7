"""The model replica: the Ray actor that holds one model copy and scores batches for the job's life."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict

from airflow_provider_batchinfer.registry import MODEL_CACHE_ENV, fetch_version
from airflow_provider_batchinfer.runtime.errors import JobError, check_batch, model_batch_error, score_isolating
from airflow_provider_batchinfer.runtime.model.dereference import dereference_inputs

if TYPE_CHECKING:
    import pyarrow as pa

    from airflow_provider_batchinfer.runtime.planning.pipeline import ColumnPlan

# flavors whose predictor runs on torch: their replicas import it up front and pin its threads
TORCH_FLAVORS = frozenset({"torchscript", "sentence_transformers", "text_generation", "image_classification"})


class RowPolicy(TypedDict, total=False):
    """How a replica treats rows: ``on_error`` ("fail" or "dead_letter"), the columns a dead-lettered
    row keeps, the id column that names rows in messages, and the largest value a row may hold."""

    on_error: str
    keep_columns: list[str]
    id_column: str | None
    max_value_bytes: int | None


class ModelReplica:
    """One model copy: fetches (on its own node), verifies and loads the model once, then scores
    batches for the job's life."""

    def __init__(
        self,
        model_uri: str,
        sha256: str,
        plan: ColumnPlan,
        params: Mapping[str, Any],
        device: str,
        threads: int,
        counter: Any = None,
        max_rows: int | None = None,
        policy: RowPolicy | None = None,
        storage_options: Mapping[str, Any] | None = None,
        num_gpus: float = 0.0,
        backend: str | None = None,
        min_cosine: float = 0.99,
        driver_cache_dir: str | None = None,
    ) -> None:
        from airflow_provider_batchinfer.runtime.model.flavors import (
            call_rows,
            is_optimized,
            load_optimized,
            load_predictor,
        )

        started = time.monotonic()
        node = node_identity()
        if num_gpus > 0:  # before any download or load: a GPU Ray gave us that CUDA cannot see
            check_cuda(num_gpus, node)
        # an object-store model is downloaded here, on the actor's node (once per node: a cache keyed
        # by sha256 and location), not by the driver, whose node may hold no replica at all; the node's own
        # BATCHINFER_MODEL_CACHE wins over the driver's (``driver_cache_dir``, for nodes started without one)
        cache_dir = os.environ.get(MODEL_CACHE_ENV) or driver_cache_dir or None
        model_dir, manifest = fetch_version(
            model_uri, sha256, dict(storage_options) if storage_options else None, cache_dir=cache_dir
        )
        if manifest is None:  # fetch_version re-hashes and returns it whenever verify=True (the default)
            raise RuntimeError(f"model {model_uri} came back without its manifest; it cannot be loaded")
        verified = time.monotonic()
        # torch costs seconds to import: only flavors built on it pay for it (a plain Python model
        # that never touches torch starts without it)
        optimized = is_optimized(backend)  # ONNX Runtime: a cached export needs no torch at all
        self.threads = set_torch_threads(
            device, threads, load_torch=manifest["flavor"] in TORCH_FLAVORS and not optimized
        )
        imported = time.monotonic()
        # the most rows of one model call: the driver passes them resolved (flavors.call_rows), which
        # returns a given value as is; None (a replica built by hand) gets the kind's own
        rows = call_rows(manifest["flavor"], device, max_rows)
        if optimized:
            from airflow_provider_batchinfer.registry.fetch import model_cache_dir

            self.predict = load_optimized(
                model_dir,
                {**manifest, "sha256": sha256},
                device,
                threads,
                rows,
                backend=str(backend),
                min_cosine=min_cosine,
                cache_root=model_cache_dir(cache_dir),
            )
        else:
            self.predict = load_predictor(model_dir, manifest, device=device, threads=threads, max_rows=rows)
        if self.threads is None and "torch" in sys.modules:  # the user's own class imported it
            self.threads = set_torch_threads(device, threads, load_torch=True)
        self.plan = plan
        self.params = dict(params)
        self.model = f"{manifest['name']}/{manifest['version']}"
        self.counter = counter
        self.policy: RowPolicy = policy or {}
        if counter is not None:  # where this replica runs, for the job log and the manifest
            counter.placed.remote(*node)
        print(
            f"[batchinfer] replica ready on node {node[2]}: {self.model} fetched and verified in "
            f"{verified - started:.2f}s, "
            f"torch imported in {imported - verified:.2f}s, loaded in {time.monotonic() - imported:.2f}s "
            f"on {device}, {self.threads or '-'} torch thread(s)"
            + (f", backend {backend} ({threads} ONNX Runtime thread(s))" if optimized else ""),
            flush=True,
        )

    def __call__(self, batch: pa.Table) -> pa.Table:
        """Score a batch; with ``on_error="dead_letter"`` rows that raise come back marked instead
        (``runtime/errors.py``), and only a batch that raised pays for finding them. With "fail", a
        model that raises fails the job naming the batch's ids (``errors.ModelBatchError``)."""
        if batch.num_rows == 0:  # a block RESUME filtered empty: nothing to score, nothing to write
            return batch.select(self.plan["passthrough"])
        if self.policy.get("on_error") == "dead_letter":
            return score_isolating(self._score, batch, self.policy.get("keep_columns", []))
        inputs = self._inputs(batch)
        try:
            outputs = self.predict(inputs, self.params)
        except Exception as exc:  # the model's own error, with where it happened and what to do
            raise model_batch_error(self.model, exc, batch, self.policy.get("id_column")) from exc
        return self._assemble(batch, outputs)

    def _score(self, batch: pa.Table) -> pa.Table:
        return self._assemble(batch, self.predict(self._inputs(batch), self.params))

    def _inputs(self, batch: pa.Table) -> pa.Table:
        """The model's input columns, checked (nulls, NaN, UTF-8, size) and dereferenced (file columns)."""
        plan = self.plan
        inputs = batch.select(plan["sources"])
        if plan["model_inputs"]:
            inputs = inputs.rename_columns(plan["model_inputs"])
        id_column = self.policy.get("id_column")
        check_batch(
            inputs,
            plan["sources"],
            (id_column, batch.column(id_column)) if id_column else None,
            self.policy.get("max_value_bytes"),
            missing_ok=plan.get("missing_ok", ()),  # tree flavors take null/NaN as missing
        )
        return dereference_inputs(inputs, plan.get("dereference"))  # file locations -> contents (column_handling)

    def _assemble(self, batch: pa.Table, outputs: Mapping[str, Any]) -> pa.Table:
        """Passthrough columns plus the model's outputs, one value per row."""
        import numpy as np
        import pyarrow as pa

        columns: dict[str, Any] = {c: batch.column(c) for c in self.plan["passthrough"]}
        for name, values in outputs.items():
            if isinstance(values, np.ndarray) and values.ndim == 2:
                flat = pa.array(np.ascontiguousarray(values).reshape(-1))
                arr: Any = pa.FixedSizeListArray.from_arrays(flat, values.shape[1])
            elif isinstance(values, (pa.Array, pa.ChunkedArray)):
                arr = values
            else:
                arr = pa.array(values)
            if len(arr) != batch.num_rows:
                raise ValueError(
                    f"model {self.model} returned {len(arr)} values for output {name!r} on a batch of "
                    f"{batch.num_rows} rows"
                )
            columns[name] = arr
        if self.counter is not None:
            self.counter.add.remote(batch.num_rows)
        return pa.table(columns)


def set_torch_threads(device: str, threads: int, load_torch: bool = True) -> int | None:
    """Ray pins OMP_NUM_THREADS=1 in an actor that reserves one CPU; a CPU model should use the
    threads the pool was sized for instead, or it runs at a fraction of the machine's speed.
    Returns the intra-op threads torch will use (None without torch, or when ``load_torch`` is
    False and nothing imported it yet)."""
    if device == "cpu":
        os.environ["OMP_NUM_THREADS"] = str(threads)
        os.environ["MKL_NUM_THREADS"] = str(threads)
    if not load_torch and "torch" not in sys.modules:
        return None
    try:
        import torch
    except ImportError:
        return None
    if device == "cpu":
        torch.set_num_threads(max(1, threads))
    return int(torch.get_num_threads())


class NoCudaError(JobError):
    """Ray gave a replica GPUs on a node where torch sees no CUDA device: no retry can fix that."""

    permanent = True


def node_identity() -> tuple[str, str, str]:
    """(this actor's id, its Ray node id, the node's IP) in a Ray worker; placeholders elsewhere."""
    if "ray" not in sys.modules:  # the driver scoring a small job itself (runtime/engine/in_driver.py)
        return str(os.getpid()), "driver", "127.0.0.1"
    try:
        import ray

        if not ray.is_initialized():  # get_runtime_context() would start or attach to a Ray
            return str(os.getpid()), "driver", "127.0.0.1"
        ctx = ray.get_runtime_context()
        # the address the node joined the cluster with (what `ray status` shows), not the host's first IP
        ip = getattr(ray._private.worker.global_worker, "node_ip_address", None) or ray.util.get_node_ip_address()
        return str(ctx.get_actor_id() or os.getpid()), ctx.get_node_id(), str(ip)
    except Exception:  # outside Ray (a unit test calling the class directly)
        return str(os.getpid()), "local", "127.0.0.1"


def check_cuda(num_gpus: float, node: tuple[str, str, str], cuda_available: bool | None = None) -> None:
    """Fail, before the model is fetched or loaded, when Ray gave this replica GPUs that torch
    cannot use (a node started with ``--num-gpus`` but no CUDA device or driver, or a CPU-only torch)."""
    if cuda_available is None:
        try:
            import torch

            cuda_available = bool(torch.cuda.is_available())
        except ImportError:
            cuda_available = False
    if cuda_available:
        return
    given: list[str] = []
    try:
        import ray

        # only inside Ray (a replica): elsewhere get_gpu_ids() would ray.init() this process and
        # attach it, as a driver, to whatever cluster RAY_ADDRESS or /tmp/ray names
        if ray.is_initialized():
            given = [str(g) for g in ray.get_gpu_ids()]
    except Exception:  # the ids only enrich the message
        pass
    raise NoCudaError(
        f"replica on Ray node {node[2]} ({node[1][:12]}) was given {num_gpus:g} GPU(s) by Ray "
        f"(JobSpec.num_gpus={num_gpus:g}; GPU ids {given or 'none'}, CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}) but torch.cuda.is_available() is False there, so the "
        "model was not loaded. The node declares a GPU resource (ray start --num-gpus, or a resources setting) "
        "without a usable CUDA device: install the NVIDIA driver and a CUDA build of torch on that node, stop "
        "declaring GPUs there, or run on CPU with JobSpec(num_gpus=0)"
    )


def replica_init_error(exc: BaseException) -> JobError | None:
    """Ray reports a replica whose constructor raised as an ``ActorDiedError`` that carries our
    error only as text; this gives back the ``NoCudaError`` or the optimized backend's refusal
    (``BackendRefusedError``, with their ``permanent``) when it is one."""
    import re

    from airflow_provider_batchinfer.runtime.model.flavors.optimized.optimized_cache import BackendRefusedError

    for cls in (NoCudaError, BackendRefusedError):
        found = re.search(rf"{cls.__name__}: (.+)", str(exc))
        if found:
            return cls(found.group(1).strip())
    return None
