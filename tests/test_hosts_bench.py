"""benchmarks/hosts.py's bookkeeping: which cells a run measures and which rows it keeps."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def hosts(monkeypatch):
    spec = importlib.util.spec_from_file_location("hosts", ROOT / "benchmarks" / "hosts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "hosts", module)
    spec.loader.exec_module(module)
    ran = []

    def run(out, config, hosts, network, max_samples, again, eval_every=module.EVAL_EVERY):
        ran.append((config, hosts, network))
        row = {"config": config, "hosts": hosts, "network": network, "workers": hosts or 1, "new": True}
        return {**row, "samples_per_s": 1000.0, "bytes_per_sample": 100.0, "samples_to_target": 6400}

    monkeypatch.setattr(module, "run", run)
    module.ran = ran
    return module


def _row(config, hosts, network):
    return {"config": config, "hosts": hosts, "network": network, "new": False}


def test_only_measures_its_algorithms_and_keeps_every_other_row_the_single_runs_included(hosts) -> None:
    singles = [_row(s, None, None) for s in hosts.SINGLE.values()]
    kept = singles + [_row(c, h, n) for c in ("allreduce", "hogwild++") for h in hosts.HOSTS for n in hosts.NETWORKS]
    rows = hosts.measure(Path("unused"), 10.0, 300_000, True, ["hogwild++"], kept)
    # the single runs are every other row's reference (scaling.py's compute per sample): kept, not run again
    assert {c for c, _, _ in hosts.ran} == {"hogwild++"}
    assert len(hosts.ran) == len(hosts.HOSTS) * len(hosts.NETWORKS)
    assert [r for r in rows if not r["new"]] == [r for r in kept if r["config"] != "hogwild++"]
    assert all(r["new"] for r in rows if r["config"] == "hogwild++")


def test_a_whole_run_measures_the_single_runs(hosts) -> None:
    hosts.measure(Path("unused"), 10.0, 300_000, True, ["hogwild++"], [])
    assert [c for c, h, _ in hosts.ran if h is None] == list(hosts.SINGLE.values())
