"""A real multi-node Slurm on this one machine: one slurmctld and N ``slurmd -N nodeI``.

Follows reference/slurm-local.md: everything lives under one private directory, nothing under /etc
is written, no munged. Where the kernel allows it, each slurmd runs in its own UTS and mount
namespace with ``hostname nodeI`` and an /etc/hosts that maps node1..nodeN to 127.0.0.1, so
``hostname`` and name lookups inside a job see the node's own name, as on a real cluster.

Every client command runs with a timeout: while slurmctld is down they hang for seconds.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import psutil
import yaml

from agent.job.atomicfile import write_atomic
from tests.infra.ports import free_ports

KILL_WAIT_S = 5
CPUS_PER_NODE = 4
MEMORY_MB = 2000
PARTITION = "debug"
START_TIMEOUT_S = 30.0
CLIENT_TIMEOUT_S = 30.0
# Job states after which a job does nothing more (scontrol's spelling).
ENDED_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
    }
)
REQUIRED_BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "sinfo")


class SlurmError(RuntimeError):
    """The local Slurm did not start or a client command failed; the message holds log tails."""


def missing_binaries() -> list[str]:
    """The Slurm programs this harness needs that are not on PATH (empty when all are)."""
    return [name for name in REQUIRED_BINARIES if _which(name) is None]


def _which(name: str) -> str | None:
    # The daemons live in /usr/sbin, which a non-login root shell may not have on PATH.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


def can_isolate_hostnames() -> bool:
    """Whether ``unshare --uts --mount`` works here (root with CAP_SYS_ADMIN)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(
            ["unshare", "--uts", "--mount", "--", "hostname", "tilert-probe"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


# Inside the new namespaces: name the node, give it an /etc/hosts that knows every node, then
# become slurmd (exec keeps the pid, so the pidfile and our Popen name the same process).
_ISOLATE_SCRIPT = 'n=$1; h=$2; shift 2; hostname "$n" && mount --bind "$h" /etc/hosts && exec "$@"'


class LocalSlurm:
    """One slurmctld and ``nodes`` slurmd daemons on 127.0.0.1; a context manager."""

    def __init__(
        self,
        nodes: int = 3,
        root: Path | None = None,
        *,
        isolate_hostnames: bool | None = None,
        kill_wait_s: int = KILL_WAIT_S,
    ) -> None:
        if nodes < 1:
            raise ValueError("nodes must be >= 1")
        self.root = (
            Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="tilert-slurm-"))
        )
        self.node_names = [f"node{i}" for i in range(1, nodes + 1)]
        self.kill_wait_s = kill_wait_s
        self._isolate = isolate_hostnames
        self.hostnames_isolated = False
        self.conf = self.root / "slurm.conf"
        self.log_dir = self.root / "log"
        self.run_dir = self.root / "run"
        self.jobs_dir = self.root / "jobs"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._scripts = 0
        self._started = False

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> LocalSlurm:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> LocalSlurm:
        """Write the config, start the daemons, and wait until every node is idle."""
        missing = missing_binaries()
        if missing:
            raise SlurmError(
                f"Slurm programs not found: {', '.join(missing)}; install the Debian packages "
                "slurmctld slurmd slurm-client (tests/run.sh does)"
            )
        if os.geteuid() != 0:
            raise SlurmError("the local Slurm runs slurmd as root (SlurmdUser=root); run as root")
        if self._isolate is None:
            self._isolate = can_isolate_hostnames()
        self.hostnames_isolated = self._isolate
        for sub in ("state", "spool", "run", "log", "jobs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for name in self.node_names:
            (self.root / "spool" / name).mkdir(exist_ok=True)
        ports = free_ports(1 + len(self.node_names))
        self.ctld_port = ports[0]
        self.node_ports = dict(zip(self.node_names, ports[1:], strict=True))
        self.conf.write_text(self.config_text())
        hosts = self.root / "hosts"
        hosts.write_text(self.hosts_text())

        self._started = True
        atexit.register(self.stop)
        try:
            self._spawn("slurmctld", [_req("slurmctld"), "-D", "-f", str(self.conf)])
            for name in self.node_names:
                argv = [_req("slurmd"), "-D", "-f", str(self.conf), "-N", name]
                if self._isolate:
                    argv = [
                        "unshare", "--uts", "--mount", "--",
                        "sh", "-c", _ISOLATE_SCRIPT, "sh", name, str(hosts), *argv,
                    ]  # fmt: skip
                self._spawn(f"slurmd-{name}", argv)
            self._wait_idle(START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel every job, then end the daemons (SIGTERM, then SIGKILL) and their leftovers."""
        if not self._started:
            return
        self._started = False
        atexit.unregister(self.stop)
        ctld = self._procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            self._cancel_all_jobs()
        steps = self._our_stepds()
        pids = self._daemon_pids()
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        _wait_gone(pids, 10.0)
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        # A slurmstepd is re-parented away from slurmd and lingers a moment after its step;
        # give it that moment, then it and its tasks go.
        steps += [p for p in self._our_stepds() if p not in steps]
        _, alive = psutil.wait_procs(steps, timeout=3.0)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                for child in proc.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        child.kill()
                proc.kill()
        for daemon in self._procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.wait(timeout=5)

    def _spawn(self, name: str, argv: list[str]) -> None:
        # The child keeps its own copy of the descriptor.
        with open(self.log_dir / f"{name}.stderr", "wb") as out:
            self._procs[name] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.root,
                start_new_session=True,
            )

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise SlurmError(
                        f"{name} exited with {proc.returncode} while starting\n{self.log_tail()}"
                    )
            with contextlib.suppress(SlurmError, subprocess.TimeoutExpired):
                states = self.node_states(timeout=5)
                if set(states) == set(self.node_names) and all(
                    s == "idle" for s in states.values()
                ):
                    return
            time.sleep(0.1)
        raise SlurmError(
            f"nodes not idle within {timeout:.0f} s (last sinfo: {states or 'no answer'})\n"
            f"{self.log_tail()}"
        )

    def _daemon_pids(self) -> list[int]:
        pids = {p.pid for p in self._procs.values() if p.poll() is None}
        for pidfile in self.run_dir.glob("*.pid"):
            with contextlib.suppress(ValueError, OSError, psutil.Error):
                pid = int(pidfile.read_text().strip())
                # A stale pidfile may name a reused pid: only a slurm daemon is ours to signal.
                if psutil.Process(pid).name().startswith("slurm"):
                    pids.add(pid)
        return sorted(pids)

    def _our_stepds(self) -> list[psutil.Process]:
        """slurmstepd processes of this cluster: they run in our directory (slurmd's cwd)."""
        root = str(self.root)
        found = []
        for proc in psutil.process_iter(["name"]):
            if proc.info["name"] != "slurmstepd":
                continue
            with contextlib.suppress(psutil.Error):
                cwd = proc.cwd()
                if cwd == root or cwd.startswith(root + "/"):
                    found.append(proc)
        return found

    def _cancel_all_jobs(self) -> None:
        with contextlib.suppress(SlurmError, subprocess.TimeoutExpired):
            jobs = [j["id"] for j in self.squeue()]
            if jobs:
                self.scancel(*jobs)
            deadline = time.monotonic() + self.kill_wait_s + 5
            while time.monotonic() < deadline and self.squeue():
                time.sleep(0.2)

    # -- configuration -----------------------------------------------------------------------

    def config_text(self) -> str:
        """slurm.conf for this cluster (reference/slurm-local.md)."""
        d = self.root
        lines = [
            "ClusterName=local",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/none",
            "CredType=cred/none",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/run/slurmctld.pid",
            f"SlurmdPidFile={d}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={d}/log/jobcomp.txt",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            # batch_sched_delay=0: batch jobs start in under a second (else 2-3 s);
            # bf_interval=1: heterogeneous jobs start in about 1 s (else about 20 s).
            "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,bf_interval=1",
            f"KillWait={self.kill_wait_s}",
            "InactiveLimit=0",
            # Ended jobs stay visible to scontrol for 10 minutes, so tests can read their state.
            "MinJobAge=600",
        ]
        # One NodeName line per node: each slurmd has its own port, and they need not be adjacent.
        for name, port in self.node_ports.items():
            lines.append(
                f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
                f"CPUs={CPUS_PER_NODE} RealMemory={MEMORY_MB} State=UNKNOWN"
            )
        lines.append(f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def hosts_text(self) -> str:
        """/etc/hosts as seen inside each node: this host's file plus every node on 127.0.0.1."""
        try:
            base = Path("/etc/hosts").read_text()
        except OSError:
            base = "127.0.0.1 localhost\n"
        return base.rstrip("\n") + "\n127.0.0.1 " + " ".join(self.node_names) + "\n"

    @property
    def env(self) -> dict[str, str]:
        """Environment for client commands: this cluster's SLURM_CONF, no inherited SLURM_*."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = env.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"
        return env

    def write_cluster_file(self, path: Path) -> Path:
        """A tilert cluster file for this Slurm: loopback, process launcher, our KillWait."""
        # No gpus_per_node: these nodes have none, and the key means "GPUs to request".
        data = {
            "default_partition": PARTITION,
            "network_interface": "lo",
            "launcher": "process",
            "kill_wait_s": self.kill_wait_s,
            "exclusive": False,
            "agent_command": [str(Path(sys.executable).parent / "tilert-agent")],
        }
        path = Path(path)
        write_atomic(path, yaml.safe_dump(data, sort_keys=False).encode())
        return path

    # -- client commands ---------------------------------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = CLIENT_TIMEOUT_S,
        check: bool = True,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster, bounded by ``timeout``."""
        full_env = self.env | dict(env or {})
        try:
            done = subprocess.run(
                list(argv),
                capture_output=True,
                text=True,
                timeout=timeout,
                env=full_env,
                cwd=cwd or self.jobs_dir,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(f"{' '.join(argv)} did not finish within {timeout} s") from exc
        if check and done.returncode != 0:
            raise SlurmError(
                f"{' '.join(argv)} exited {done.returncode}\nstdout: {done.stdout}\n"
                f"stderr: {done.stderr}"
            )
        return done

    def sbatch(
        self,
        script: str | Path,
        *args: str,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str:
        """Submit a batch script (its text, or a path) and return the job id."""
        if isinstance(script, str):
            self._scripts += 1
            path = self.jobs_dir / f"script-{self._scripts}.sh"
            path.write_text(script)
            path.chmod(0o755)
        else:
            path = script
        done = self.run(["sbatch", "--parsable", *args, str(path)], cwd=cwd, env=env)
        return done.stdout.strip().split(";")[0]

    def srun(
        self, *args: str, timeout: float = 60.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """``srun ARGS`` on this cluster, bounded by ``timeout``."""
        return self.run(["srun", *args], timeout=timeout, check=check)

    def scancel(self, *args: str) -> None:
        """``scancel ARGS`` (job ids and flags such as ``--signal=TERM --full``)."""
        self.run(["scancel", *args])

    def squeue(self, job: str | None = None) -> list[dict[str, str]]:
        """Jobs not yet ended (pending, running, completing): id, state, name, nodes."""
        argv = ["squeue", "-h", "-o", "%i|%T|%j|%N"]
        if job is not None:
            argv += ["-j", job]
        done = self.run(argv, check=job is None)
        rows = []
        for line in done.stdout.splitlines():
            if line.strip():
                ident, state, name, nodes = line.split("|", 3)
                rows.append({"id": ident, "state": state, "name": name, "nodes": nodes})
        return rows

    def job_info(self, job: str) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (empty when slurmctld does not know the job)."""
        done = self.run(["scontrol", "show", "job", "-o", job], check=False)
        info: dict[str, str] = {}
        for field in done.stdout.split():
            key, sep, value = field.partition("=")
            if sep:
                info.setdefault(key, value)
        return info

    def job_state(self, job: str) -> str | None:
        """The job's state (``RUNNING``, ``COMPLETED``, ...), or None when it is unknown."""
        return self.job_info(job).get("JobState")

    def wait_job_state(self, job: str, states: Iterable[str], timeout: float = 30.0) -> str:
        """Wait until the job is in one of ``states`` (or has ended); return its state."""
        wanted = set(states)
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state in wanted or state in ENDED_STATES:
                return state
            time.sleep(0.1)
        raise TimeoutError(
            f"job {job} not in {sorted(wanted)} within {timeout} s (state {state})\n"
            f"{self.log_tail()}"
        )

    def wait_job_end(self, job: str, timeout: float = 60.0) -> str:
        """Wait until the job has ended; return its final state (``COMPLETED``, ...)."""
        return self.wait_job_state(job, ENDED_STATES, timeout)

    def node_states(self, timeout: float = CLIENT_TIMEOUT_S) -> dict[str, str]:
        """Each node's state as sinfo reports it (``idle``, ``allocated``, ...)."""
        done = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=timeout)
        states = {}
        for line in done.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of every daemon log (for error messages)."""
        out = []
        for log in sorted(self.log_dir.glob("*")):
            if log.is_file():
                text = log.read_text(errors="replace").splitlines()[-lines:]
                if text:
                    out.append(f"--- {log} ---\n" + "\n".join(text))
        return "\n".join(out) or "(no daemon logs)"


def _req(name: str) -> str:
    path = _which(name)
    if path is None:
        raise SlurmError(f"{name} not found; install Debian's slurmctld/slurmd packages")
    return path


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _wait_gone(pids: Iterable[int], timeout: float) -> None:
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    psutil.wait_procs(procs, timeout=timeout)
