"""Memory and speed of one job at N rows against N/100: with and without ``InputSpec.id_column``, and a
``SaveMode.RESUME`` with half of the rows already committed, on both engines.

Run by hand (not part of the suite)::

    .venv/bin/python -m benchmarks.scale                          # 200M rows against 2M
    .venv/bin/python -m benchmarks.scale --rows 20000000          # 20M against 2M
    .venv/bin/python -m benchmarks.scale --rows 2000000 --small 200000 --paths driver

For each size it writes (once; later runs reuse it) ``--files`` Parquet files of an int64 ``id``
(unique, scattered: no file holds a range) and 4 float32 features under ``--data`` (default
``$BATCHINFER_SCALE_DATA`` or ``/tmp/batchinfer-scale``; 24 bytes a row before compression, about
4.5 GB at 200M rows), and a small TorchScript MLP in a registry beside it. Then for each engine
(``driver``: one replica, scored in the runtime's own process, the embedded default's path;
``pool``: ``replicas=2, in_driver_max_rows=0``, Ray Data's actor pool on a private local Ray) it
runs the runtime (``python -m airflow_provider_batchinfer.runtime``, what every launcher starts) on
three jobs:

- ``no_id``: every row scored, no id column (``SaveMode.OVERWRITE``);
- ``id``: the same with ``id_column`` (the uniqueness check) and ``SaveMode.RESUME`` with nothing kept;
- ``resume``: ``id_column`` and ``SaveMode.RESUME`` after an earlier attempt committed parts holding
  half of the rows: the done set is half the input, and this attempt scores the other half.
  ``--plant ordered`` (default) leaves the first half in input order, as an interrupted run does
  (whole files done, one partly); ``--plant scattered`` every other row, the worst case (every file
  partly done, so the rest of each is copied before scoring).

The runtime's whole process tree (its local Ray included) is sampled every 0.2 s for its peak
resident memory (RSS, the sum over the processes, which counts pages of Ray's shared object store
once in every process that maps them, and PSS, which shares them out). The report (``benchmarks/results/scale-<rows>.json``) gives per job: wall seconds,
rows scored per second, peak RSS, the manifest's timings (``id_check_s``, ``resume_s``), the
1-minute load average at its start and end; and the ratios: peak RSS at N ÷ at the small size
(goal <= 1.5: memory that does not grow with the rows) and rows/s with an id column ÷ without
(goal >= 0.8). On a shared machine figures are only comparable when the load average is low.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SAMPLE_S = 0.2
FEATURES = ["f0", "f1", "f2", "f3"]
_MIX = 0x9E3779B97F4A7C15 >> 1  # odd: multiplying by it modulo 2**63 is a permutation
PLANTED = "t01plant"  # the earlier attempt whose parts a resume keeps
JOBS = ("no_id", "id", "resume")


def write_input(directory: Path, rows: int, files: int) -> list[str]:
    """``rows`` rows over ``files`` Parquet files (id + float32 features), written once: a
    ``_DONE`` file marks a complete set, so a later run reuses it."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = [directory / f"in-{i:03d}.parquet" for i in range(files)]
    if (directory / "_DONE").exists():
        return [str(p) for p in paths]
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    rng = np.random.default_rng(5)
    for path, rows_of_file in zip(paths, np.array_split(np.arange(rows, dtype=np.uint64), files), strict=True):
        with pq.ParquetWriter(path, _schema()) as writer:
            for lo in range(0, len(rows_of_file), 1 << 20):
                chunk = rows_of_file[lo : lo + (1 << 20)]
                x = rng.standard_normal((len(chunk), len(FEATURES)), dtype=np.float32)
                cols = {"id": _ids(chunk), **{name: x[:, i] for i, name in enumerate(FEATURES)}}
                writer.write_table(pa.table(cols, schema=_schema()), row_group_size=1 << 20)
    (directory / "_DONE").write_text(str(rows))
    return [str(p) for p in paths]


def _schema() -> Any:
    import pyarrow as pa

    return pa.schema([("id", pa.int64()), *((name, pa.float32()) for name in FEATURES)])


def _ids(rows: Any) -> Any:
    import numpy as np

    return ((rows * np.uint64(_MIX)) & np.uint64((1 << 63) - 1)).astype(np.int64)


