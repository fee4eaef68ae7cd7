"""Screenshots of the batch runs pages, taken by headless Chromium (Debian's ``chromium`` package).

    python scripts/ui_screenshots.py --base-url http://127.0.0.1:8080 --user admin --password admin

signs in to a running api-server (``POST /auth/token``), hands the token to Chromium as Airflow's
``_token`` cookie over the DevTools protocol, and saves the batch-runs page (light and dark), the
newest run's page and its task's trends into ``docs/screenshots/``. Each page is checked as it is
taken: a runs table without rows, or a page showing an error, fails the run.

    python scripts/ui_screenshots.py --demo

needs nothing running: it migrates a metadata DB in a temporary AIRFLOW_HOME, inserts a month of
runs of two DAGs (and a committed run directory with dead-lettered rows), serves Airflow's api-server
app on 127.0.0.1 and takes the same screenshots there. The services test
(``tests/services/test_airflow_services.py``) calls :func:`capture` the same way.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "screenshots"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-port=0",
    "--window-size=1400,900",
)
# what a page says about itself once loaded: the runs table's rows, an error block, its heading
_PAGE_STATE = """JSON.stringify({
  rows: document.querySelectorAll('table.runs tbody tr').length,
  run_ids: [...document.querySelectorAll('table.runs tbody tr td:nth-child(2)')].map(td => td.textContent.trim()),
  problem: (document.querySelector('.problem') || {}).textContent || null,
  heading: (document.querySelector('h1') || {}).textContent || null,
  traceback: document.body.innerText.includes('Traceback'),
})"""


@dataclass(frozen=True)
class Shot:
    """What one screenshot showed."""

    path: Path
    rows: int
    run_ids: list[str]
    problem: str | None
    heading: str | None
    traceback: bool
    load_s: float


class _DevTools:
    """One page of a Chromium, driven over the DevTools protocol (JSON over a websocket)."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.n = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:  # events arrive in between; only this call's answer counts
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == self.n:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})


