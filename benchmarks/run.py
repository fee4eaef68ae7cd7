"""Benchmark the provider against the raw model loop and plain Ray Data, in one run.

    make bench                      # full sizes (~22 min on 2 cores: 20k texts, MLP to 10M rows)
    python -m benchmarks.run --quick

Every figure is measured in this run, on the same rows and machine, and reported as rows/s and
as ratios, because absolute numbers on a shared machine are noise. Each system runs in its own
process; this process samples the peak RSS of that process tree (Ray's raylet, GCS and workers
included; for the provider, the runtime's tree, not the Airflow task process that waits on it, nor
the embedded Ray it attaches to).

The provider runs on the embedded default (no Ray address): the benchmark's own local Ray in a
fresh ``BATCHINFER_RAY_DIR``, started by the first job that needs it (a one-replica job, scored in
its driver, starts none). The 100-row job (``overhead``) runs cold twice, the embedded Ray stopped
first: as it is (no Ray started) and on the actor pool (Ray's start-up in the figure); then three
times warm: launch-to-``_SUCCESS`` every way.

Each run also records the CPU-seconds its processes spent (``cpu_s``: the harness's tree and the
embedded Ray's, ``benchmarks/cpu.py``) and where (``cpu_by_component``): on a shared machine they
move less than wall time. The actor pool's steady rate per replica is compared with the driver's
at the largest MLP size, the two run back to back (``report.pool_vs_driver``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.cpu import TreeSampler, children_cpu_s  # noqa: E402
from benchmarks.idle import wait_for_idle  # noqa: E402
from benchmarks.report import compare, median_result, plot, print_table, targets, versions  # noqa: E402
from benchmarks.systems import RESULT_PREFIX  # noqa: E402
from benchmarks.workloads import (  # noqa: E402
    FEATURES,
    export_optimized,
    export_optimized_mlp,
    log_models,
    make_features,
    make_mlp,
    make_texts,
)


def _tree_rss(root, include_root: bool) -> int:
    import psutil

    procs = root.children(recursive=True)
    if include_root:
        procs.append(root)
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


SHOW_LOG = False
_WARM_PROCESS = re.compile(r"in warm runtime process (\d+)")


def _spare_dirs(env: dict) -> list[Path]:
    from airflow_provider_batchinfer.launchers.embedded.embedded_ray import state_dir

    return sorted((state_dir(env) / "spares").glob("*"))


def settle_spares(env: dict) -> None:
    """Wait until no spare runtime process is still importing its libraries: the provider starts one
    after a job, and its imports must not run beside the next system's timed run."""
    from airflow_provider_batchinfer.launchers.embedded.warm_runtime import wait_ready

    for directory in _spare_dirs(env):
        wait_ready(directory, timeout=120)


def stop_spares(env: dict) -> int:
    """Stop the waiting spares: the next provider job starts cold (a fresh interpreter)."""
    from airflow_provider_batchinfer.launchers.embedded.warm_runtime import stop_spares as stop

    return sum(stop(directory) for directory in _spare_dirs(env))


