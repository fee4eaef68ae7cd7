"""What a DAG file writes: the specs of a job, the part of the contract users build themselves.

These small frozen dataclasses are built in DAG files, so they validate on construction: a wrong
combination fails when the DAG is parsed (an import error in the UI), not at 2 a.m. when the job
runs. They serialize with ``to_dict`` / ``from_dict`` into the job spec that the Ray runtime reads,
which is why this package imports nothing from Airflow, Ray or torch.

The specs live in small modules (``common``, ``io``, ``job``, and ``tables``: how an Iceberg table
is named as an input or output); import them from here.
"""

from __future__ import annotations

from airflow_provider_batchinfer.contract.specs.common import SaveMode, SpecError
from airflow_provider_batchinfer.contract.specs.io import FILE_ENCODINGS, InputSpec, OutputSpec
from airflow_provider_batchinfer.contract.specs.job import LLM_ENGINES, MODEL_BACKENDS, REUSE_MODES, JobSpec
from airflow_provider_batchinfer.contract.specs.tables import iceberg_input

__all__ = [
    "FILE_ENCODINGS",
    "LLM_ENGINES",
    "MODEL_BACKENDS",
    "REUSE_MODES",
    "InputSpec",
    "JobSpec",
    "OutputSpec",
    "SaveMode",
    "SpecError",
    "iceberg_input",
]
