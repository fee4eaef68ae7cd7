"""ONNX Runtime sessions sized for one replica: shared by the ``onnx`` flavor and the optimized
sentence-transformers backend, so both place threads and pick execution providers the same way.

Why per replica: ONNX Runtime's default intra-op pool takes every core of the machine, and on a node
where several replicas and Ray Data's read/write tasks share the cores, that oversubscription costs
more than it gains. A replica gets exactly the threads its Ray reservation holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class OrtUnavailableError(RuntimeError):
    """onnxruntime is not installed where the replica runs (a permanent error for the job)."""


def execution_providers(use_cuda: bool) -> list[str]:
    """CUDA first when asked for and present in this onnxruntime build, the CPU provider always last
    (ONNX Runtime falls back to it for operators the GPU provider lacks)."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    providers = ["CUDAExecutionProvider"] if use_cuda and "CUDAExecutionProvider" in available else []
    return [*providers, "CPUExecutionProvider"]


def ort_session(path: str | Path, *, intra_op_threads: int, use_cuda: bool = False) -> Any:
    """An ``onnxruntime.InferenceSession`` on ``path`` with ``intra_op_threads`` threads (at least
    one), one inter-op thread (a replica runs one model call at a time) and full graph optimization."""
    try:
        import onnxruntime as ort
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise OrtUnavailableError(
            "onnxruntime is not installed on the Ray workers: pip install 'airflow-provider-batchinfer[onnx]'"
        ) from exc
    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, int(intra_op_threads))
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), sess_options=options, providers=execution_providers(use_cuda))