def run_system(system: str, workload: str, cfg: dict, workdir: Path, env: dict, timeout: float) -> dict:
    import psutil

    cfg = dict(cfg, system=system, workload=workload)
    out = workdir / "out" / f"{system}-{workload}-{cfg['rows']}"
    shutil.rmtree(out, ignore_errors=True)
    cfg["out_dir"] = str(out)
    spec = workdir / f"cfg-{system}-{workload}-{cfg['rows']}.json"
    spec.write_text(json.dumps(cfg))
    settle_spares(env)
    settled_s = wait_for_idle()
    load_before = os.getloadavg()[0]
    cpu_before = children_cpu_s()
    tree = TreeSampler(env.get("BATCHINFER_RAY_DIR"))
    tree.start()
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.systems", str(spec)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    root = psutil.Process(proc.pid)
    peak = [0]
    warm = [0]  # the spare runtime process a provider job was handed to: not a child of the harness
    stop = threading.Event()

    def sample() -> None:
        # the provider's harness process is the Airflow task, not the job: measure the runtime's tree
        n = 0
        while not stop.is_set():
            try:
                rss = _tree_rss(root, include_root=not system.startswith("provider"))
                if warm[0]:
                    rss += _tree_rss(psutil.Process(warm[0]), include_root=True)
                peak[0] = max(peak[0], rss)
                if n % 5 == 0:  # CPU per component, once a second
                    tree.sample(proc.pid)
            except Exception:
                pass
            n += 1
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lines, result = [], None
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip())
        handed = _WARM_PROCESS.search(line)
        if handed:
            warm[0] = int(handed.group(1))
        if SHOW_LOG and "[batchinfer]" in line:
            print("      " + line.split("[batchinfer]", 1)[1].strip()[:200], flush=True)
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
    try:
        code = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        code = -9
    stop.set()
    sampler.join()
    tree.sample(None)  # Ray's processes as the job left them
    cpu_s = children_cpu_s() - cpu_before + tree.ray_cpu_s()  # the harness's tree, reaped, and Ray's
    shutil.rmtree(out, ignore_errors=True)
    if code != 0 or result is None:
        tail = "\n".join(lines[-30:])
        raise RuntimeError(f"{system}/{workload} at {cfg['rows']} rows failed (exit {code}):\n{tail}")
    result.update(
        system=system,
        workload=workload,
        settled_s=settled_s,
        load_before=round(load_before, 2),
        load_after=round(os.getloadavg()[0], 2),
        peak_rss_mb=round(peak[0] / 2**20, 1),
        rows_per_s=result["rows"] / result["wall_s"],
        # a job handed to a warm spare ran outside the harness's tree: its CPU is not counted
        cpu_s=None if warm[0] else round(cpu_s, 2),
        cpu_by_component=tree.by_component(),
    )
    if system.startswith("provider"):  # the job's own account of where its time went (pool, replica start-up)
        result["job_log"] = [
            line.split("[batchinfer]", 1)[1].split(" [airflow.", 1)[0].strip()
            for line in lines
            if "[batchinfer]" in line and "progress:" not in line
        ]
    if result["rows"] != cfg["rows"]:
        raise RuntimeError(f"{system}/{workload}: {result['rows']} rows out, {cfg['rows']} in")
    timings = result.get("timings") or {}
    extra = ""
    if timings:
        extra = (
            f"  [pipeline {timings.get('pipeline_s')}s, steady {timings.get('steady_rows_per_s')} rows/s, "
            f"ray_init {timings.get('ray_init_s')}s]"
        )
    print(
        f"  {workload:5s} {cfg['rows']:>9,} rows  {system:13s} {result['wall_s']:8.2f}s  "
        f"{result['rows_per_s']:>10,.0f} rows/s  peak {result['peak_rss_mb']:>8,.0f} MB{extra}  "
        f"load {result['load_before']:.2f}/{result['load_after']:.2f}, {result['cpu_s'] or '-'} CPU-s",
        flush=True,
    )
    return result


