"""What a job prints holds no credential, whole or in part: the runtime scrubs every line it writes
(``print``, partial writes split by flushes, its last line) before anything cuts it, and the local
launcher scrubs every line it relays (what native code or a child process writes to the same pipe,
and a last line cut off mid-secret). One runtime process (scored in the driver, no Ray) and one
small child process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from airflow_provider_batchinfer.contract import SUCCESS_MARKER, JobFailure, parse_runtime_line
from airflow_provider_batchinfer.contract.lines import EMBEDDED_RAY_ENV
from airflow_provider_batchinfer.launchers.base import FAILED, JobHandle
from airflow_provider_batchinfer.launchers.local import LocalLauncher
from tests.conftest import REPO
from tests.models import job_file, write_job_file, write_tickets

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKEY"
MASK = "***"

# a model that prints the credential its process holds, in pieces, then fails with an error whose
# 2,000-character cut (a dead-letter message's limit) falls 10 characters into it
LEAKY = textwrap.dedent(
    """
    import os, sys

    class Leaky:
        @classmethod
        def load(cls, path):
            return cls()

        def predict(self, batch):
            secret = os.environ["AWS_SECRET_ACCESS_KEY"]
            print("whole", secret, flush=True)
            sys.stdout.write("halves " + secret[:9])
            sys.stdout.flush()
            sys.stdout.write(secret[9:] + " end\\n")
            sys.stderr.write("stderr " + secret + "\\n")
            raise ValueError("y" * (2000 - len("ValueError: ") - 10) + secret)
    """
)


def _pieces(secret: str, text: str, shortest: int = 4) -> list[str]:
    """Every piece of ``secret`` of ``shortest`` characters or more found in ``text``."""
    return [
        secret[start : start + size]
        for size in range(shortest, len(secret) + 1)
        for start in range(len(secret) - size + 1)
        if secret[start : start + size] in text
    ]


def test_the_runtime_scrubs_everything_it_prints_before_any_cut(tmp_path, registry):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "leaky.py").write_text(LEAKY)
    model = registry.log_model(
        "leaky",
        "v1",
        "python",
        python_class="leaky:Leaky",
        code_paths=[str(tmp_path / "code" / "leaky.py")],
        signature={"inputs": {"text": "string"}, "outputs": {"length": "int64"}},
    )
    run_dir = tmp_path / "out"
    run_dir.mkdir()
    job = job_file(run_dir, model, registry.root, [write_tickets(tmp_path / "in", rows=5, files=1)])
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(AWS_SECRET_ACCESS_KEY=SECRET, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env[EMBEDDED_RAY_ENV] = "1"  # the embedded default's machine: scored in this process, no Ray
    done = subprocess.run(
        [sys.executable, "-m", "airflow_provider_batchinfer.runtime", "--spec", write_job_file(job)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0 and not (run_dir / SUCCESS_MARKER).exists(), out[-3000:]
    assert f"whole {MASK}\n" in done.stdout and f"halves {MASK} end\n" in done.stdout, out[-3000:]
    assert f"stderr {MASK}\n" in done.stderr, out[-3000:]
    failure = parse_runtime_line(done.stdout.strip().splitlines()[-1])
    assert isinstance(failure, JobFailure) and failure.error.startswith("ValueError: yyy"), out[-3000:]
    assert f"yyy{MASK}" in failure.error  # the cut fell inside the secret: masked, not half shown
    assert _pieces(SECRET, out) == []


def test_the_local_launcher_scrubs_what_reaches_its_pipe_around_python(tmp_path):
    """A child that writes to the pipe's descriptor itself (as native code or a subprocess would)
    and ends mid-secret: the task log gets neither the secret nor its first half."""
    launcher = LocalLauncher(ray_address="local")
    launcher.extra_env = {"AWS_SECRET_ACCESS_KEY": SECRET}
    env = launcher.environment()
    launcher._secrets = [env["AWS_SECRET_ACCESS_KEY"]]  # as start() takes them from the job's environment
    child = f"import os; os.write(1, b'native {SECRET}\\n'); os.write(1, b'cut {SECRET[:20]}'); os._exit(3)"
    launcher._spawn([sys.executable, "-c", child], env)
    logged: list[str] = []
    outcome = launcher.wait(JobHandle(job_id="leaky", attempt="t01"), logged.append)
    assert logged == [f"native {MASK}", f"cut {MASK}"]
    assert outcome.status == FAILED and f"cut {MASK}" in outcome.message
    assert _pieces(SECRET, "\n".join(logged) + outcome.message) == []
