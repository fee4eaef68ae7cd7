"""Test set-up on real parts: an Airflow metadata DB on SQLite in a temporary AIRFLOW_HOME, one real
``ray start --head`` cluster on loopback for the whole session (every job attaches to it instead of
paying Ray's start-up), and a fresh stage + registry per test."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from airflow_provider_batchinfer.launchers.embedded.procs import free_ports

# The tier of a test is the folder it lives in; ``slow`` (end-to-end runs and real services, what
# ``make test-fast`` leaves out) and ``services`` follow from it.
TIERS = ("unit", "component", "e2e", "services")
TIER_MARKERS = {"e2e": ("slow",), "services": ("slow", "services")}


def tier_of(item: pytest.Item) -> str:
    """The tier folder under tests/ that holds this test's file."""
    parts = Path(str(item.path)).resolve().relative_to(Path(__file__).resolve().parent).parts
    if len(parts) < 2 or parts[0] not in TIERS:
        raise pytest.UsageError(f"{item.nodeid}: a test file belongs in one of tests/{{{','.join(TIERS)}}}/")
    return parts[0]


@pytest.hookimpl(tryfirst=True)  # the markers are on before `-m` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Unit tests first, then component, then end-to-end runs, then real Airflow services: a broken
    contract or policy shows up in the first minute, not after the long scenarios.

    Under pytest-xdist (``make test``: ``-n 2 --dist loadfile --no-loadscope-reorder``) each test file
    runs whole on one worker, in file order, so a module-scoped fixture (the Airflow services, a
    two-node Ray cluster, a trained model) is built once and the tests that build on one another keep
    their order. Workers take files in the order of this list, and there the services tier (the
    longest, mostly waiting on the scheduler) comes first: one worker runs it while the other goes
    through the unit tests, instead of both ending on it."""
    on_a_worker = hasattr(config, "workerinput")
    order = {tier: i for i, tier in enumerate(TIERS)}
    if on_a_worker:
        order["services"] = -1

    def rank(item: pytest.Item) -> int:
        tier = tier_of(item)
        for name in TIER_MARKERS.get(tier, ()):
            item.add_marker(name)
        return order[tier]

    items.sort(key=rank)  # stable: file order within each tier


REPO = Path(__file__).resolve().parents[1]
_HOME = Path(tempfile.mkdtemp(prefix="batchinfer-airflow-"))
_BUNDLES = [
    {
        "name": "batchinfer_examples",
        "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
        "kwargs": {"path": str(REPO / "example_dags"), "refresh_interval": 0},
    },
    {
        "name": "test_dags",
        "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
        "kwargs": {"path": str(REPO / "tests" / "dags"), "refresh_interval": 0},
    },
]
# Airflow reads its configuration at import, so this runs before any test module imports it.
os.environ.update(
    {
        "AIRFLOW_HOME": str(_HOME),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "example_dags"),
        "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps(_BUNDLES),
        "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "120",
        "BATCHINFER_HOME": str(_HOME / "batchinfer"),
        # keep every Ray socket on 127.0.0.1 and stay offline
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        # the OpenLineage provider emits only where a test turns it on (tests/services/test_airflow_services.py),
        # whatever OPENLINEAGE_* settings the environment has
        "AIRFLOW__OPENLINEAGE__DISABLED": "True",
        "TRANSFORMERS_OFFLINE": "1",
    }
)


class LeftAttachedToRay(UserWarning):
    """A test left this pytest process attached to a Ray cluster as a driver."""


@pytest.fixture(autouse=True)
def _detach_from_ray(request: pytest.FixtureRequest):
    """Detach this process from any Ray a test left it attached to. Such a process is a driver of
    that cluster: when the cluster stops later (an embedded Ray idling out, a module's cluster torn
    down), Ray's core worker exits the whole pytest worker 60 s on ("Failed to connect to GCS
    within 60 seconds"), in whatever test runs then. The warning names the test that did it."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        ray.shutdown()
        import warnings

        warnings.warn(
            f"{request.node.nodeid} left this process attached to a Ray; detached", LeftAttachedToRay, stacklevel=1
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BackgroundServer:
    """A test server in its own process group: started, waited for on its ports, and stopped by
    group, so whatever else runs on the machine (another Ray, another moto) is left alone."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        ports: list[int],
        env: dict[str, str] | None = None,
        timeout: float = 120,
        host: str = "127.0.0.1",
        needs: tuple[BackgroundServer, ...] = (),
        ready_line: str | None = None,
    ) -> None:
        """``needs``: servers this one cannot come up without (a worker node's head); when one of them
        exits, waiting stops at once instead of at ``timeout``. ``ready_line``: a line its log prints
        once it is up, waited for after the ports: an open port alone may be another process's (the
        other pytest worker picks free ports at the same moment), not this server's."""
        self.name = name
        self.log_path = _HOME / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env or os.environ, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        for port in ports:
            while True:
                with socket.socket() as s:
                    if s.connect_ex((host, port)) == 0:
                        break
                gone = [n.name for n in needs if n.proc.poll() is not None]
                if self.proc.poll() is not None or gone or time.monotonic() > deadline:
                    tail = self.log_tail()
                    self.stop()
                    why = f", and what it needs has exited: {gone}" if gone else ""
                    raise RuntimeError(f"{name} did not come up (exit {self.proc.poll()}{why}):\n{tail}")
                time.sleep(0.3)
        while ready_line is not None and ready_line not in self.log_tail(chars=1 << 20):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"{name} did not come up (exit {self.proc.poll()}, no {ready_line!r}):\n{tail}")
            time.sleep(0.3)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to the group; SIGKILL to it if its leader has not exited after ``timeout`` s."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()