def plant_parts(run_dir: Path, files: list[str], how: str, part_rows: int = 1_000_000) -> int:
    """Parts of about ``part_rows`` rows (id and a score) holding half of the input rows, as an
    earlier attempt that died before its commit leaves them; the rows they hold. ``how``:
    ``"ordered"``, the first half of the rows in input order (what an interrupted run leaves: whole
    files done, one partly); ``"scattered"``, every other row (the worst case: every file partly done)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    total = sum(pq.ParquetFile(path).metadata.num_rows for path in files)
    wanted = total // 2 + total // (4 * len(files))  # ordered: ends half way through a file
    held, number, seen = 0, 0, 0
    waiting: list[Any] = []

    def flush() -> None:
        nonlocal number, waiting
        ids = np.concatenate(waiting)
        table = pa.table({"id": ids, "score": np.zeros(len(ids), np.float32)})
        pq.write_table(table, run_dir / f"part-{number:05d}-{PLANTED}.parquet")
        number, waiting = number + 1, []

    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1 << 20, columns=["id"]):
            ids = batch.column(0).to_numpy()
            ids = ids[::2] if how == "scattered" else ids[: max(0, wanted - seen)]
            seen += batch.num_rows
            if len(ids):
                waiting.append(ids)
                held += len(ids)
            if sum(map(len, waiting)) >= part_rows:
                flush()
    if waiting:
        flush()
    return held


def model_ref(registry_root: Path) -> Any:
    """The benchmark's MLP (4 float32 features -> 64 -> 1, TorchScript) in the registry, logged once."""
    import torch

    from airflow_provider_batchinfer.contract import ModelRef
    from airflow_provider_batchinfer.registry import ModelRegistry

    jit_file = registry_root.parent / "scale_mlp.pt"
    if not jit_file.exists():
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(len(FEATURES), 64), torch.nn.ReLU(), torch.nn.Linear(64, 1), torch.nn.Sigmoid()
        )
        torch.jit.script(net.eval()).save(str(jit_file))
    version = ModelRegistry(str(registry_root)).log_model(
        "scale_mlp",
        "v1",
        "torchscript",
        str(jit_file),
        if_exists="reuse",
        signature={"inputs": dict.fromkeys(FEATURES, "float32"), "outputs": {"score": "float32"}},
    )
    return ModelRef.from_dict(version.to_dict())


def job_location(run_dir: Path, model: Any, registry_root: Path, inputs: Path, path: str, job: str) -> str:
    """Claim ``run_dir`` for one job (as the operator does) and write its job file; its location."""
    from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, JobFile, RunOwner
    from airflow_provider_batchinfer.contract.specs import InputSpec, JobSpec
    from airflow_provider_batchinfer.store.commit import rundir
    from airflow_provider_batchinfer.store.stage import Stage

    spec = JobSpec(replicas=1) if path == "driver" else JobSpec(replicas=2, in_driver_max_rows=0)
    attempt = "t02resume" if job == "resume" else "t01run"
    owner = RunOwner(dag_id="scale", task_id=f"{path}_{job}", run_id="bench", try_number=2 if job == "resume" else 1)
    job_file = JobFile(
        job_id=f"batchinfer-scale-{path}-{job}",
        attempt=attempt,
        launcher="local",
        run_dir=str(run_dir),
        input_locations=(str(inputs),),
        input_spec=InputSpec(id_column=None if job == "no_id" else "id"),
        job_spec=spec,
        model=model,
        registry_root=str(registry_root),
        airflow=owner,
        resume=job != "no_id",
    )
    stage = Stage.open(str(run_dir))
    rundir.claim(stage, job_file)
    return stage.child(JOB_SPEC_FILE).location


def run_sampled(spec: str, env: dict[str, str]) -> tuple[float, int, int]:
    """(seconds, peak RSS, peak PSS) of the runtime on ``spec``, in bytes, over its whole process tree.
    RSS counts a page shared by several processes (Ray's object store) once in each; PSS splits it."""
    import psutil

    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "airflow_provider_batchinfer.runtime", "--spec", spec], env=env)
    root = psutil.Process(proc.pid)
    peak_rss = peak_pss = 0
    while proc.poll() is None:
        rss = pss = 0
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in tree:
            try:
                info = p.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss, pss = rss + info.rss, pss + getattr(info, "pss", info.rss)
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(SAMPLE_S)
    if proc.wait() != 0:
        raise SystemExit(f"the job {spec} failed (exit {proc.returncode})")
    return time.monotonic() - started, peak_rss, peak_pss