def overhead_runs(cfg: dict, workdir: Path, env: dict, warm_runs: int = 3) -> list[dict]:
    """The 100-row provider job cold, then ``warm_runs`` times warm. Cold twice, the embedded Ray
    stopped before each: the default one-replica job (scored in its own process, it starts no Ray;
    every spare runtime process stopped too, so its interpreter imports torch) and the same job on
    the actor pool (``provider_pool``: it starts the embedded Ray, whose start-up is in the figure).
    The warm runs find that Ray up and the spare the first job left, as a busy worker's jobs do."""
    from airflow_provider_batchinfer.launchers.embedded.embedded_ray import shutdown, state_dir

    runs = []
    plan = [("provider", "cold: no Ray running, and a one-replica job starts none")]
    plan += [("provider_pool", "cold, on the actor pool: starts the embedded Ray")]
    plan += [("provider", "warm: the embedded Ray up, a spare runtime process waiting")] * warm_runs
    for n, (system, what) in enumerate(plan):
        if n < 2:
            shutdown(state_dir(env))
        if n == 0:  # the pool's job uses no spare: the one the first job leaves is the warm runs'
            stop_spares(env)
        print(f"  ({what})", flush=True)
        result = run_system(system, "mlp", cfg, workdir, env, timeout=600)
        result["load_before_max"] = result["load_before"]
        result["embedded_ray"] = "cold" if n < 2 else "warm"
        runs.append(result)
    return runs


def _interleaved(systems: list[str], workload: str, cfg: dict, workdir: Path, env: dict, repeat: int) -> list[dict]:
    """Each system ``repeat`` times, interleaved (a, b, c, a, b, c, ...), so a burst of load on the
    machine hits every system alike; the median run of each."""
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for _ in range(repeat):
        for system in systems:
            runs[system].append(run_system(system, workload, cfg, workdir, env, timeout=1800))
    return [median_result(runs[s]) for s in systems]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (2k texts; 10k and 100k MLP rows)")
    parser.add_argument("--text-rows", type=int)
    parser.add_argument("--mlp-rows", type=int, nargs="+")
    parser.add_argument("--only", choices=["text", "mlp", "overhead"], nargs="+", help="run only these workloads")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, help="run only these systems")
    parser.add_argument("--repeat", type=int, default=3, help="runs per system at the small sizes (median kept)")
    parser.add_argument("--text-repeat", type=int, default=1, help="runs per system for the text workload")
    parser.add_argument("--compare", action="store_true", help="print today's figures beside the committed latest.json")
    parser.add_argument("--show-log", action="store_true", help="print each provider job's own log lines")
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "results"), help="where the JSON and PNG go")
    parser.add_argument("--workdir", help="data and scratch (default: a temporary directory, removed at the end)")
    return parser


SYSTEMS = ["raw", "stream", "plain_ray", "provider", "provider_pool", "provider_int8", "provider_onnx"]


def _env(workdir: Path) -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "TOKENIZERS_PARALLELISM": "false",
            "AIRFLOW_HOME": str(workdir / "airflow"),
            "BATCHINFER_HOME": str(workdir / "home"),
            # the node's model cache: the onnx_int8 export made before the timed runs is found there
            "BATCHINFER_MODEL_CACHE": str(workdir / "model-cache"),
            # the provider's warm embedded Ray, this benchmark's own (short: Ray's sockets are near it)
            "BATCHINFER_RAY_DIR": tempfile.mkdtemp(prefix="bir-b-", dir="/tmp"),
        }
    )
    return env


