"""CPU-seconds a benchmarked job used, and where: its own process tree and the embedded Ray's.

Wall time on a shared two-core machine moves with whatever else runs; the CPU a job's processes
spent moves far less, so the pool's jobs are reported both ways. A job's CPU is

- its harness process tree (the Airflow task, the runtime process it launches): the harness
  process's reaped children (``RUSAGE_CHILDREN``) once it has exited, and
- the embedded Ray's processes (``ray start --head`` and what descends from it: GCS, raylet, agents,
  the raylet's workers), sampled once a second by :class:`TreeSampler`: the raylet reaps its
  workers without accounting for them, so a worker's CPU is its last sample (up to a second short
  for a worker that exits), less what the process had spent before the job.

The sampler keeps each process's CPU under its title (a Ray worker calls itself ``ray::<actor or
task>``), so the report says which component spent what.
"""

from __future__ import annotations

import json
import os
import re
import resource
from pathlib import Path
from typing import Any

_WORKER = re.compile(r"^(ray::[A-Za-z_][\w.]*)")


def children_cpu_s() -> float:
    """CPU-seconds of this process's reaped children, their own reaped children included."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _head_pid(ray_dir: str | None) -> int | None:
    try:
        state = json.loads((Path(str(ray_dir)) / "state.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    return int(state.get("head_pid") or 0) or None


def _tree(pid: int | None) -> list[Any]:
    """``pid`` and its descendants (none when it is gone)."""
    import psutil

    if not pid:
        return []
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def component(args: list[str]) -> str:
    """A process's component: ``ray::<name>`` for a Ray worker, a Python program's module or script,
    else the program's name."""
    title = " ".join(args)
    found = _WORKER.match(title)
    if found:
        return found.group(1)
    if not args:
        return "?"
    program = os.path.basename(args[0])
    if program.startswith("python"):
        rest = [a for a in args[1:] if a not in ("-u", "-B", "-E", "-s", "-I")]
        if rest[:1] == ["-m"] and len(rest) > 1:
            return rest[1]
        if rest:
            return os.path.basename(rest[0])
    return program


class TreeSampler:
    """The CPU (own time) and component of each process in the job's tree and the embedded Ray's,
    by pid, as last sampled; :meth:`by_component` and :meth:`ray_cpu_s` sum them."""

    def __init__(self, ray_dir: str | None) -> None:
        self.ray_dir = ray_dir
        self.seen: dict[int, tuple[str, float, bool]] = {}  # pid -> (component, CPU-s in the job, in Ray's tree)
        self.before: dict[int, float] = {}  # what Ray's processes that were up before the job had spent

    def start(self) -> None:
        for p in _tree(_head_pid(self.ray_dir)):
            try:
                t = p.cpu_times()
                self.before[p.pid] = t.user + t.system
            except Exception:
                continue

    def sample(self, root_pid: int | None) -> None:
        ray = _tree(_head_pid(self.ray_dir))
        ray_pids = {p.pid for p in ray}
        for p in [*ray, *_tree(root_pid)]:
            if p.pid in self.seen and p.pid not in ray_pids and self.seen[p.pid][2]:
                continue  # sampled as Ray's already
            try:
                t = p.cpu_times()
                name = component(p.cmdline()) or p.name()
            except Exception:
                continue
            if name == "ray::IDLE" and p.pid in self.seen:  # a worker between tasks keeps its last task's name
                name = self.seen[p.pid][0]
            self.seen[p.pid] = (name, t.user + t.system - self.before.get(p.pid, 0.0), p.pid in ray_pids)

    def ray_cpu_s(self) -> float:
        return sum(cpu for _, cpu, ray in self.seen.values() if ray)

    def by_component(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, cpu, _ in self.seen.values():
            out[name] = out.get(name, 0.0) + cpu
        return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v >= 0.05}
