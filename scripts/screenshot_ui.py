"""Screenshot of the Airflow UI showing a finished run of the ticket-embeddings example DAG.

Starts real Airflow services (api-server, scheduler, dag-processor, triggerer; LocalExecutor on
SQLite) in a temporary AIRFLOW_HOME on 127.0.0.1, the same way tests/services/test_airflow_services.py
does, triggers ``batchinfer_ticket_embeddings`` through the REST API, waits for it to succeed, and
has headless Chromium (Debian's ``chromium`` package) take a picture of the run's page. Every
service it started is stopped (by process group) however it ends.

    python scripts/screenshot_ui.py [--out docs/screenshots/dag_run.png] [--tickets 200] [--keep]

Takes 2-4 minutes on 2 cores; not part of ``make test``.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.airflow_services import AirflowServices, services_env  # noqa: E402

DAG_ID = "batchinfer_ticket_embeddings"
BUNDLES = [
    {
        "name": "batchinfer_examples",
        "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
        "kwargs": {"path": str(REPO / "example_dags"), "refresh_interval": 0},
    }
]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    raise SystemExit("no headless browser found: install Debian's chromium (`apt-get install -y chromium`)")


def take_screenshot(url: str, out: Path, profile: Path, wait_ms: int) -> None:
    """Headless Chromium, offline apart from 127.0.0.1: no first-run, sync, updates or QUIC. The UI
    is a React app; the virtual time budget lets it fetch and render before the picture is taken."""
    cmd = [
        chromium_binary(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--window-size=1600,1000",
        f"--virtual-time-budget={wait_ms}",
        f"--screenshot={out}",
        url,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if result.returncode != 0 or not out.exists():
        raise RuntimeError(f"chromium failed (exit {result.returncode}):\n{result.stderr[-2000:]}")


def green_share(png: Path) -> float:
    """Share of clearly green pixels: Airflow paints successful task instances green, so a login
    page or a blank page has next to none."""
    import numpy as np
    from PIL import Image

    rgb = np.asarray(Image.open(png).convert("RGB")).astype(int)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    return float(((g > 90) & (g > r + 40) & (g > b + 40)).mean())


def main() -> int:
    # a plain `kill` (SIGTERM) unwinds through the finally below too, so the services stop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "screenshots" / "dag_run.png")
    parser.add_argument("--tickets", type=int, default=200, help="rows the example's data_prep generates")
    parser.add_argument("--wait-ms", type=int, default=20_000, help="Chromium's virtual time budget")
    parser.add_argument("--keep", action="store_true", help="keep the temporary Airflow home (logs)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="batchinfer-screenshot-"))
    home = root / "airflow"
    home.mkdir()
    port = free_port()
    env = services_env(
        home,
        port,
        BUNDLES,
        {
            "BATCHINFER_HOME": str(root / "batchinfer"),
            "AIRFLOW__OPENLINEAGE__DISABLED": "True",
            "RAY_USAGE_STATS_ENABLED": "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        },
    )
    env.pop("RAY_ADDRESS", None)  # each job starts its own local Ray, as in the embedded default
    services = AirflowServices(home, port, env)
    t0 = time.monotonic()
    try:
        print(f"== starting api-server, scheduler, dag-processor, triggerer on 127.0.0.1:{port} ({home})", flush=True)
        services.start()
        services.wait_for_dag(DAG_ID)
        run_id = services.trigger(DAG_ID, {"num_tickets": args.tickets})
        print(f"== triggered {DAG_ID} {run_id} through the REST API; waiting", flush=True)
        state = services.wait_for_run(DAG_ID, run_id)
        if state != "success":
            print(f"the run ended {state}: {services.task_states(DAG_ID, run_id)}; logs in {home}", file=sys.stderr)
            args.keep = True
            return 1
        url = f"{services.base}/dags/{DAG_ID}/runs/{urllib.parse.quote(run_id, safe='')}"
        args.out.parent.mkdir(parents=True, exist_ok=True)
        print(f"== screenshot of {url}", flush=True)
        take_screenshot(url, args.out, root / "chromium-profile", args.wait_ms)
        share = green_share(args.out)
        if share < 0.001:
            print(
                f"{args.out} shows no successful task instances (green share {share:.4%}): the page did not "
                "render; try a larger --wait-ms",
                file=sys.stderr,
            )
            return 1
        print(f"== saved {args.out} ({share:.2%} green) after {time.monotonic() - t0:.0f}s", flush=True)
        return 0
    finally:
        services.stop()
        if args.keep:
            print(f"Airflow home and logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
