"""Downstream DAGs scheduled on the data, not the clock: an inference DAG and a publish DAG that runs
whenever the inference DAG commits.

``batchinfer_risk_scores`` scores customers with a small TorchScript model and commits the run
directory; its ``BatchInferenceOperator`` declares the output location as an Airflow Asset
(``x-batchinfer://batchinfer_default/scores/risk``) and, on each commit, emits an event whose extra
is the manifest's summary (run directory, rows, model, version, sha256, cost when priced).

``batchinfer_publish_risk_scores`` has ``schedule=[that asset]``: Airflow starts it after every
commit, and it reads the run directory from its triggering event, never the upstream run id, then
publishes exactly the committed rows (the files ``_SUCCESS`` lists, checksums verified).

With ``price_per_cpu_hour`` (and ``price_per_gpu_hour``) on the connection, each run's XCom and
manifest also say what it cost, and ``JobSpec(max_cost=...)`` stops a run that would cost more
(see ``docs/usage.md``).
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import Param, dag, task

from airflow_provider_batchinfer import BatchInferenceOperator, InputSpec, JobSpec, OutputSpec, SaveMode
from airflow_provider_batchinfer.operators.assets import stage_asset

MODEL_NAME = "risk_scorer"
SCORES = "scores/risk"  # relative: under the connection's stage_root
NUM_FEATURES = 8
FEATURES = [f"f{i}" for i in range(NUM_FEATURES)]


@dag(
    dag_id="batchinfer_risk_scores",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 11, 1, tz="UTC"),
    catchup=False,
    params={"num_customers": Param(5000, type="integer", minimum=1)},
    default_args={"retries": 1, "retry_delay": timedelta(seconds=5)},
    tags=["batchinfer", "example", "assets"],
)
def batchinfer_risk_scores():
    @task
    def register_model() -> str:
        """A tiny scorer, logged under a content-addressed version (a retry reuses it)."""
        import torch

        from airflow_provider_batchinfer import ModelServiceHook

        torch.manual_seed(3)
        net = torch.nn.Sequential(torch.nn.Linear(NUM_FEATURES, 1), torch.nn.Sigmoid())
        mv = ModelServiceHook().log_model(
            MODEL_NAME,
            None,
            "torchscript",
            torch.jit.script(net.eval()),
            signature={"inputs": dict.fromkeys(FEATURES, "float32"), "outputs": {"risk": "float32"}},
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
        table = pa.table(
            {"customer_id": np.arange(1, n + 1, dtype=np.int64), **{f: features[:, i] for i, f in enumerate(FEATURES)}}
        )
        out = ModelServiceHook().open_stage(f"prepared/risk/{sanitize_run_key(run_id)}")
        out.fs.create_dir(out.path, recursive=True)
        target = out.child("customers.parquet")
        with target.fs.open_output_stream(target.path) as sink:
            pq.write_table(table, sink)
        return out.location

    score = BatchInferenceOperator(
        task_id="score_customers",
        model=MODEL_NAME,
        version="{{ ti.xcom_pull(task_ids='register_model') }}",
        input="{{ ti.xcom_pull(task_ids='data_prep') }}",
        input_spec=InputSpec(passthrough_columns=["customer_id"]),
        output_spec=OutputSpec(base_stage_location=SCORES, mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(max_batch_rows=4096),
        # output_asset=True (the default): the asset stage_asset(SCORES); or name your own Asset
    )
    [register_model(), data_prep()] >> score


@dag(
    dag_id="batchinfer_publish_risk_scores",
    schedule=[stage_asset(SCORES)],  # runs after every commit of batchinfer_risk_scores
    start_date=pendulum.datetime(2026, 11, 1, tz="UTC"),
    catchup=False,
    tags=["batchinfer", "example", "assets"],
)
def batchinfer_publish_risk_scores():
    @task
    def publish() -> str:
        """The 100 riskiest customers of the run that triggered this one, as CSV beside the scores."""
        import pyarrow.compute as pc
        import pyarrow.csv as pacsv
        from airflow.sdk import get_current_context

        from airflow_provider_batchinfer import ModelServiceHook
        from airflow_provider_batchinfer.operators.assets import read_triggering_run

        hook = ModelServiceHook()
        # the newest triggering commit and its validated manifest: no upstream run id needed
        run, manifest = read_triggering_run(get_current_context(), hook.storage_options)
        table = hook.read_committed(manifest.to_dict())
        top = table.take(pc.sort_indices(table, [("risk", "descending")])[:100])
        out = hook.open_stage(f"published/risk/{run['run_dir'].rstrip('/').rsplit('/', 1)[-1]}")
        out.fs.create_dir(out.path, recursive=True)
        target = out.child("top_100.csv")
        with target.fs.open_output_stream(target.path) as sink:
            pacsv.write_csv(top, sink)
        cost = f", cost {run['cost']:.4g}" if "cost" in run else ""
        print(f"{run['rows']} rows scored by {run['model']}/{run['model_version']}{cost}; top 100 at {target.location}")
        return target.location

    publish()


batchinfer_risk_scores()
batchinfer_publish_risk_scores()
