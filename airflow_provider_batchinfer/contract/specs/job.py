"""``JobSpec``: the resources, batching, error policy, backend, budget and reuse of one job."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from airflow_provider_batchinfer.contract.specs.common import SpecError, _known_fields

LLM_ENGINES = ("vllm", "transformers")
# how a sentence-transformers model runs: PyTorch, or exported once to ONNX Runtime (fp32 or dynamic INT8)
MODEL_BACKENDS = ("torch", "onnx", "onnx_int8")
REUSE_MODES = (None, "unchanged")  # JobSpec.reuse


@dataclass(frozen=True)
class JobSpec:
    """Compute for one job, in Ray's terms.

    ``replicas``: the most model copies (actors) the job runs, each loading the model once; the job
    starts with what the cluster can give (at least ``num_workers``, one per node) and the pool
    grows up to ``replicas`` (see ``runtime/planning/resources.py``). ``num_workers``: the Ray nodes the
    replicas are spread over, evenly (``replicas=4, num_workers=2``: two on each of two nodes; 1:
    all on one node, which fetches the model once). ``num_cpus`` / ``num_gpus`` / ``memory``
    (bytes): what each replica reserves. ``resource_wait_s``: how long a job waits for its minimum
    (``num_workers`` replicas and a little CPU for reading and writing) on a busy cluster, or for a
    node that can hold it to join one that grows, before it fails with what it waited for (an
    Airflow retry may then find the cluster free); 0 fails at once where no node could ever hold it.
    ``max_batch_rows``: the most rows of one model call, exactly: a set value is never raised (on
    CPU or anywhere), never replaced by a model kind's default, and is vLLM's ``batch_size``.
    ``None`` (default) lets the model kind decide: on CPU its own size where it has one (tabular
    models 16,384 rows, TorchScript 4,096, sentence-transformers 32, ``encode``'s default), else 256
    (sized for text models and GPU memory). Set it to bound a call's memory (a GPU, a large model)
    or to size a user's own ``predict``; leave it unset for speed.
    ``progress_interval_s``: how often the job logs rows done, rows/s and ETA.
    ``engine``: for ``text_generation`` models, ``"vllm"`` (GPU, through ``ray.data.llm``) or
    ``"transformers"`` (CPU or GPU, a transformers model per replica); ``None`` lets the connection
    decide (extra ``llm_engine``), else vLLM when ``num_gpus > 0``. ``engine_kwargs``: passed to the
    vLLM engine (``max_model_len``, ``dtype``, ``tensor_parallel_size``, ...).

    Error policy: ``on_error="fail"`` (default) fails the whole job on the first row the model or
    the input checks reject, and nothing is committed. ``on_error="dead_letter"`` isolates such rows
    (the batch is re-scored by halves), writes them with their error message and id/passthrough
    columns to ``_errors/`` and commits the rest, unless more than ``max_error_fraction`` of the
    input rows failed (default 1%), in which case the job fails and nothing is committed.
    ``max_value_bytes``: the largest value (string, binary or list) one row may hand the model;
    a larger one is a bad row (default 64 MiB; ``None``: no limit).

    ``rows_per_part``: the commit granularity. By default Ray Data hands a replica whole read blocks
    (up to ~128 MiB of input) and each becomes one output part, so a preempted attempt loses at most
    the blocks in flight; a smaller value cuts blocks to this many rows (a streaming repartition),
    so ``SaveMode.RESUME`` keeps more of an interrupted run, at the cost of more, smaller files.

    Budget (``docs/usage.md``): ``max_cost`` stops the job, committing nothing, once its running cost
    estimate (CPUs/GPUs reserved x seconds held, at the connection's ``price_per_cpu_hour`` /
    ``price_per_gpu_hour``) would exceed it; ``max_output_tokens_total`` does the same for the output
    tokens of a ``text_generation`` model. The failure is permanent (a retry would spend the same);
    raise the limit and retry with ``SaveMode.RESUME`` to keep the parts already written.

    ``reuse``: ``"unchanged"`` turns on incremental scoring (``docs/incremental.md``): a row whose
    model-input content, model sha256, params and output schema equal a row of the newest earlier
    committed run under the same ``base_stage_location`` gets that row's predictions copied instead
    of being scored again; ``None`` (default) scores every row.

    ``in_driver_max_rows``: on the embedded Ray, a CPU job (no reuse or budget) is scored in its
    driver process instead of an actor pool when its pool would be one replica (``replicas=1``),
    or when it has at most this many rows to score: the pool's fresh Ray workers (one importing
    torch) cost seconds that one local replica or a small job never wins back. ``None`` (default):
    ``BATCHINFER_IN_DRIVER_MAX_ROWS``, else 1,000; ``0``: always the actor pool.
    """

    replicas: int = 1
    num_workers: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory: int | None = None
    max_batch_rows: int | None = None
    progress_interval_s: float = 10.0
    resource_wait_s: float = 600.0
    engine: str | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    on_error: str = "fail"
    max_error_fraction: float | None = None
    max_value_bytes: int | None = 64 << 20
    rows_per_part: int | None = None
    # the optimized backend (ONNX Runtime) for sentence-transformers and TorchScript models, and its
    # accuracy guard
    backend: str | None = None
    backend_min_cosine: float = 0.99
    # the budget guard (runtime/model/usage.py): stop, commit nothing, once the running estimate of the
    # cost (at the connection's prices) or of the output tokens (text generation) would exceed these
    max_cost: float | None = None
    max_output_tokens_total: int | None = None
    # incremental scoring: copy the predictions of unchanged rows from the newest earlier run
    reuse: str | None = None
    # on the embedded Ray, one-replica CPU jobs and jobs with at most this many rows to score are
    # scored in the driver process, without an actor pool (runtime/engine/in_driver.py); None:
    # BATCHINFER_IN_DRIVER_MAX_ROWS or 1,000; 0: always the actor pool
    in_driver_max_rows: int | None = None

    @property
    def error_fraction_limit(self) -> float:
        """The effective limit: 0 with ``fail``, ``max_error_fraction`` (default 0.01) with ``dead_letter``."""
        if self.on_error != "dead_letter":
            return 0.0
        return 0.01 if self.max_error_fraction is None else float(self.max_error_fraction)

    def __post_init__(self) -> None:
        if self.engine is not None and self.engine not in LLM_ENGINES:
            raise SpecError(
                f"JobSpec.engine={self.engine!r}: use one of {list(LLM_ENGINES)} or None (decided by the connection)."
            )
        if not isinstance(self.engine_kwargs, dict):
            raise SpecError("JobSpec.engine_kwargs must be a dict, e.g. {'max_model_len': 4096, 'dtype': 'bfloat16'}.")
        object.__setattr__(self, "engine_kwargs", dict(self.engine_kwargs))
        for name in ("replicas", "num_workers", "max_batch_rows"):
            value = getattr(self, name)
            if value is None and name == "max_batch_rows":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                unset = " or None (the model kind decides)" if name == "max_batch_rows" else ""
                raise SpecError(f"JobSpec.{name} must be a whole number >= 1{unset}, got {value!r}.")
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise SpecError(f"JobSpec.{name} must be a number >= 0, got {value!r}.")
        if self.num_cpus == 0 and self.num_gpus == 0:
            raise SpecError(
                "JobSpec needs num_cpus > 0 or num_gpus > 0 per replica; a replica with neither never runs."
            )
        if self.num_gpus > 1 and self.num_gpus != int(self.num_gpus):
            raise SpecError(
                f"JobSpec.num_gpus={self.num_gpus}: above 1 GPU a replica takes whole GPUs; use {int(self.num_gpus)} "
                f"or {int(self.num_gpus) + 1}."
            )
        if self.memory is not None and (
            isinstance(self.memory, bool) or not isinstance(self.memory, int) or self.memory <= 0
        ):
            raise SpecError(f"JobSpec.memory is bytes per replica (a whole number > 0), got {self.memory!r}.")
        if self.replicas < self.num_workers:
            raise SpecError(
                f"JobSpec.replicas={self.replicas} is fewer than num_workers={self.num_workers}: each worker node "
                "needs at least one replica; raise replicas or lower num_workers."
            )
        if not isinstance(self.progress_interval_s, (int, float)) or not 0 < self.progress_interval_s <= 30:
            raise SpecError(
                f"JobSpec.progress_interval_s must be in (0, 30] seconds, got {self.progress_interval_s!r}."
            )
        value = self.resource_wait_s
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 7 * 86400:
            raise SpecError(
                f"JobSpec.resource_wait_s is the seconds a job waits for its minimum resources on a busy cluster, "
                f"from 0 to 604800 (a week); got {value!r}. Write e.g. JobSpec(resource_wait_s=600)."
            )
        if self.on_error not in ("fail", "dead_letter"):
            raise SpecError(f"JobSpec.on_error must be 'fail' or 'dead_letter', got {self.on_error!r}.")
        if self.max_error_fraction is not None:
            if self.on_error != "dead_letter":
                raise SpecError("JobSpec.max_error_fraction applies only with on_error='dead_letter'; set both.")
            value = self.max_error_fraction
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise SpecError(f"JobSpec.max_error_fraction must be a fraction in [0, 1], got {value!r}.")
        if self.rows_per_part is not None and (
            isinstance(self.rows_per_part, bool) or not isinstance(self.rows_per_part, int) or self.rows_per_part < 1
        ):
            raise SpecError(f"JobSpec.rows_per_part must be a whole number >= 1 or None, got {self.rows_per_part!r}.")
        if self.max_value_bytes is not None and (
            isinstance(self.max_value_bytes, bool)
            or not isinstance(self.max_value_bytes, int)
            or self.max_value_bytes < 1
        ):
            raise SpecError(
                f"JobSpec.max_value_bytes must be a whole number of bytes > 0 or None, got {self.max_value_bytes!r}."
            )
        _check_backend(self.backend, self.backend_min_cosine)
        _check_budget(self)
        value = self.in_driver_max_rows
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise SpecError(
                f"JobSpec.in_driver_max_rows is the most rows a job on the embedded Ray scores in its driver "
                f"process instead of an actor pool (a whole number >= 0; 0: always the pool), got {value!r}."
            )
        if self.reuse not in REUSE_MODES:
            raise SpecError(
                f"JobSpec.reuse={self.reuse!r}: write JobSpec(reuse='unchanged') to copy the predictions of rows "
                "that did not change since the last committed run, or leave it None to score every row."
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobSpec:
        return cls(**_known_fields(cls, data))


def _check_backend(backend: str | None, min_cosine: float) -> None:
    """# ``JobSpec.backend`` is one of ``MODEL_BACKENDS`` (None: the flavor's own, PyTorch) and the
    accuracy guard's threshold a cosine similarity in (0, 1]."""
    if backend is not None and backend not in MODEL_BACKENDS:
        raise SpecError(
            f"JobSpec.backend={backend!r}: use one of {list(MODEL_BACKENDS)} or None (PyTorch), e.g. "
            "JobSpec(backend='onnx_int8') for a sentence-transformers model on CPU, JobSpec(backend='onnx') for "
            "a TorchScript model that should start without importing torch."
        )
    if isinstance(min_cosine, bool) or not isinstance(min_cosine, (int, float)) or not 0 < min_cosine <= 1:
        raise SpecError(
            f"JobSpec.backend_min_cosine is the least mean cosine similarity between the optimized backend's "
            f"outputs and PyTorch's on a sample (embeddings; a TorchScript model's output columns, centred), "
            f"in (0, 1]; got {min_cosine!r}. Write e.g. 0.99."
        )


def _check_budget(job: JobSpec) -> None:
    """``max_cost`` (currency units, priced by the connection's ``price_per_cpu_hour`` /
    ``price_per_gpu_hour``) and ``max_output_tokens_total`` (text generation) are positive limits."""
    cost = job.max_cost
    if cost is not None and (
        isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 < cost < float("inf")
    ):
        raise SpecError(
            f"JobSpec.max_cost is the most a run may cost at the connection's prices (a number > 0, e.g. "
            f"JobSpec(max_cost=2.5)), got {cost!r}."
        )
    tokens = job.max_output_tokens_total
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise SpecError(
            f"JobSpec.max_output_tokens_total is the most output tokens a text generation run may produce (a whole "
            f"number >= 1, e.g. JobSpec(max_output_tokens_total=2_000_000)), got {tokens!r}."
        )