@pytest.fixture(scope="session")
def airflow_db():
    """A migrated SQLite metadata DB (``airflow db migrate``, once per session)."""
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True, env=os.environ)
    yield _HOME
    shutil.rmtree(_HOME, ignore_errors=True)


def ensure_ray_auth_token(env: dict[str, str]) -> None:
    """``~/.ray/auth_token`` for token auth (``ray start`` fails on a fresh machine without one),
    created under a lock: pytest-xdist's workers each start their own cluster, and two of them
    generating at once would each write a token and one cluster would refuse the other's clients."""
    import fcntl

    ray_bin = str(Path(sys.executable).parent / "ray")
    lock_path = Path.home() / ".ray" / ".auth_token.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        token = Path.home() / ".ray" / "auth_token"
        if token.is_file() and token.read_text().strip():  # made already: a Ray CLI start costs ~2 CPU-s
            return
        subprocess.run([ray_bin, "get-auth-token", "--generate"], check=True, capture_output=True, env=env)


# A `ray start --block` node given SIGTERM takes ~30 s to exit (its GCS server lingers), then is gone
# all the same. Its tests are over and its temp dir is removed next: a short grace, then SIGKILL.
_RAY_STOP_GRACE = 5


def _ray_head(ray_bin: str, env: dict[str, str]) -> tuple[BackgroundServer, int, int, str]:
    """``ray start --head --block`` on fresh ports in its own temp dir: (server, GCS port, dashboard
    port, temp dir); RuntimeError when it did not come up (its temp dir removed)."""
    # distinct ports, all held until picked: one at a time the kernel may hand out one twice, and Ray
    # then refuses to start ("is trying to use a port number ... used by other components")
    port, dashboard_port, *more = free_ports(9)
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths live below it
    try:
        head = BackgroundServer(
            "ray-head",
            [
                ray_bin,
                "start",
                "--head",
                "--block",
                f"--port={port}",
                "--num-cpus=2",
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={dashboard_port}",
                "--disable-usage-stats",
                # every fixed default port picked anew: another Ray on the machine (a developer's, a stale
                # one) holding 52365 leaves the Jobs API without an agent ("No available agent")
                f"--ray-client-server-port={more[0]}",
                f"--dashboard-agent-listen-port={more[1]}",
                f"--dashboard-agent-grpc-port={more[2]}",
                f"--metrics-export-port={more[3]}",
                f"--runtime-env-agent-port={more[4]}",
                f"--node-manager-port={more[5]}",
                f"--object-manager-port={more[6]}",
                # its own temp dir: the Jobs API points each driver at the cluster recorded in
                # <temp dir>/ray_current_cluster, and in the shared /tmp/ray another Ray started later on
                # the machine overwrites that record (the driver then waits on the other GCS forever)
                f"--temp-dir={temp_dir}",
            ],
            ports=[port, dashboard_port],
            env=env,
            ready_line="Ray runtime started",
        )
    except RuntimeError:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return head, port, dashboard_port, temp_dir


