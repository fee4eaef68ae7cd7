"""Nightly support-ticket summaries with a chat LLM: data_prep >> summarize >> gate >> publish.

``data_prep`` turns each ticket into OpenAI-style chat ``messages`` with a prompt template
(``text_to_messages``); ``summarize`` writes ``choices`` (the summary, ``finish_reason``) and
``usage`` (token counts) next to ``ticket_id``; ``publish`` reads only the committed files and
reconciles the token counts.

The engine follows the compute: with ``BATCHINFER_LLM_GPUS`` > 0 (or the connection's extra
``llm_engine: "vllm"``) the job runs vLLM through ``ray.data.llm`` on the GPUs (needs the
``[llm]`` extra); otherwise a transformers model per replica on CPU, so the same DAG runs on a
laptop and in CI. Without ``BATCHINFER_SUMMARIZER_DIR`` the model is a tiny Llama built in-process
(no download; its summaries are gibberish, every column and count is real); point that variable at
a local Hugging Face model directory (e.g. Qwen3-4B-Instruct) to summarize for real.
"""

from __future__ import annotations

import os
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

MODEL_NAME = "ticket_summarizer"
GPUS = float(os.environ.get("BATCHINFER_LLM_GPUS", "0") or 0)
PROMPT = "Summarize support ticket {ticket_id} in one short sentence:\n{text}"
MAX_TOKENS = 24
SYSTEM = "You are a support lead. Be brief and factual."

PRODUCTS = ["billing", "login", "mobile app", "export", "invoices", "notifications", "dashboard"]
PROBLEMS = [
    "fails with a timeout",
    "shows the wrong total",
    "keeps logging me out",
    "returns error 500",
    "does not load at all",
    "sends duplicate emails",
    "is very slow since the update",
]
DETAILS = [
    "",
    "It started yesterday.",
    "This blocks our month-end close, please help urgently.",
    "Our whole team is affected and customers are noticing too.",
]


@dag(
    dag_id="batchinfer_ticket_summaries",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 11, 1, tz="UTC"),
    catchup=False,
    params={
        "num_tickets": Param(200, type="integer", minimum=1, description="synthetic tickets to prepare"),
    },
    default_args={"retries": 1, "retry_delay": timedelta(seconds=5)},
    tags=["batchinfer", "example", "llm"],
)
def batchinfer_ticket_summaries():
    @task
    def register_model() -> str:
        """Log the summarizer; its version is named after its content, so re-logging is a no-op."""
        import tempfile

        from airflow_provider_batchinfer import ModelServiceHook
        from airflow_provider_batchinfer.registry.demo_models import build_tiny_chat_model

        hook = ModelServiceHook()
        source = os.environ.get("BATCHINFER_SUMMARIZER_DIR")
        if source:
            return hook.log_model(MODEL_NAME, None, "text_generation", source, if_exists="reuse").version
        with tempfile.TemporaryDirectory() as tmp:
            path = build_tiny_chat_model(tmp)
            return hook.log_model(
                MODEL_NAME,
                None,
                "text_generation",
                str(path),
                if_exists="reuse",
                description="tiny in-process Llama for demos and CI",
            ).version

    @task
    def data_prep(params: dict, run_id: str) -> str:
        """This run's tickets as Parquet with a ``messages`` column; deterministic per run_id."""
        import random
        import zlib

        import pyarrow as pa
        import pyarrow.parquet as pq

        from airflow_provider_batchinfer import ModelServiceHook
        from airflow_provider_batchinfer.contract.chat import text_to_messages
        from airflow_provider_batchinfer.store.locations import sanitize_run_key
        from airflow_provider_batchinfer.store.stage import Stage

        rng = random.Random(zlib.crc32(run_id.encode()))
        n = int(params["num_tickets"])
        texts = [f"The {rng.choice(PRODUCTS)} {rng.choice(PROBLEMS)}. {rng.choice(DETAILS)}".strip() for _ in range(n)]
        table = pa.table({"ticket_id": pa.array(range(1, n + 1), pa.int64()), "text": texts})
        table = text_to_messages(table, PROMPT, system=SYSTEM)
        out = Stage.open(ModelServiceHook().resolve_location(f"prepared/ticket_chats/{sanitize_run_key(run_id)}"))
        out.fs.create_dir(out.path, recursive=True)
        with out.fs.open_output_stream(out.child("tickets.parquet").path) as sink:
            pq.write_table(table, sink)
        return out.location

    summarize = BatchInferenceOperator(
        task_id="summarize_tickets",
        model=MODEL_NAME,
        version="{{ ti.xcom_pull(task_ids='register_model') }}",
        input="{{ ti.xcom_pull(task_ids='data_prep') }}",
        input_spec=InputSpec(
            columns=["ticket_id", "messages"],
            params={"temperature": 0.0, "max_tokens": MAX_TOKENS},  # greedy: the same tickets, the same summaries
        ),
        output_spec=OutputSpec(base_stage_location="summaries/tickets", mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(
            replicas=1,
            num_gpus=GPUS,
            max_batch_rows=64,
            engine_kwargs={"max_model_len": 4096, "dtype": "auto"} if GPUS else {},
        ),
        deferrable=True,
    )

    ready = SuccessMarkerSensor(
        task_id="summaries_ready",
        location=summarize.output["output_location"],
        deferrable=True,
        poke_interval=5,
        timeout=3600,
    )

    @task
    def publish(manifest: dict, run_id: str) -> str:
        """Reconcile token counts and finish reasons over the committed files and publish a report."""
        import json
        from collections import Counter

        import pyarrow.parquet as pq

        from airflow_provider_batchinfer import ModelServiceHook
        from airflow_provider_batchinfer.contract import Manifest
        from airflow_provider_batchinfer.store.commit.markers import committed_files
        from airflow_provider_batchinfer.store.locations import sanitize_run_key
        from airflow_provider_batchinfer.store.stage import Stage

        committed = Manifest.from_dict(manifest)  # the sensor's XCom: the manifest's dict
        table = pq.read_table(committed_files(committed))
        usage = table.column("usage").to_pylist()
        choices = table.column("choices").to_pylist()
        bad = [u for u in usage if u["total_tokens"] != u["prompt_tokens"] + u["completion_tokens"]]
        if bad or len({*table.column("ticket_id").to_pylist()}) != table.num_rows:
            raise ValueError(f"summaries do not reconcile: {len(bad)} rows with inconsistent token counts")
        report = {
            "rows": table.num_rows,
            "prompt_tokens": sum(u["prompt_tokens"] for u in usage),
            "completion_tokens": sum(u["completion_tokens"] for u in usage),
            "total_tokens": sum(u["total_tokens"] for u in usage),
            "finish_reasons": dict(Counter(c[0]["finish_reason"] for c in choices)),
            "model": f"{committed.model.name}/{committed.model.version}",
            "source": committed.run_dir,
        }
        out = Stage.open(ModelServiceHook().resolve_location(f"published/ticket_summaries/{sanitize_run_key(run_id)}"))
        out.child("report.json").write_json(report)
        print(f"published report: {json.dumps(report)}")
        return out.child("report.json").location

    [register_model(), data_prep()] >> summarize
    summarize >> ready
    publish(ready.output)


batchinfer_ticket_summaries()
