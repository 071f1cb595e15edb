"""``distsgd bench --network RATE[,delay=D]``: each configuration as two hosts on a shaped link.

Two network namespaces on this machine are joined by a veth pair, and each end's outgoing
traffic is shaped with ``tc``: its rate by a token bucket (``tbf rate RATE``), and, with a
delay, ``netem delay D`` each way (a round trip takes 2 D) in front of it. Kernels built without
netem (as this project's 2-core VM's) shape the rate only, and a delay is refused with one line
saying so. ``--network unshaped`` gives the same two hosts with no shaping, to compare against.
Every run is ``torchrun --nnodes 2`` across them, as on two machines; the samples/s,
time to target and bytes reported are those of the shaped run. Layouts, 2 workers each:

- process group (allreduce, ddp, local-sgd, diloco, easgd): one worker on each host;
- parameter server: the server alone on host a, both workers on host b (every push crosses the link);
- hogwild++: one cluster of one Hogwild! worker on each host, the token crossing the link.

The two hosts share this machine's cores: each gets its own, in proportion to its processes
(``sched_setaffinity``; with one core, both share it), and unless ``--threads-per-worker`` says
otherwise each process runs as many threads as its host has cores per process. Each run's
``summary.json`` records the link (``network``) and the hosts (``hosts``: address, processes,
cores, threads per process).

Creating namespaces needs root (and iproute2 with ``tc``); elsewhere ``--network`` is refused
with one line saying why. Algorithms that live on one machine (single, hogwild) are skipped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from distsgd import config as config_mod
from distsgd.algorithms import registry
from distsgd.algorithms.base import SharedMemory
from distsgd.checkpoint import atomic_write_json
from distsgd.config import RunConfig
from distsgd.errors import ConfigError, WorkerError
from distsgd.rundir import record

HOSTS = ("10.77.0.1", "10.77.0.2")
_SPEC = re.compile(r"^(?P<rate>\d+(\.\d+)?[kmg]?bit)(,delay=(?P<delay>\d+(\.\d+)?ms))?$")


def parse(text: str) -> tuple[str | None, str | None]:
    """``10mbit,delay=20ms`` -> ("10mbit", "20ms"); ``unshaped`` -> (None, None)."""
    if text.strip().lower() == "unshaped":
        return None, None
    m = _SPEC.match(text.strip().lower())
    if not m:
        raise ConfigError(
            f"--network must be RATE[,delay=MS] such as 100mbit or 10mbit,delay=20ms, or unshaped, got '{text}'"
        )
    return m["rate"], m["delay"]


def describe(text: str) -> str:
    """The link of ``--network TEXT`` in words, for bench.md."""
    rate, delay = parse(text)
    shaped = (
        "with no shaping (unshaped)"
        if rate is None
        else f"shaped to {rate} each way (tc tbf)" + (f", delayed {delay} each way (netem)" if delay else "")
    )
    return f"2 hosts (network namespaces on this machine) joined by a veth pair {shaped}"


def layout(cfg: RunConfig) -> tuple[int, int] | None:
    """(processes on host a, on host b) for a 2-worker run of ``cfg.algo``; None: one machine only."""
    assert cfg.algo is not None  # the bench names the algorithm of every run
    topology = registry.resolve(cfg.algo, cfg).topology
    if topology.kind == "group":
        return 1, 1
    if topology.kind == "server":
        return 1, 2
    if isinstance(topology, SharedMemory) and topology.per_machine(cfg, 1) is not None:
        return 1, 1
    return None


class Network:
    """The two hosts and their link, for the duration of a ``with`` block."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.rate, self.delay = parse(spec)
        tag = uuid.uuid4().hex[:6]
        self.names = (f"dsgd-a-{tag}", f"dsgd-b-{tag}")
        self.veth = (f"va{tag}", f"vb{tag}")
        self.port = 29600 + int(tag, 16) % 300

    def __enter__(self) -> "Network":
        why = _cannot()
        if why:
            raise ConfigError(f"--network needs two network namespaces, which cannot be made here: {why}")
        # SIGTERM, like Ctrl-C, unwinds through the clean-up below: the hosts run in sessions of
        # their own and would outlive a bench that simply died.
        self._term = signal.signal(signal.SIGTERM, _interrupt) if _main_thread() else None
        try:
            self._make()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _make(self) -> None:
        for name in self.names:
            _ip("netns", "add", name)
        _ip("link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
        for name, veth, host in zip(self.names, self.veth, HOSTS):
            _ip("link", "set", veth, "netns", name)
            _ip("-n", name, "addr", "add", f"{host}/24", "dev", veth)
            _ip("-n", name, "link", "set", veth, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            if self.rate is None:  # unshaped: the veth pair as it is
                continue
            tc = ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", veth]
            bucket = ["tbf", "rate", self.rate, "burst", _burst(self.rate), "latency", "500ms"]
            if self.delay:
                _run(
                    [*tc, "root", "handle", "1:", "netem", "delay", self.delay],
                    "this kernel has no netem qdisc, so a delay cannot be shaped here (the rate alone can)",
                )
                _run([*tc, "parent", "1:1", "handle", "10:", *bucket])
            else:
                _run([*tc, "root", *bucket])

    def __exit__(self, *exc: Any) -> None:
        # A second Ctrl-C or SIGTERM must not cut the clean-up short: held until it is done.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM}) if _main_thread() else None
        try:
            for name in self.names:  # every process still in a host (a torchrun worker may have its own session)
                listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30)
                for pid in listed.stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        finally:
            if self._term is not None:
                signal.signal(signal.SIGTERM, self._term)
            if held is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def run(self, cfg: RunConfig) -> dict[str, Any]:
        """Train ``cfg`` across the two hosts; its summary.json (written on host a into cfg.out)."""
        assert cfg.algo is not None and cfg.out is not None  # the bench names both for every run
        out = Path(cfg.out)
        nprocs = layout(cfg)
        if nprocs is None:
            raise ConfigError(f"{cfg.algo} runs on one machine only")
        topology = registry.resolve(cfg.algo, cfg).topology
        if isinstance(topology, SharedMemory):  # one worker on each host
            one = topology.per_machine(cfg, 1)
            assert one is not None  # layout found it runs across machines
            cfg = one
        self.port += 1
        cpus = split_cores(sorted(os.sched_getaffinity(0)), nprocs)
        threads = cfg.threads_per_worker or max(1, min(len(c) // n for c, n in zip(cpus, nprocs)))
        hosts = [
            {
                "host": "ab"[node],
                "address": HOSTS[node],
                "processes": n,
                "cores": cpus[node],
                "threads_per_process": threads,
            }
            for node, n in enumerate(nprocs)
        ]
        with tempfile.TemporaryDirectory() as tmp:
            settings = Path(tmp) / "config.toml"
            settings.write_text(config_mod.to_toml(cfg.replace(workers=1, quiet=True, threads_per_worker=threads)))
            logs = [Path(tmp) / f"host{node}.err" for node in range(2)]  # files: a full pipe would stall a host
            procs: list[subprocess.Popen] = []
            try:
                procs += [self._start(node, n, settings, out, cpus[node], logs[node]) for node, n in enumerate(nprocs)]
                codes, stopped = _wait_all(procs, cfg.timeout_s + 600)
            finally:  # Ctrl-C, or any failure here: no host left running
                for p in procs:
                    _stop(p)
            results = [(code, log.read_text()) for code, log in zip(codes, logs)]
        # the host that failed by itself first; one we stopped because of it only says "exit -9"
        for node in sorted(range(2), key=lambda n: n in stopped):
            code, err = results[node]
            if code != 0:
                out.mkdir(parents=True, exist_ok=True)
                kept = out / f"host-{'ab'[node]}.log"
                record(kept)
                kept.write_text(err)
                lines = [ln for ln in err.strip().splitlines() if ln.strip() and "error_file" not in ln]
                last = ([ln for ln in lines if "error" in ln.lower()] or lines)[-1:] or ["(no output)"]
                raise WorkerError(
                    f"{cfg.algo} on host {'ab'[node]} of --network {self.spec} failed "
                    f"(exit {code}): {last[0].strip()} (its log: {kept})"
                )
        # what the run on host a could not know: the link it crossed and the hosts it ran as
        path = out / "summary.json"
        summary = {**json.loads(path.read_text()), "network": self.spec, "hosts": hosts}
        atomic_write_json(summary, path)
        return summary

    def _start(self, node: int, nprocs: int, settings: Path, out: Path, cpus: list[int], log: Path) -> subprocess.Popen:
        env = {**os.environ, "GLOO_SOCKET_IFNAME": self.veth[node], "OMP_NUM_THREADS": "1"}
        cmd = [
            "ip",
            "netns",
            "exec",
            self.names[node],
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            str(nprocs),
            "--node-rank",
            str(node),
            "--master-addr",
            HOSTS[0],
            "--master-port",
            str(self.port),
            "-m",
            "distsgd",
            "train",
            "--config",
            str(settings),
            "--out",
            str(out),
            "--overwrite",
        ]
        with log.open("w") as err:
            return subprocess.Popen(
                cmd,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env,
                start_new_session=True,
                preexec_fn=lambda: os.sched_setaffinity(0, cpus),
            )


def split_cores(cpus: list[int], nprocs: tuple[int, int]) -> tuple[list[int], list[int]]:
    """This machine's cores ``cpus`` split between the two hosts in proportion to their processes,
    at least one each; with a single core, both hosts share it."""
    if len(cpus) < 2:
        return list(cpus), list(cpus)
    first = min(len(cpus) - 1, max(1, round(len(cpus) * nprocs[0] / sum(nprocs))))
    return cpus[:first], cpus[first:]


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _cannot() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 ('ip' and 'tc') is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    return None


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(cmd: list[str], unknown_qdisc: str | None = None) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        if unknown_qdisc and "qdisc kind is unknown" in res.stderr:
            raise ConfigError(f"--network: {unknown_qdisc}")
        raise ConfigError(f"--network: '{' '.join(cmd)}' failed: {res.stderr.strip()}")


def _burst(rate: str) -> str:
    """The token bucket's size: a hundredth of a second at the rate, at least 32 kbit."""
    m = re.match(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate)
    assert m is not None
    bits = float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]]
    return f"{max(32, int(bits / 100 / 1000))}kbit"


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> tuple[list[int], set[int]]:
    """Exit codes of both hosts' torchrun, and which hosts were stopped: if one fails (or time
    runs out), the other is stopped rather than left waiting for its peer."""
    import time

    deadline = time.monotonic() + timeout
    stopped: set[int] = set()
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            for i, p in enumerate(procs):
                if p.poll() is None:
                    _stop(p)
                    stopped.add(i)
        time.sleep(0.1)
    return [p.returncode for p in procs], stopped


def _stop(p: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a host's torchrun: SIGTERM, which it passes on to its workers before it exits, then
    SIGKILL to its session after ``grace_s``. (Workers that escaped it die with the namespace.)"""
    if p.poll() is not None:
        return
    try:
        p.send_signal(signal.SIGTERM)
        p.wait(grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)