@pytest.fixture(scope="session")
def ray_cluster():
    """One real local Ray cluster (``ray start --head --block``, dashboard and Jobs API on 127.0.0.1)
    for the session; ray_jobs submit to it, and local-launcher jobs of a test that uses it attach to
    it through RAY_ADDRESS (``_ray_address``)."""
    ray_bin = str(Path(sys.executable).parent / "ray")
    env = dict(os.environ, RAY_AUTH_MODE="token")
    # token auth needs ~/.ray/auth_token, which a fresh machine does not have (`ray start` then fails)
    ensure_ray_auth_token(env)
    for attempt in range(3):  # a port taken between picking it and Ray binding it: new ports, again
        try:
            head, port, dashboard_port, temp_dir = _ray_head(ray_bin, env)
            break
        except RuntimeError:
            if attempt == 2:
                raise
    os.environ["RAY_AUTH_MODE"] = "token"
    yield {
        "address": f"127.0.0.1:{port}",
        "dashboard": f"http://127.0.0.1:{dashboard_port}",
        "token": (Path.home() / ".ray" / "auth_token").read_text().strip(),
    }
    head.stop(timeout=_RAY_STOP_GRACE)
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def _ray_address(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """RAY_ADDRESS names the session's cluster exactly for the tests that use ``ray_cluster`` (directly
    or through a fixture), and is absent for every other test: those run on the embedded default,
    where a one-replica CPU job is scored in the runtime's own process, as it is for a user without
    a cluster. No test's path depends on which test file ran before it on the same worker."""
    if "ray_cluster" in request.fixturenames:
        monkeypatch.setenv("RAY_ADDRESS", request.getfixturevalue("ray_cluster")["address"])
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.fixture
def batchinfer_home(tmp_path, monkeypatch):
    """A fresh embedded default (stage + registry) for one test."""
    home = tmp_path / "batchinfer"
    monkeypatch.setenv("BATCHINFER_HOME", str(home))
    return home


@pytest.fixture
def registry(batchinfer_home):
    from airflow_provider_batchinfer.registry import ModelRegistry

    return ModelRegistry(str(batchinfer_home / "registry"))


@pytest.fixture
def text_length_model(registry):
    from tests.models import TextLength

    return registry.log_model(
        "text_length",
        "v1",
        "python",
        python_class=TextLength,
        signature={"inputs": {"text": "string"}, "outputs": {"length": "int64"}},
    )


@pytest.fixture
def tickets(tmp_path):
    """500 tickets in 4 Parquet files; returns (directory, rows)."""
    from tests.models import write_tickets

    return write_tickets(tmp_path / "input", rows=500, files=4), 500


def run_dag(dag_id: str, **conf):
    """Run a DAG from the test bundles with ``dag.test()`` and return (state, {task_id: state})."""
    from airflow.dag_processing.dagbag import DagBag

    folder = REPO / "tests" / "dags" if dag_id.startswith("bi_test_") else REPO / "example_dags"
    # parsed for each run: dag.test() leaves a run's conf in the DAG object's params, which a cached
    # DAG would hand the next run of that DAG
    bag = DagBag(dag_folder=str(folder))
    assert not bag.import_errors, bag.import_errors
    dag = bag.get_dag(dag_id)
    dr = dag.test(run_conf=conf or None)
    return dr.state, task_states(dag_id, dr.run_id), dr.run_id


def task_states(dag_id: str, run_id: str) -> dict[str, str]:
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(
            select(TaskInstance.task_id, TaskInstance.state, TaskInstance.try_number).where(
                TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id
            )
        ).all()
    return {task_id: (str(state.value if hasattr(state, "value") else state), tries) for task_id, state, tries in rows}


def xcom_value(dag_id: str, run_id: str, task_id: str, key: str = "return_value"):
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        row = session.scalars(
            select(XComModel).where(
                XComModel.dag_id == dag_id,
                XComModel.run_id == run_id,
                XComModel.task_id == task_id,
                XComModel.key == key,
            )
        ).first()
        return None if row is None else XComModel.deserialize_value(row)


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 HTTP server (``moto_server``) on 127.0.0.1 as a separate process for the session;
    yields its endpoint URL. Runs in its own process group, and only that group is stopped."""
    port = _free_port()
    moto_bin = str(Path(sys.executable).parent / "moto_server")
    server = BackgroundServer("moto-server", [moto_bin, "-H", "127.0.0.1", "-p", str(port)], ports=[port], timeout=60)
    yield f"http://127.0.0.1:{port}"
    server.stop(timeout=30)


@pytest.fixture
def s3_bucket(s3_server, monkeypatch):
    """A fresh bucket on the S3 server; the AWS SDK is kept off the network (no instance metadata)."""
    import uuid

    import boto3

    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    name = f"bi-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3",
        endpoint_url=s3_server,
        region_name="us-east-1",
        aws_access_key_id="AKIDTEST",
        aws_secret_access_key="unused",
    ).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def iam_s3():
    """moto_server with IAM auth on: user ``airflow`` may only assume ``batch``; only ``batch`` may use
    S3. Yields (endpoint, bucket, the user's key id, its secret, the role's ARN). One per session: a
    process that assumed the role keeps its provider's endpoint, which a second server would not be."""
    import boto3

    port = _free_port()
    setup_actions = 6  # everything below until create_bucket runs unauthenticated, then auth is enforced
    server = BackgroundServer(
        "moto-iam",
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        ports=[port],
        timeout=60,
        env=dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(setup_actions)),
    )
    endpoint = f"http://127.0.0.1:{port}"
    admin = {"endpoint_url": endpoint, "region_name": "us-east-1", "aws_access_key_id": "AKIDADMIN"}
    admin["aws_secret_access_key"] = "setup"
    try:
        iam = boto3.client("iam", **admin)
        iam.create_user(UserName="airflow")
        key = iam.create_access_key(UserName="airflow")["AccessKey"]
        allow = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole", "Resource": "*"}],
        }
        iam.put_user_policy(UserName="airflow", PolicyName="assume-only", PolicyDocument=json.dumps(allow))
        trust = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}],
        }
        role = iam.create_role(RoleName="batch", AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
        s3_all = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_role_policy(RoleName="batch", PolicyName="s3", PolicyDocument=json.dumps(s3_all))
        boto3.client("s3", **admin).create_bucket(Bucket="lake")
        yield endpoint, "lake", key["AccessKeyId"], key["SecretAccessKey"], role
    finally:
        server.stop(timeout=30)


# --- pool: a real 2-node Ray cluster on this machine ---------------------------------------
# A head and a worker node joined with ``ray start --address``, each with its own temp dir and its own
# node-local model cache (``BATCHINFER_MODEL_CACHE`` in that node's environment); the worker declares
# one GPU that this CPU-only machine does not have (for the "GPU without CUDA" test). Module-scoped:
# only tests/services/test_multinode.py pays for it.
#
# Each node has its own loopback address. Ray turns "127.0.0.1" into the machine's own network address
# on a multi-node cluster (``resolve_ip_for_localhost``), and then the nodes talk over that address: on
# CI the worker once timed out registering there. Any other 127.x address is kept as given, so the two
# nodes are two distinct hosts that only ever talk over loopback.
HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"

_NODE_READY = """
import sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    nodes = [n for n in ray.nodes() if n["Alive"]]
    if len(nodes) == int(sys.argv[2]):
        for n in nodes:
            print(n["NodeID"], n["NodeManagerPort"], n["Resources"].get("GPU", 0), flush=True)
        break
    time.sleep(0.5)
else:
    sys.exit(f"only {len(nodes)} node(s) joined")
"""


def _ray_node(
    name: str,
    node_ip: str,
    args: list[str],
    temp_dir: str,
    cache: Path,
    manager_port: int,
    wait_ports: list[int],
    needs: tuple[BackgroundServer, ...] = (),
) -> BackgroundServer:
    """One ``ray start --block`` node on ``node_ip`` with every port chosen here (distinct, all held until
    picked), waited for on ``wait_ports`` (its node manager's, and the head's GCS port for the head)."""
    ray_bin = str(Path(sys.executable).parent / "ray")
    # the session sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (one node for every other test), which
    # makes `ray start --address` refuse to join on any platform: these nodes are a cluster on purpose
    env = dict(
        os.environ, RAY_AUTH_MODE="token", BATCHINFER_MODEL_CACHE=str(cache), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1"
    )
    env.pop("RAY_ADDRESS", None)
    object_manager, agent, agent_grpc, metrics, runtime_env = free_ports(5)
    cmd = [
        ray_bin,
        "start",
        "--block",
        *args,
        "--num-cpus=2",
        "--disable-usage-stats",
        f"--node-ip-address={node_ip}",
        f"--node-manager-port={manager_port}",
        f"--object-manager-port={object_manager}",
        f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--temp-dir={temp_dir}",
    ]
    return BackgroundServer(name, cmd, ports=wait_ports, env=env, host=node_ip, needs=needs)


def _start_two_nodes(root: Path, env: dict[str, str], temps: list[str]) -> tuple[list[BackgroundServer], dict]:
    """Head, then worker, then both seen alive by a driver; on any failure every node started here is
    stopped and the error names what the head was doing (a worker that cannot reach the head's GCS
    usually means the head itself went down: its log says why)."""
    port, client_port, head_manager, worker_manager = free_ports(4)
    caches = {head_manager: root / "cache-head", worker_manager: root / "cache-worker"}
    head_args = ["--head", f"--port={port}", "--include-dashboard=false", f"--ray-client-server-port={client_port}"]
    address = f"{HEAD_IP}:{port}"
    servers: list[BackgroundServer] = []
    try:
        head = _ray_node(
            "ray-2node-head", HEAD_IP, head_args, temps[0], caches[head_manager], head_manager, [head_manager, port]
        )
        servers.append(head)
        worker_args = [f"--address={address}", "--num-gpus=1"]
        try:
            servers.append(
                _ray_node(
                    "ray-2node-worker",
                    WORKER_IP,
                    worker_args,
                    temps[1],
                    caches[worker_manager],
                    worker_manager,
                    [worker_manager],
                    needs=(head,),
                )
            )
        except RuntimeError as exc:
            state = "running" if head.proc.poll() is None else f"exited {head.proc.poll()}"
            raise RuntimeError(f"{exc}\n--- the head ({state}), last lines of its log:\n{head.log_tail()}") from None
        out = subprocess.run(
            [sys.executable, "-c", _NODE_READY, address, "2"], capture_output=True, text=True, env=env, timeout=180
        )
        if out.returncode != 0:
            raise RuntimeError(f"the two nodes were not both seen alive:\n{out.stdout}{out.stderr[-3000:]}")
    except BaseException:
        for server in reversed(servers):
            server.stop(timeout=_RAY_STOP_GRACE)
        raise
    nodes = {}
    for line in out.stdout.split("\n"):
        if line.strip():
            node_id, manager, gpus = line.split()
            nodes[node_id] = {"cache": caches[int(manager)], "gpus": float(gpus)}
    return servers, {"address": address, "nodes": nodes}


_CLUSTER_STARTS = 3


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory):
    """``{"address", "nodes": {node_id: {"cache": Path, "gpus": float}}}``; the caches start empty.

    The whole cluster is started up to three times, each time with fresh ports, temp dirs and caches:
    on a loaded 2-core machine (CI, with the other pytest worker's Ray beside it) a worker raylet can
    miss Ray's own registration deadline, and once CI's head went down before its worker could
    reach the GCS; retrying only the worker against that head could never succeed."""
    env = dict(os.environ, RAY_AUTH_MODE="token")
    ensure_ray_auth_token(env)
    errors: list[str] = []
    for attempt in range(1, _CLUSTER_STARTS + 1):
        root = tmp_path_factory.mktemp(f"two-node-{attempt}")
        temps = [tempfile.mkdtemp(prefix="rayh-", dir="/tmp"), tempfile.mkdtemp(prefix="rayw-", dir="/tmp")]
        try:
            servers, cluster = _start_two_nodes(root, env, temps)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            errors.append(f"start {attempt}: {exc}")
            for temp in temps:
                shutil.rmtree(temp, ignore_errors=True)
            continue
        try:
            yield cluster
        finally:
            for server in reversed(servers):
                server.stop(timeout=_RAY_STOP_GRACE)
            for temp in temps:
                shutil.rmtree(temp, ignore_errors=True)
        return
    raise RuntimeError(f"no 2-node Ray cluster in {_CLUSTER_STARTS} starts:\n" + "\n\n".join(errors))


# --- warmray: the embedded default's warm Ray (launchers/embedded/embedded_ray.py) ------------------------------
# Jobs with no Ray address (tests that remove RAY_ADDRESS) share one embedded Ray; this session gets its
# own state directory (short: under /tmp), so it never reuses or stops a developer's embedded Ray, and
# that Ray is stopped (by its process group, never `ray stop`) when the session ends.
_EMBEDDED_RAY_DIR = Path(tempfile.mkdtemp(prefix="bir-s-", dir="/tmp"))
os.environ["BATCHINFER_RAY_DIR"] = str(_EMBEDDED_RAY_DIR)


@pytest.fixture(scope="session", autouse=True)
def _stop_the_sessions_embedded_ray():
    yield
    from airflow_provider_batchinfer.launchers.embedded.embedded_ray import shutdown

    shutdown(_EMBEDDED_RAY_DIR)
    shutil.rmtree(_EMBEDDED_RAY_DIR, ignore_errors=True)


# --- end warmray ------------------------------------------------------------------------------------------
