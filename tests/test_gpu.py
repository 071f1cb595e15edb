"""What only a GPU can show of the GPU path: algorithm state resumed on CUDA, locks that wait for
the device, loss scaling with a float16 wire, NCCL's own checks, float32 that is float32, copies
between host and device, and torch.compile on CUDA workers. Every test here is marked ``gpu``:
skipped without CUDA, run with ``python -m pytest -m gpu`` (tests/test_device.py has the others).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import distsgd
from distsgd.checkpoint import load_worker_state

pytest.importorskip("sklearn")

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("algo, extra", [
    ("allreduce", {"compress": "powersgd"}),
    ("local-sgd", {"compress": "powersgd", "sync_every": "4"}),
    ("streaming-diloco", {"sync_every": "8", "fragments": 2, "overlap": 2, "lr": 0.003}),
])
def test_algorithm_state_resumes_on_a_gpu(tmp_path: Path, algo: str, extra: dict) -> None:
    """A checkpoint loads on the CPU; PowerSGD's error feedback and Q, local SGD's anchor and a
    Streaming DiLoCo fragment in flight must go back to the GPU. The checkpoint resumed from holds
    them (checkpoints every 3 steps of 2 x 16: the one at step 18 has fragment 0 in flight)."""
    common = dict(model="mlp", data="digits", algo=algo, workers=2, batch_size=16, lr=0.05, device="cuda",
                  checkpoint_every="96", quiet=True)
    common.update(extra)
    full = distsgd.train(max_samples=1440, out=str(tmp_path / "full"), **common)
    distsgd.train(max_samples=600, out=str(tmp_path / "part"), **common)
    state = load_worker_state(tmp_path / "part", 0)["algo"]
    assert state["flight"] is not None if algo == "streaming-diloco" else state["compressor"]["error"] is not None
    resumed = distsgd.train(resume=str(tmp_path / "part"), max_samples=1440)
    assert resumed.summary["device"].startswith("cuda")
    assert resumed.summary["final_test_loss"] == pytest.approx(full.summary["final_test_loss"], rel=1e-5)
