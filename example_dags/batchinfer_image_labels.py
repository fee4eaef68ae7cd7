"""Product-image labelling from a directory of images: data_prep >> label >> gate >> publish.

``data_prep`` writes this run's product photos (PNG and JPEG files) into a stage directory and a
Parquet file listing ``product_id`` and each image's location. The job never gets the pixels
from Airflow: ``InputSpec.column_handling={"image_path": "bytes"}`` makes each Ray worker read the
files itself, and only under the connection's allowed roots (the stage root and ``allowed_roots``),
so a row pointing elsewhere fails with its path instead of being read.

The classifier is a tiny ViT trained in-process for a few seconds to tell red, green and blue
products apart (no download); log any transformers image-classification directory instead
(``BATCHINFER_IMAGE_MODEL_DIR``) for real labels. ``publish`` compares labels with the colour
each synthetic product was drawn in.
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

MODEL_NAME = "product_image_labeler"


@dag(
    dag_id="batchinfer_image_labels",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 11, 1, tz="UTC"),
    catchup=False,
    params={"num_images": Param(30, type="integer", minimum=1, description="synthetic product images to write")},
    default_args={"retries": 1, "retry_delay": timedelta(seconds=5)},
    tags=["batchinfer", "example", "multimodal"],
)
def batchinfer_image_labels():
    @task
    def register_model() -> str:
        """Log the labeler; its version is named after its content, so re-logging is a no-op."""
        import tempfile

        from airflow_provider_batchinfer import ModelServiceHook
        from airflow_provider_batchinfer.registry.demo_models import build_tiny_image_classifier

        hook = ModelServiceHook()
        signature = {"inputs": {"image": "binary"}, "outputs": {"label": "string", "score": "float32"}}
        source = os.environ.get("BATCHINFER_IMAGE_MODEL_DIR")
        if source:
            return hook.log_model(
                MODEL_NAME, None, "image_classification", source, signature=signature, if_exists="reuse"
            ).version
        with tempfile.TemporaryDirectory() as tmp:
            path = build_tiny_image_classifier(tmp)
            return hook.log_model(
                MODEL_NAME,
                None,
                "image_classification",
                str(path),
                signature=signature,
                if_exists="reuse",
                description="tiny in-process ViT: red/green/blue",
            ).version

    @task
    def data_prep(params: dict, run_id: str) -> str:
        """Write the images (a mix of PNG and JPEG) and the Parquet index that points at them."""
        import io
        import random
        import zlib

        import pyarrow as pa
        import pyarrow.parquet as pq

        from airflow_provider_batchinfer import ModelServiceHook
        from airflow_provider_batchinfer.registry.demo_models import COLORS, color_image
        from airflow_provider_batchinfer.store.locations import sanitize_run_key
        from airflow_provider_batchinfer.store.stage import Stage

        rng = random.Random(zlib.crc32(run_id.encode()))
        hook = ModelServiceHook()
        run_key = sanitize_run_key(run_id)
        images = Stage.open(hook.resolve_location(f"images/products/{run_key}"))
        ids, paths, colors = [], [], []
        for i in range(int(params["num_images"])):
            color = rng.choice(sorted(COLORS))
            fmt = "PNG" if i % 2 == 0 else "JPEG"
            buf = io.BytesIO()
            color_image(color, size=(rng.randint(32, 96), rng.randint(32, 96)), seed=i).save(buf, format=fmt)
            target = images.child(f"product-{i:05d}.{fmt.lower().replace('jpeg', 'jpg')}")
            target.write_bytes(buf.getvalue())
            ids.append(i)
            paths.append(target.location)
            colors.append(color)
        out = Stage.open(hook.resolve_location(f"prepared/product_images/{run_key}"))
        out.fs.create_dir(out.path, recursive=True)
        with out.fs.open_output_stream(out.child("products.parquet").path) as sink:
            pq.write_table(
                pa.table({"product_id": pa.array(ids, pa.int64()), "image_path": paths, "color": colors}), sink
            )
        return out.location

    label = BatchInferenceOperator(
        task_id="label_images",
        model=MODEL_NAME,
        version="{{ ti.xcom_pull(task_ids='register_model') }}",
        input="{{ ti.xcom_pull(task_ids='data_prep') }}",
        input_spec=InputSpec(
            columns=["product_id", "image_path", "color"],
            column_mapping={"image_path": "image"},
            column_handling={"image_path": "bytes"},  # the worker reads each file; only under allowed roots
        ),
        output_spec=OutputSpec(base_stage_location="labels/product_images", mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(replicas=1, max_batch_rows=32),
        deferrable=True,
    )

    ready = SuccessMarkerSensor(
        task_id="labels_ready", location=label.output["output_location"], deferrable=True, poke_interval=5, timeout=3600
    )

    @task
    def publish(manifest: dict, run_id: str) -> str:
        """Label counts and agreement with the drawn colour, from the committed files only."""
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
        labels, colors = table.column("label").to_pylist(), table.column("color").to_pylist()
        report = {
            "rows": table.num_rows,
            "labels": dict(Counter(labels)),
            "agreement": round(sum(a == b for a, b in zip(labels, colors, strict=False)) / max(len(labels), 1), 4),
            "model": f"{committed.model.name}/{committed.model.version}",
            "source": committed.run_dir,
        }
        out = Stage.open(ModelServiceHook().resolve_location(f"published/image_labels/{sanitize_run_key(run_id)}"))
        out.child("report.json").write_json(report)
        print(f"published report: {json.dumps(report)}")
        return out.child("report.json").location

    [register_model(), data_prep()] >> label
    label >> ready
    publish(ready.output)


batchinfer_image_labels()
