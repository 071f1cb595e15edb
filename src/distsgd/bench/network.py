"""``distsgd bench --network RATE[,delay=D] [--hosts H]``: each configuration as H hosts on shaped links.

Each host is a network namespace on this machine. Two hosts (the default) are joined by a veth
pair; more are each joined by a veth pair to a bridge in a namespace of its own (the switch).
Every link is shaped both ways with ``tc`` on the egress of its two ends, so a host sends and
receives at most RATE, as through a NIC of that rate on a switch that is never the bottleneck:
its rate by a token bucket (``tbf rate RATE``), and, with a delay, ``netem delay D`` each way
(a round trip between two hosts takes 2 D; through the switch, 4 D) in front of it. Kernels built
without netem (as this project's 2-core VM's) shape the rate only, and a delay is refused with
one line saying so. ``--network unshaped`` gives the same hosts with no shaping, to compare
against. Every run is ``torchrun --nnodes`` across them, as on that many machines; the samples/s,
time to target and bytes reported are those of the shaped run. Layouts, H workers each:

- process group (allreduce, ddp, local-sgd, diloco, easgd): one worker on each host;
- parameter server: with 2 hosts, the server alone on host a and both workers on host b (every
  push crosses the link); with more, the server on a host of its own (H + 1 namespaces) and one
  worker on each of the others, so its link carries every worker's pushes and replies, as a
  dedicated server's would;
- hogwild++: one cluster of one Hogwild! worker on each host, the token going round the ring.

The hosts share this machine's cores: with at least as many cores as hosts, each host gets its
own, in proportion to its processes; with fewer, each host is pinned to one core, taken in turn
(``sched_setaffinity``; 5 hosts on 2 cores: hosts a, c, e on the first, b, d on the second). Unless
``--threads-per-worker`` says otherwise each process runs as many threads as its host has cores
per process. Each run's ``summary.json`` records the link (``network``) and the hosts (``hosts``:
address, processes, cores, threads per process).

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
from types import FrameType
from typing import Any

from distsgd import config as config_mod
from distsgd.algorithms import registry
from distsgd.algorithms.base import SharedMemory
from distsgd.checkpoint import atomic_write_json
from distsgd.config import RunConfig
from distsgd.errors import ConfigError, WorkerError
from distsgd.rundir import record

MAX_HOSTS = 25  # hosts a to z: 25 workers and a parameter server


def address(node: int) -> str:
    """Host ``node``'s address (0: host a, 10.77.0.1)."""
    return f"10.77.0.{node + 1}"


def host_name(node: int) -> str:
    return "abcdefghijklmnopqrstuvwxyz"[node]


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


def check_hosts(hosts: int) -> None:
    if not 2 <= hosts <= MAX_HOSTS:
        raise ConfigError(f"--hosts must be from 2 to {MAX_HOSTS}, got {hosts}")


def settle_hosts(spec: str | None, hosts: int | None) -> int:
    """The hosts of ``--network SPEC --hosts HOSTS``, checked: 2 unless given, and only with a network."""
    if spec is None:
        if hosts is not None:
            raise ConfigError("--hosts needs --network: the hosts are network namespaces joined by its links")
        return 2
    parse(spec)
    check_hosts(hosts or 2)
    return hosts or 2


def describe(text: str, hosts: int = 2) -> str:
    """The link of ``--network TEXT`` in words, for bench.md."""
    rate, delay = parse(text)
    shaped = (
        "with no shaping (unshaped)"
        if rate is None
        else f"shaped to {rate} each way (tc tbf)" + (f", delayed {delay} each way (netem)" if delay else "")
    )
    if hosts == 2:
        return f"2 hosts (network namespaces on this machine) joined by a veth pair {shaped}"
    return (
        f"{hosts} hosts (network namespaces on this machine; a parameter server on one more), each joined to a "
        f"bridge by a veth pair {shaped}"
    )


def layout(cfg: RunConfig, hosts: int = 2) -> tuple[int, ...] | None:
    """Processes on each host (a, b, ...) for a run of ``cfg.algo`` with ``hosts`` workers; None:
    one machine only."""
    assert cfg.algo is not None  # the bench names the algorithm of every run
    topology = registry.class_for(cfg.algo, cfg).topology
    if topology.server:
        return (1, 2) if hosts == 2 else (1,) * (hosts + 1)
    if (topology.process_group and not topology.in_process) or (
        isinstance(topology, SharedMemory) and topology.per_machine(cfg, 1) is not None
    ):
        return (1,) * hosts
    return None


