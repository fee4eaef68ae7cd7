"""Image classification with a transformers model and its image processor (no torchvision needed).

The image column holds the image itself: raw bytes (``column_handling={"path": "bytes"}`` reads
them from the stage), base64 or a data URL. Outputs are the top label and its probability; with
a ``top_k`` output in the signature also the ``params["top_k"]`` (default 3) best as a list of
{label, score}.
"""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.runtime.model.flavors.protocol import Flavor


def decode_image(value: Any, column: str):
    """A PIL RGB image from bytes, base64 text or a ``data:`` URL; a clear error for anything else."""
    from PIL import Image, UnidentifiedImageError

    data = value
    if isinstance(value, str):
        text = value.split(",", 1)[1] if value.startswith("data:") else value
        try:
            data = base64.b64decode(text, validate=True)
        except ValueError:
            raise ValueError(
                f"column {column!r} holds text that is neither base64 nor a data URL ({value[:60]!r}); if it is a "
                f"file location, set InputSpec.column_handling={{{column!r}: 'bytes'}}"
            ) from None
    if not isinstance(data, (bytes, bytearray)):
        raise ValueError(f"column {column!r}: expected image bytes, got {type(value).__name__}")
    try:
        return Image.open(io.BytesIO(data)).convert("RGB")
    except UnidentifiedImageError:
        raise ValueError(f"column {column!r}: {len(data)} bytes that Pillow cannot read as an image") from None


def load(model_dir: Path, manifest: dict[str, Any], device: str, threads: int, max_rows: int | None = None):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import pyarrow as pa
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    path = str(model_dir / manifest["options"]["dir"])
    # the PIL backend needs no torchvision (the default backend does)
    processor = AutoImageProcessor.from_pretrained(path, local_files_only=True, backend="pil")
    model = AutoModelForImageClassification.from_pretrained(path, local_files_only=True).to(device).eval()
    labels = model.config.id2label
    (image_col,) = list(manifest["signature"]["inputs"])[:1]
    outputs = manifest["signature"]["outputs"]
    step = max_rows or 32

    def predict(inputs, params: dict[str, Any]) -> dict[str, Any]:
        top_k = int(params.get("top_k", 3))
        images = [decode_image(v, image_col) for v in inputs.column(image_col).to_pylist()]
        probs = []
        with torch.inference_mode():
            for i in range(0, len(images), step):
                pixel = processor(images=images[i : i + step], return_tensors="pt")["pixel_values"].to(device)
                probs.append(model(pixel_values=pixel).logits.softmax(-1).float().cpu())
        p = torch.cat(probs) if probs else torch.zeros((0, len(labels)))
        score, best = p.max(-1)
        out: dict[str, Any] = {
            "label": pa.array([labels[int(b)] for b in best], pa.string()),
            "score": pa.array(score.numpy(), pa.float32()),
        }
        if "top_k" in outputs:
            k = max(1, min(top_k, p.shape[1]))
            vals, idx = p.topk(k, dim=-1)
            out["top_k"] = pa.array(
                [
                    [{"label": labels[int(j)], "score": float(v)} for v, j in zip(vr, ir, strict=False)]
                    for vr, ir in zip(vals, idx, strict=False)
                ],
                pa.list_(pa.struct([("label", pa.string()), ("score", pa.float32())])),
            )
        return {name: out[name] for name in outputs}

    return predict


FLAVOR = Flavor(name="image_classification", load=load, transfer_rows=0)