@contextmanager
def chromium(binary: str = CHROMIUM) -> Iterator[_DevTools]:
    """A headless Chromium in a new empty profile, and its first page."""
    if not Path(binary).exists():
        raise FileNotFoundError(f"{binary} is not installed (Debian: apt-get install chromium)")
    profile = Path(tempfile.mkdtemp(prefix="batchinfer-chromium-"))
    proc = subprocess.Popen(
        [binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not open its DevTools port (exit code {proc.poll()})")
            time.sleep(0.2)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as response:
            pages = [t for t in json.load(response) if t.get("type") == "page"]
        from websockets.sync.client import connect

        with connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30) as ws:
            yield _DevTools(ws)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


def capture(
    page: _DevTools, base_url: str, token: str, path: str, out: Path, dark: bool = False, full_page: bool = False
) -> Shot:
    """Open ``base_url/path`` signed in with ``token`` and save a screenshot of it to ``out`` (with
    ``full_page``, all of it up to 2,400 pixels down, not only the window)."""
    page.call("Network.setCookie", name="_token", value=token, url=base_url)
    scheme = "dark" if dark else "light"
    page.call("Emulation.setEmulatedMedia", features=[{"name": "prefers-color-scheme", "value": scheme}])
    t0 = time.monotonic()
    page.call("Page.navigate", url=f"{base_url.rstrip('/')}/{path.lstrip('/')}")
    deadline = time.monotonic() + 60
    while page.call("Runtime.evaluate", expression="document.readyState")["result"].get("value") != "complete":
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not finish loading in 60 s")
        time.sleep(0.1)
    load_s = time.monotonic() - t0
    state = json.loads(page.call("Runtime.evaluate", expression=_PAGE_STATE)["result"]["value"])
    options: dict[str, Any] = {}
    if full_page:
        size = page.call("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 2400), "scale": 1}
        options = {"captureBeyondViewport": True, "clip": clip}
    data = page.call("Page.captureScreenshot", format="png", **options)["data"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(base64.b64decode(data))
    return Shot(out, state["rows"], state["run_ids"], state["problem"], state["heading"], state["traceback"], load_s)


def login(base_url: str, user: str, password: str) -> str:
    """A JWT from the api-server's auth manager (SimpleAuthManager's ``POST /auth/token``)."""
    body = json.dumps({"username": user, "password": password}).encode()
    request = urllib.request.Request(
        f"{base_url.rstrip('/')}/auth/token", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["access_token"]


def take_all(base_url: str, token: str, run: dict[str, Any], out_dir: Path = OUT) -> list[Shot]:
    """The four screenshots: batch runs (light, dark), one run and its task's trends."""
    query = urllib.parse.urlencode({k: run[k] for k in ("dag_id", "task_id", "run_id", "map_index")})
    trends = urllib.parse.urlencode({k: run[k] for k in ("dag_id", "task_id")})
    with chromium() as page:
        return [
            capture(page, base_url, token, "batchinfer/runs", out_dir / "batch-runs.png"),
            capture(page, base_url, token, "batchinfer/runs", out_dir / "batch-runs-dark.png", dark=True),
            capture(page, base_url, token, f"batchinfer/run?{query}", out_dir / "run.png", full_page=True),
            capture(page, base_url, token, f"batchinfer/trends?{trends}", out_dir / "trends.png", full_page=True),
        ]


def _demo_results(manifest: Any, run_dir: Path) -> list[dict[str, Any]]:
    """A month of daily runs of about 1.2M rows each, then the newest: the real run directory."""
    import random

    rng = random.Random(7)
    results = []
    for i in range(30):
        rows, errors = 1_200_000 + rng.randrange(-50_000, 50_000), rng.choice([0, 0, 0, 3, 12])
        wall = rows / rng.uniform(18_000, 26_000) + 20 * (i == 17)  # one slow day
        usage = {"wall_s": wall, "held_s": wall - 5, "reserved_cpus": 8.0, "reserved_gpus": 0.0,
                 "cpu_seconds": 8 * (wall - 5), "gpu_seconds": 0.0, "rows": rows, "rows_per_s": rows / wall,
                 "cost": 8 * (wall - 5) / 3600 * 0.048}  # fmt: skip
        results.append(
            {"output_location": f"{run_dir.parent}/day-{i:02d}", "rows": rows - errors, "input_rows": rows,
             "error_rows": errors, "model": "churn_mlp", "model_version": "3", "sha256": manifest.model.sha256,
             "attempt": "t01aaaa", "usage": usage, "reused_rows": rng.randrange(0, rows // 2) if i > 20 else 0}
        )  # fmt: skip
    counts, usage = manifest.counts, manifest.usage.to_dict()
    results.append(
        {"output_location": str(run_dir), "rows": counts.output_rows, "input_rows": counts.input_rows,
         "error_rows": counts.error_rows, "model": manifest.model.name, "model_version": manifest.model.version,
         "sha256": manifest.model.sha256, "attempt": manifest.job.attempt, "usage": usage}
    )  # fmt: skip
    return results


def _seed_demo(home: Path) -> None:
    import dataclasses
    from datetime import datetime, timedelta, timezone

    from airflow.utils.session import create_session

    from airflow_provider_batchinfer.contract import SUCCESS_MARKER, ModelRef
    from airflow_provider_batchinfer.contract.usage import Usage
    from tests.ui_seed import committed_run_with_dead_letters, seed_runs

    run_dir = home / "batchinfer" / "stage" / "churn_scores" / "newest"  # below the embedded stage_root
    model = ModelRef("churn_mlp", "3", "torchscript", "4f" * 32, "registry/churn_mlp/3")
    rows, dead, wall = 1_180_000, 6, 47.1
    usage = Usage(wall_s=wall, held_s=wall - 5, reserved_cpus=8.0, reserved_gpus=0.0, cpu_seconds=8 * (wall - 5),
                  gpu_seconds=0.0, rows=rows + dead, rows_per_s=(rows + dead) / wall, batches=288,
                  cost=8 * (wall - 5) / 3600 * 0.048)  # fmt: skip
    manifest = committed_run_with_dead_letters(run_dir, rows=rows, dead=dead)
    manifest = dataclasses.replace(manifest, model=model, usage=usage)
    (run_dir / SUCCESS_MARKER).write_text(manifest.to_json())
    start = datetime(2026, 10, 27, 2, tzinfo=timezone.utc)
    embeddings = [
        {"output_location": f"{home}/batchinfer/stage/tickets/{i}", "rows": 20_000, "input_rows": 20_000, "error_rows": 0,
         "model": "minilm", "model_version": "1", "sha256": "9c" * 32, "attempt": "t01bbbb",
         "usage": {"wall_s": 41.0 + i, "rows_per_s": 20_000 / (41.0 + i), "cpu_seconds": 12.0,
                   "gpu_seconds": 38.0 + i, "cost": (38.0 + i) / 3600 * 1.2}}
        for i in range(4)
    ]  # fmt: skip
    with create_session() as session:
        seed_runs(session, "churn_scores_daily", "score_customers", _demo_results(manifest, run_dir), start,
                  every=timedelta(days=1))  # fmt: skip
        seed_runs(session, "ticket_embeddings", "embed", [*embeddings, None, None], start + timedelta(days=30, hours=1),
                  every=timedelta(hours=1), states=["success"] * 4 + ["failed", "running"])  # fmt: skip


def demo(out_dir: Path = OUT) -> int:
    """The screenshots from demo runs in a temporary Airflow (nothing else needs to run)."""
    import os
    import secrets
    import socket
    import threading

    home = Path(tempfile.mkdtemp(prefix="batchinfer-ui-demo-"))
    password = secrets.token_hex(8)
    (home / "passwords.json").write_text(json.dumps({"admin": password}))
    os.environ.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
            "BATCHINFER_HOME": str(home / "batchinfer"),
        }
    )
    try:
        subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)
        sys.path.insert(0, str(REPO))
        _seed_demo(home)
        import uvicorn
        from airflow.api_fastapi.app import create_app

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(create_app("core"), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 120
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the api-server app did not start")
            time.sleep(0.2)
        try:
            base = f"http://127.0.0.1:{port}"
            return _shoot(base, login(base, "admin", password), out_dir, "churn_scores_daily")
        finally:
            server.should_exit = True
            thread.join(timeout=10)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _shoot(base_url: str, token: str, out_dir: Path, dag_id: str = "") -> int:
    """Screenshots of the newest committed run's pages (of ``dag_id``, or of any DAG); 1 when a page
    shows an error or a table has no rows."""
    query = urllib.parse.urlencode({"limit": 1, "state": "success", **({"dag_id": dag_id} if dag_id else {})})
    request = urllib.request.Request(
        f"{base_url.rstrip('/')}/batchinfer/api/runs?{query}", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        runs = json.load(response)["runs"]
    if not runs:
        print("no batch inference run to show: run a DAG with BatchInferenceOperator first", file=sys.stderr)
        return 1
    failed = False
    for shot in take_all(base_url, token, runs[0], out_dir):
        bad = shot.problem or shot.traceback or (shot.path.name.startswith("batch-runs") and shot.rows == 0)
        failed = failed or bool(bad)
        print(f"{shot.path}: {shot.heading!r}, {shot.rows} row(s), loaded in {shot.load_s:.2f} s", shot.problem or "")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8080")
    parser.add_argument("--user", default="admin")
    parser.add_argument("--password", help="the user's password (not needed with --demo)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--demo", action="store_true", help="serve demo runs from a temporary Airflow and shoot those")
    args = parser.parse_args(argv)
    if args.demo:
        return demo(args.out)
    if not args.password:
        parser.error("--password is required (or --demo)")
    return _shoot(args.base_url, login(args.base_url, args.user, args.password), args.out)


if __name__ == "__main__":
    sys.exit(main())