def _workloads(args, models: dict, base: dict, workdir: Path, env: dict, stage_root: Path) -> tuple[list[dict], dict]:
    text_rows, mlp_rows, overhead_rows = args.text_rows, args.mlp_rows, 100
    only = set(args.only or ["text", "mlp", "overhead"])
    wanted = [s for s in SYSTEMS if not args.systems or s in args.systems]
    results: list[dict] = []
    info: dict = {}
    if "text" in only:
        data = make_texts(stage_root / "input" / f"text-{text_rows}", text_rows)
        name, version, st_dir = models["text"]
        files = sorted(map(str, data.glob("*.parquet")))
        cfg = dict(base, rows=text_rows, input_dir=str(data), files=files, model_name=name, model_version=version)
        cfg["st_dir"] = st_dir
        print(f"== all-MiniLM-L6-v2 embeddings, {text_rows:,} mixed-length texts", flush=True)
        if "provider_int8" in wanted:
            info = export_optimized(st_dir, models["text_sha256"], Path(env["BATCHINFER_MODEL_CACHE"]))
        systems = [s for s in ("raw", "plain_ray", "provider", "provider_pool", "provider_int8") if s in wanted]
        for r in _interleaved(systems, "text", cfg, workdir, env, args.text_repeat):
            if r["system"] == "provider_int8":
                r.update(cosine_mean=info["cosine_mean"], cosine_min=info["cosine_min"], export_s=info["export_s"])
            results.append(r)
    sizes = sorted(set(mlp_rows) if "mlp" in only else set()) + ([overhead_rows] if "overhead" in only else [])
    if "mlp" in only and "provider_onnx" in wanted:
        info["mlp_onnx"] = export_optimized_mlp(*models["mlp_uri"], Path(env["BATCHINFER_MODEL_CACHE"]))
    for rows in sizes:
        data = make_features(stage_root / "input" / f"mlp-{rows}", rows)
        name, version, jit_file = models["mlp"]
        files = sorted(map(str, data.glob("*.parquet")))
        cfg = dict(base, rows=rows, input_dir=str(data), files=files, model_name=name, model_version=version)
        cfg["jit_file"] = jit_file
        print(f"== torch MLP 64-256-128-1, {rows:,} rows x 64 float32 features", flush=True)
        if rows == overhead_rows:
            if "provider" in wanted:  # and provider_pool, cold
                results.extend(overhead_runs(cfg, workdir, env))
            continue
        systems = [
            s for s in ("raw", "stream", "plain_ray", "provider", "provider_pool", "provider_onnx") if s in wanted
        ]
        results.extend(_interleaved(systems, "mlp", cfg, workdir, env, args.repeat if rows <= 100_000 else 1))
    return results, info


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.text_rows = args.text_rows or (2_000 if args.quick else 20_000)
    args.mlp_rows = args.mlp_rows or ([10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000, 10_000_000])
    global SHOW_LOG
    SHOW_LOG = args.show_log
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="batchinfer-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results_dir = Path(args.results)
    results_dir.mkdir(parents=True, exist_ok=True)
    committed = results_dir / "latest.json"
    previous = committed.read_text() if committed.exists() else None
    env = _env(workdir)
    os.environ["BATCHINFER_MODEL_CACHE"] = env["BATCHINFER_MODEL_CACHE"]
    stage_root, registry_root = workdir / "stage", workdir / "registry"
    started, load_start = time.monotonic(), os.getloadavg()
    print(
        f"== batchinfer benchmark: {os.cpu_count()} CPU(s), {platform.machine()}, python {platform.python_version()}"
        f"; scratch in {workdir}; load average {load_start}",
        flush=True,
    )
    models = log_models(registry_root, make_mlp(workdir / "mlp.pt"))
    base = {"stage_root": str(stage_root), "registry_root": str(registry_root), "features": FEATURES}
    try:
        results, info = _workloads(args, models, base, workdir, env, stage_root)
    finally:
        from airflow_provider_batchinfer.launchers.embedded.embedded_ray import shutdown

        shutdown(Path(env["BATCHINFER_RAY_DIR"]))
        stop_spares(env)
        shutil.rmtree(env["BATCHINFER_RAY_DIR"], ignore_errors=True)
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    checks = targets(results, args.text_rows, args.mlp_rows, 100)
    print()
    print_table(results, checks)
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average": load_start,
            "load_average_end": os.getloadavg(),
        },
        "versions": versions(),
        "args": {k: v for k, v in vars(args).items() if k not in ("results", "workdir")},
        "quick": args.quick,
        "optimized_export": info,
        "elapsed_s": round(time.monotonic() - started, 1),
        "results": results,
        "targets": checks,
    }
    if args.compare:
        compare(results, previous)
    committed.write_text(json.dumps(report, indent=2))
    plot(results, results_dir / "latest.png")
    print(f"\nwrote {committed} and {results_dir / 'latest.png'} ({report['elapsed_s']}s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
