"""What the pages show, from what the operator recorded: pure functions, no Airflow, no storage.

A run's row comes from its task instance and the XCom return value the operator pushed
(``operators/finalize.py``); the run page adds the manifest (:func:`manifest_view`). Everything
here is plain data in and plain data out, so the JSON endpoints and the HTML pages show the same
figures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any
from xml.sax.saxutils import escape

from airflow_provider_batchinfer.contract import Manifest

MAX_PAGE_SIZE = 200
DEFAULT_PAGE_SIZE = 50


def _num(value: Any) -> float | None:
    """A finite number, or None (a missing key, a string, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _int(value: Any) -> int | None:
    number = _num(value)
    return None if number is None else int(number)


@dataclass(frozen=True)
class RunRow:
    """One ``BatchInferenceOperator`` task instance as the batch-runs table lists it."""

    dag_id: str
    task_id: str
    run_id: str
    map_index: int
    try_number: int
    state: str | None
    start_date: str | None
    end_date: str | None
    model: str | None = None
    model_version: str | None = None
    sha256: str | None = None
    input_rows: int | None = None
    output_rows: int | None = None
    error_rows: int | None = None
    reused_rows: int | None = None
    wall_s: float | None = None
    rows_per_s: float | None = None
    cpu_seconds: float | None = None
    gpu_seconds: float | None = None
    cost: float | None = None
    output_location: str | None = None
    attempt: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_row(ti: Mapping[str, Any], result: Any) -> RunRow:
    """A row from the task instance's columns and its XCom return value (None before it committed).
    Wall time and rows/s are the job's (``usage``); a manifest written before usage was recorded
    falls back on the task instance's duration."""
    value: Mapping[str, Any] = result if isinstance(result, Mapping) else {}
    raw_usage = value.get("usage")
    usage: Mapping[str, Any] = raw_usage if isinstance(raw_usage, Mapping) else {}
    input_rows = _int(value.get("input_rows"))
    wall = _num(usage.get("wall_s"))
    if wall is None and value:
        wall = _num(ti.get("duration"))
    rate = _num(usage.get("rows_per_s"))
    if rate is None and wall and input_rows is not None:
        rate = input_rows / wall
    return RunRow(
        dag_id=str(ti["dag_id"]),
        task_id=str(ti["task_id"]),
        run_id=str(ti["run_id"]),
        map_index=int(ti.get("map_index", -1)),
        try_number=int(ti.get("try_number") or 0),
        state=None if ti.get("state") is None else str(ti["state"]),
        start_date=_iso(ti.get("start_date")),
        end_date=_iso(ti.get("end_date")),
        model=_str(value.get("model")),
        model_version=_str(value.get("model_version")),
        sha256=_str(value.get("sha256")),
        input_rows=input_rows,
        output_rows=_int(value.get("rows")),
        error_rows=_int(value.get("error_rows")),
        reused_rows=_int(value.get("reused_rows")),
        wall_s=wall,
        rows_per_s=rate,
        cpu_seconds=_num(usage.get("cpu_seconds")),
        gpu_seconds=_num(usage.get("gpu_seconds")),
        cost=_num(usage.get("cost")),
        output_location=_str(value.get("output_location")),
        attempt=_str(value.get("attempt")),
    )


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _iso(value: Any) -> str | None:
    if value is None:
        return None
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


# --- pagination ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Page:
    """Where a page starts and what the links around it point at (offsets, not page numbers: an
    offset link stays meaningful while new runs arrive at the top)."""

    offset: int
    limit: int
    total: int

    @property
    def first(self) -> int:
        return min(self.offset + 1, self.total) if self.total else 0

    @property
    def last(self) -> int:
        return min(self.offset + self.limit, self.total)

    @property
    def prev_offset(self) -> int | None:
        return max(self.offset - self.limit, 0) if self.offset > 0 else None

    @property
    def next_offset(self) -> int | None:
        return self.offset + self.limit if self.offset + self.limit < self.total else None


def page_bounds(offset: Any, limit: Any) -> tuple[int, int]:
    """``(offset, limit)`` from query values: offset >= 0, 1 <= limit <= MAX_PAGE_SIZE."""
    try:
        start = max(int(offset), 0)
    except (TypeError, ValueError):
        start = 0
    try:
        size = int(limit)
    except (TypeError, ValueError):
        size = DEFAULT_PAGE_SIZE
    return start, min(max(size, 1), MAX_PAGE_SIZE)


# --- formatting ----------------------------------------------------------------------------------------
def fmt_int(value: int | None) -> str:
    return "–" if value is None else f"{value:,}"


def fmt_num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def fmt_seconds(value: float | None) -> str:
    """``12.3 s``, ``4 min 05 s``, ``2 h 03 min``."""
    if value is None:
        return "–"
    if value < 60:
        return f"{value:.1f} s"
    minutes, seconds = divmod(round(value), 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def fmt_bytes(value: int | None) -> str:
    if value is None:
        return "–"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def fmt_cost(value: float | None) -> str:
    """A cost where the connection priced the run; ``–`` where it did not."""
    if value is None:
        return "–"
    return f"{value:.4f}" if value >= 0.01 or value == 0 else f"{value:.2g}"


# --- the manifest --------------------------------------------------------------------------------------
def manifest_view(manifest: Manifest) -> dict[str, Any]:
    """The manifest in readable form: its summary, parts, dead-letter files, usage, lineage and the
    Iceberg snapshot of a table output."""
    table = manifest.table
    return {
        "format": manifest.format,
        "run_dir": manifest.run_dir,
        "counts": manifest.counts.to_dict(),
        "model": manifest.model.without_signature().to_dict(),
        "job": {"id": manifest.job.id, "attempt": manifest.job.attempt, "launcher": manifest.job.launcher},
        "started_at": manifest.started_at,
        "finished_at": manifest.finished_at,
        "timings": dict(manifest.timings),
        "files": [f.to_dict() for f in manifest.files],
        "error_files": [f.to_dict() for f in manifest.error_files],
        "usage": manifest.usage.to_dict() if manifest.usage is not None else None,
        "lineage": {
            "inputs": list(manifest.input_locations)
            + ([f"iceberg://{manifest.table_input.identifier}"] if manifest.table_input else []),
            "outputs": [f"iceberg://{table.identifier}"] if table else [manifest.run_dir],
        },
        # the catalog's properties stay out: they may hold a catalog's credentials
        "table": _without_catalog(table.to_dict()) if table else None,
        "table_input": _without_catalog(manifest.table_input.to_dict()) if manifest.table_input else None,
        "reuse": manifest.reuse.summary() if manifest.reuse is not None else None,
    }


def _without_catalog(section: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in section.items() if k != "catalog"}


# --- the trend plot ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrendPoint:
    run_id: str
    rows_per_s: float | None
    cost_per_million: float | None
    error_fraction: float | None


def trend_points(rows: Sequence[RunRow]) -> list[TrendPoint]:
    """Rows/s, cost per million input rows and the dead-lettered fraction of each committed run."""
    points = []
    for row in rows:
        if row.input_rows is None:  # no result: the try did not commit
            continue
        per_million = row.cost / row.input_rows * 1e6 if row.cost is not None and row.input_rows else None
        fraction = (row.error_rows or 0) / row.input_rows if row.input_rows else None
        points.append(TrendPoint(row.run_id, row.rows_per_s, per_million, fraction))
    return points


def svg_plot(values: Sequence[float | None], labels: Sequence[str], title: str, width: int = 640) -> str:
    """A small line plot as inline SVG: readable without JavaScript, coloured by the page's CSS
    (``currentColor``) so it follows the light or dark theme."""
    height, pad_l, pad_r, pad_t, pad_b = 180, 64, 16, 24, 28
    known = [(i, v) for i, v in enumerate(values) if v is not None]
    head = (
        f'<svg class="plot" role="img" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>'
        f'<text x="{pad_l}" y="16" class="plot-title">{escape(title)}</text>'
    )
    if not known:
        return head + f'<text x="{pad_l}" y="{height // 2}">no data</text></svg>'
    top = max(v for _, v in known)
    top = top if top > 0 else 1.0
    inner_w, inner_h = width - pad_l - pad_r, height - pad_t - pad_b
    step = inner_w / max(len(values) - 1, 1)

    def xy(i: int, v: float) -> tuple[float, float]:
        return pad_l + i * step, pad_t + inner_h * (1 - v / top)

    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, v) for i, v in known))
    dots = "".join(
        f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3"><title>{escape(labels[i])}: {v:.4g}</title></circle>'
        for i, v in known
        for x, y in [xy(i, v)]
    )
    axis = (
        f'<line x1="{pad_l}" y1="{pad_t + inner_h}" x2="{width - pad_r}" y2="{pad_t + inner_h}" class="axis"/>'
        f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{pad_t + inner_h}" class="axis"/>'
        f'<text x="{pad_l - 6}" y="{pad_t + 4}" text-anchor="end">{_axis_label(top)}</text>'
        f'<text x="{pad_l - 6}" y="{pad_t + inner_h}" text-anchor="end">0</text>'
        f'<text x="{pad_l}" y="{height - 8}">{escape(labels[0])}</text>'
    )
    if len(labels) > 1:
        axis += f'<text x="{width - pad_r}" y="{height - 8}" text-anchor="end">{escape(labels[-1])}</text>'

    return head + axis + f'<polyline points="{line}" class="line"/>' + dots + "</svg>"


def _axis_label(value: float) -> str:
    """``25,960`` rather than ``2.6e+04``; small values with three significant digits."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"