class Network:
    """The hosts and their links, for the duration of a ``with`` block. ``hosts`` is the number of
    workers; a parameter server's run with more than 2 takes one host more."""

    def __init__(self, spec: str, hosts: int = 2) -> None:
        check_hosts(hosts)
        self.spec, self.hosts = spec, hosts
        self.rate, self.delay = parse(spec)
        tag = uuid.uuid4().hex[:6]
        self.tag = tag
        made = 2 if hosts == 2 else hosts + 1
        self.names = tuple(f"dsgd-{host_name(n)}-{tag}" for n in range(made))
        self.veth = (f"va{tag}", f"vb{tag}") if hosts == 2 else tuple(f"v{n}{tag}" for n in range(made))
        self.switch = None if hosts == 2 else f"dsgd-sw-{tag}"
        self.port = 29600 + int(tag, 16) % 300

    def __enter__(self) -> "Network":
        why = _cannot()
        if why:
            raise ConfigError(f"--network needs network namespaces, which cannot be made here: {why}")
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
        if self.switch is None:  # two hosts: one veth pair between them
            _ip("link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
        else:  # each host's veth pair to a bridge in the switch's namespace
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for node, veth in enumerate(self.veth):
                port = f"s{node}{self.tag}"
                _ip("link", "add", veth, "type", "veth", "peer", "name", port)
                _ip("link", "set", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                self._shape(self.switch, port)  # what the host receives
        for node, (name, veth) in enumerate(zip(self.names, self.veth)):
            _ip("link", "set", veth, "netns", name)
            _ip("-n", name, "addr", "add", f"{address(node)}/24", "dev", veth)
            _ip("-n", name, "link", "set", veth, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            self._shape(name, veth)  # what the host sends

    def _shape(self, namespace: str, dev: str) -> None:
        """Shape what leaves ``dev`` (unshaped: leave it as it is)."""
        if self.rate is None:
            return
        tc = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", dev]
        bucket = ["tbf", "rate", self.rate, "burst", _burst(self.rate), "latency", "500ms"]
        if self.delay:
            _run(
                [*tc, "root", "handle", "1:", "netem", "delay", self.delay],
                "this kernel has no netem qdisc, so a delay cannot be shaped here (the rate alone can)",
            )
            _run([*tc, "parent", "1:1", "handle", "10:", *bucket])
        else:
            _run([*tc, "root", *bucket])

    def __exit__(self, *exc: object) -> None:
        # A second Ctrl-C or SIGTERM must not cut the clean-up short: held until it is done.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM}) if _main_thread() else None
        try:
            # every process still in a namespace (a torchrun worker may have its own session)
            for name in self.names + ((self.switch,) if self.switch else ()):
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
        """Train ``cfg`` across the hosts; its summary.json (written on host a into cfg.out)."""
        assert cfg.algo is not None and cfg.out is not None  # the bench names both for every run
        out = Path(cfg.out)
        nprocs = layout(cfg, self.hosts)
        if nprocs is None:
            raise ConfigError(f"{cfg.algo} runs on one machine only")
        topology = registry.class_for(cfg.algo, cfg).topology
        if isinstance(topology, SharedMemory):  # one worker on each host
            one = topology.per_machine(cfg, 1)
            assert one is not None  # layout found it runs across machines
            cfg = one
        self.port += 1
        cpus = split_cores(sorted(os.sched_getaffinity(0)), nprocs)
        threads = cfg.threads_per_worker or max(1, min(len(c) // n for c, n in zip(cpus, nprocs)))
        hosts = [
            {
                "host": host_name(node),
                "address": address(node),
                "processes": n,
                "cores": cpus[node],
                "threads_per_process": threads,
            }
            for node, n in enumerate(nprocs)
        ]
        with tempfile.TemporaryDirectory() as tmp:
            settings = Path(tmp) / "config.toml"
            settings.write_text(config_mod.to_toml(cfg.replace(workers=1, quiet=True, threads_per_worker=threads)))
            # files: a full pipe would stall a host
            logs = [Path(tmp) / f"host{node}.err" for node in range(len(nprocs))]
            procs: list[subprocess.Popen] = []
            try:
                procs += [
                    self._start(node, nprocs, settings, out, cpus[node], logs[node]) for node in range(len(nprocs))
                ]
                codes, stopped = _wait_all(procs, cfg.timeout_s + 600)
            finally:  # Ctrl-C, or any failure here: no host left running
                for p in procs:
                    _stop(p)
            results = [(code, log.read_text()) for code, log in zip(codes, logs)]
        # the host that failed by itself first; one we stopped because of it only says "exit -9"
        for node in sorted(range(len(nprocs)), key=lambda n: n in stopped):
            code, err = results[node]
            if code != 0:
                out.mkdir(parents=True, exist_ok=True)
                kept = out / f"host-{host_name(node)}.log"
                record(kept)
                kept.write_text(err)
                lines = [ln for ln in err.strip().splitlines() if ln.strip() and "error_file" not in ln]
                last = ([ln for ln in lines if "error" in ln.lower()] or lines)[-1:] or ["(no output)"]
                raise WorkerError(
                    f"{cfg.algo} on host {host_name(node)} of --network {self.spec} failed "
                    f"(exit {code}): {last[0].strip()} (its log: {kept})"
                )
        # what the run on host a could not know: the links it crossed and the hosts it ran as
        path = out / "summary.json"
        summary = {**json.loads(path.read_text()), "network": self.spec, "hosts": hosts}
        atomic_write_json(summary, path)
        return summary

    def _start(
        self, node: int, nprocs: tuple[int, ...], settings: Path, out: Path, cpus: list[int], log: Path
    ) -> subprocess.Popen:
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
            str(len(nprocs)),
            "--nproc-per-node",
            str(nprocs[node]),
            "--node-rank",
            str(node),
            "--master-addr",
            address(0),
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


def split_cores(cpus: list[int], nprocs: tuple[int, ...]) -> tuple[list[int], ...]:
    """This machine's cores ``cpus`` split between the hosts in proportion to their processes, at
    least one each; with fewer cores than hosts, each host gets one, in turn."""
    if len(cpus) < len(nprocs):
        return tuple([cpus[node % len(cpus)]] for node in range(len(nprocs)))
    total, bounds = sum(nprocs), [0]
    for node in range(1, len(nprocs)):
        # host node starts where its share of the processes before it says, leaving one core each after it
        share = round(len(cpus) * sum(nprocs[:node]) / total)
        bounds.append(min(len(cpus) - (len(nprocs) - node), max(bounds[-1] + 1, share)))
    bounds.append(len(cpus))
    return tuple(cpus[lo:hi] for lo, hi in zip(bounds, bounds[1:]))


def _interrupt(signum: int, frame: FrameType | None) -> None:
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
    """Exit codes of every host's torchrun, and which hosts were stopped: if one fails (or time
    runs out), the others are stopped rather than left waiting for their peer."""
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
