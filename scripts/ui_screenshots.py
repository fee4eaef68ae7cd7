"""Screenshots of the batch runs pages, taken by headless Chromium (Debian's ``chromium`` package).

    python scripts/ui_screenshots.py --base-url http://127.0.0.1:8080 --user admin --password admin

signs in to the api-server (``POST /auth/token``), hands the token to Chromium as Airflow's
``_token`` cookie over the DevTools protocol, and saves the batch-runs page (light and dark), the
newest run's page and its task's trends into ``docs/screenshots/``. Each page is checked as it is
taken: a runs table without rows, or a page showing an error, fails the run. The services test
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

    def __init__(self, url: str) -> None:
        from websockets.sync.client import connect

        self.ws = connect(url, max_size=None, open_timeout=30)
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

    def close(self) -> None:
        self.ws.close()


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
        devtools = _DevTools(pages[0]["webSocketDebuggerUrl"])
        try:
            yield devtools
        finally:
            devtools.close()
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8080")
    parser.add_argument("--user", default="admin")
    parser.add_argument("--password", required=True)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    token = login(args.base_url, args.user, args.password)
    request = urllib.request.Request(
        f"{args.base_url.rstrip('/')}/batchinfer/api/runs?limit=1", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        runs = json.load(response)["runs"]
    if not runs:
        print("no batch inference run to show: run a DAG with BatchInferenceOperator first", file=sys.stderr)
        return 1
    failed = False
    for shot in take_all(args.base_url, token, runs[0], args.out):
        bad = shot.problem or shot.traceback or (shot.path.name.startswith("batch-runs") and shot.rows == 0)
        failed = failed or bool(bad)
        print(f"{shot.path}: {shot.heading!r}, {shot.rows} row(s), loaded in {shot.load_s:.2f} s", shot.problem or "")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