def one_job(
    base: Path, inputs: Path, files: list[str], model: Any, registry_root: Path, path: str, job: str, plant: str
) -> dict:
    from airflow_provider_batchinfer.store.committed import read_valid_manifest

    run_dir = base / f"run-{path}-{job}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    kept = plant_parts(run_dir, files, plant) if job == "resume" else 0
    spec = job_location(run_dir, model, registry_root, inputs, path, job)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # the pool: a private local Ray
    env["BATCHINFER_EMBEDDED_RAY"] = "1"  # one replica: scored in the runtime's process
    load_start = os.getloadavg()[0]
    seconds, peak, peak_pss = run_sampled(spec, env)
    manifest = read_valid_manifest(str(run_dir))
    assert manifest is not None, f"no _SUCCESS in {run_dir}"
    scored = manifest.counts.input_rows - kept
    assert manifest.counts.output_rows == manifest.counts.input_rows, manifest.counts
    result = {
        "path": path,
        "job": job,
        "input_rows": manifest.counts.input_rows,
        "kept_rows": kept,
        "scored_rows": scored,
        "wall_s": round(seconds, 2),
        "rows_per_s": round(scored / seconds, 1),
        "peak_rss_mib": round(peak / 2**20, 1),
        "peak_pss_mib": round(peak_pss / 2**20, 1),
        "input_rows_per_s": round(manifest.counts.input_rows / seconds, 1),
        "in_driver": manifest.job.pool.in_driver if manifest.job.pool is not None else None,
        "timings": dict(manifest.timings),
        "load_avg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(result), flush=True)
    shutil.rmtree(run_dir, ignore_errors=True)  # the outputs are large and never read again
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000_000)
    parser.add_argument("--small", type=int, default=2_000_000, help="the size the RSS ratio compares with")
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--data", default=os.environ.get("BATCHINFER_SCALE_DATA", "/tmp/batchinfer-scale"))
    parser.add_argument("--paths", nargs="+", choices=["driver", "pool"], default=["driver", "pool"])
    parser.add_argument("--jobs", nargs="+", choices=JOBS, default=list(JOBS))
    parser.add_argument(
        "--plant", choices=["ordered", "scattered"], default="ordered", help="which half the earlier attempt left"
    )
    parser.add_argument("--out", default=None, help="default: benchmarks/results/scale-<rows>.json")
    args = parser.parse_args()
    base = Path(args.data)
    registry_root = base / "registry"
    registry_root.mkdir(parents=True, exist_ok=True)
    model = model_ref(registry_root)
    report: dict = {
        "rows": args.rows,
        "small": args.small,
        "files": args.files,
        "plant": args.plant,
        "cores": os.cpu_count(),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
        "runs": [],
    }
    print(f"load average (1 min) {report['load_avg_1m_start']:.2f} on {os.cpu_count()} cores", flush=True)
    for rows in sorted({args.small, args.rows}):
        inputs = base / f"input-{rows}"
        files = write_input(inputs, rows, args.files)
        size = sum(Path(f).stat().st_size for f in files)
        print(f"input: {rows:,} rows in {len(files)} files, {size / 2**30:.2f} GiB", flush=True)
        report.setdefault("input_gib", {})[str(rows)] = round(size / 2**30, 3)
        for path in args.paths:
            for job in args.jobs:
                report["runs"].append(one_job(base, inputs, files, model, registry_root, path, job, args.plant))
    report["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    report["ratios"] = ratios(report["runs"], args.rows, args.small)
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"scale-{args.rows}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["ratios"], indent=2))
    print(f"wrote {out}")


def ratios(runs: list[dict], rows: int, small: int) -> dict:
    """Peak RSS at ``rows`` ÷ at ``small`` (per engine and job), and rows/s with an id column ÷
    without (per engine and size)."""
    at = {(r["path"], r["job"], r["input_rows"]): r for r in runs}
    out: dict = {"rss_large_over_small": {}, "pss_large_over_small": {}, "rows_per_s_id_over_no_id": {}}
    for path, job, n in at:
        if n == rows and (path, job, small) in at and rows != small:
            big, little = at[(path, job, rows)], at[(path, job, small)]
            out["rss_large_over_small"][f"{path}/{job}"] = round(big["peak_rss_mib"] / little["peak_rss_mib"], 3)
            out["pss_large_over_small"][f"{path}/{job}"] = round(big["peak_pss_mib"] / little["peak_pss_mib"], 3)
        if job != "no_id" and (path, "no_id", n) in at:
            plain = at[(path, "no_id", n)]["rows_per_s"]
            out["rows_per_s_id_over_no_id"][f"{path}/{job}/{n}"] = round(at[(path, job, n)]["rows_per_s"] / plain, 3)
    return out


if __name__ == "__main__":
    main()
