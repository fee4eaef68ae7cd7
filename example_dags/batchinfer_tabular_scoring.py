"""Nightly churn scoring with a small torch network that an upstream task trains and logs.

``train_model`` logs a TorchScript model under a content-addressed version (``sha-<12 hex>``), so a
retry that produces the same bytes reuses it and a changed model becomes a new immutable version;
the inference task pins whatever version that run logged.
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

MODEL_NAME = "churn_scorer"
NUM_FEATURES = 16
FEATURES = [f"f{i:02d}" for i in range(NUM_FEATURES)]


@dag(
    dag_id="batchinfer_tabular_scoring",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 11, 1, tz="UTC"),
    catchup=False,
    params={"num_customers": Param(20000, type="integer", minimum=1)},
    default_args={"retries": 1, "retry_delay": timedelta(seconds=5)},
    tags=["batchinfer", "example"],
)
def batchinfer_tabular_scoring():
    @task
    def train_model() -> str:
        """Fit a tiny MLP on synthetic labelled data and log it; returns the version it was logged as."""
        import torch

        from airflow_provider_batchinfer import ModelServiceHook

        torch.manual_seed(7)
        weights = torch.linspace(-1.0, 1.0, NUM_FEATURES)
        x = torch.randn(4096, NUM_FEATURES)
        y = (x @ weights + 0.1 * torch.randn(4096) > 0).float()
        net = torch.nn.Sequential(
            torch.nn.Linear(NUM_FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1), torch.nn.Sigmoid()
        )
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        for _ in range(200):
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy(net(x).squeeze(1), y)
            loss.backward()
            opt.step()
        print(f"training loss {loss.item():.4f}")
        mv = ModelServiceHook().log_model(
            MODEL_NAME,
            None,
            "torchscript",
            torch.jit.script(net.eval()),
            signature={"inputs": dict.fromkeys(FEATURES, "float32"), "outputs": {"churn_probability": "float32"}},
            if_exists="reuse",
        )
        return mv.version

    @task
    def data_prep(params: dict, run_id: str) -> str:
        import zlib

        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        from airflow_provider_batchinfer import ModelServiceHook
        from airflow_provider_batchinfer.store.locations import sanitize_run_key

        n = int(params["num_customers"])
        rng = np.random.default_rng(zlib.crc32(run_id.encode()))
        features = rng.standard_normal((n, NUM_FEATURES), dtype=np.float32)
        columns = {"customer_id": pa.array(np.arange(1, n + 1, dtype=np.int64))}
        columns.update({name: features[:, i] for i, name in enumerate(FEATURES)})
        # under the connection's stage_root, local or s3://, with its credentials
        out = ModelServiceHook().open_stage(f"prepared/customers/{sanitize_run_key(run_id)}")
        out.fs.create_dir(out.path, recursive=True)
        table = pa.table(columns)
        for part, start in enumerate(range(0, n, 10000)):
            target = out.child(f"customers-{part:03d}.parquet")
            with target.fs.open_output_stream(target.path) as sink:
                pq.write_table(table.slice(start, 10000), sink)
        return out.location

    score = BatchInferenceOperator(
        task_id="score_customers",
        model=MODEL_NAME,
        version="{{ ti.xcom_pull(task_ids='train_model') }}",
        input="{{ ti.xcom_pull(task_ids='data_prep') }}",
        input_spec=InputSpec(passthrough_columns=["customer_id"]),
        output_spec=OutputSpec(base_stage_location="scores/churn", mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(replicas=1),  # rows per model call: the kind decides (TorchScript on CPU: 4,096)
        deferrable=True,  # with the ray_jobs launcher the wait happens in the triggerer
    )

    ready = SuccessMarkerSensor(
        task_id="scores_ready",
        location=score.output["output_location"],
        poke_interval=5,
        timeout=3600,
        mode="reschedule",
    )

    @task
    def publish(manifest: dict, run_id: str) -> str:
        import pyarrow.compute as pc
        import pyarrow.csv as pacsv

        from airflow_provider_batchinfer import ModelServiceHook
        from airflow_provider_batchinfer.store.locations import sanitize_run_key

        hook = ModelServiceHook()
        table = hook.read_committed(manifest)  # only the files _SUCCESS lists, checksums verified
        top = table.take(pc.sort_indices(table, [("churn_probability", "descending")])[:100])
        out = hook.open_stage(f"published/churn/{sanitize_run_key(run_id)}")
        out.fs.create_dir(out.path, recursive=True)
        target = out.child("top_100_at_risk.csv")
        with target.fs.open_output_stream(target.path) as sink:
            pacsv.write_csv(top, sink)
        high = pc.sum(pc.greater(table.column("churn_probability"), 0.5)).as_py()
        print(f"scored {table.num_rows} customers, {high} above 0.5; top 100 written to {target.location}")
        return target.location

    [train_model(), data_prep()] >> score
    score >> ready
    publish(ready.output)


batchinfer_tabular_scoring()
