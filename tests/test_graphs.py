"""--cuda-graphs and Hogwild! as threads, where a CPU can show them: the loop around a captured step
(warm-up, static buffers, the counters after each replay, partial batches and a failed capture run
eagerly) with a stand-in for the capture that replays the step's Python, so a run must end with
exactly the eager run's weights; the settings a graph cannot hold, refused in one line; Hogwild!'s
workers as threads of one process sharing its model. The GPU side: tests/test_gpu.py and
benchmarks/gpu_check.sh."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import distsgd
from distsgd import api
from distsgd.train import device, graphs

COMMON = dict(model="mlp", data="digits", batch_size=64, epochs=2, lr=0.05, momentum=0.9, quiet=True)


def _state(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in model.state_dict().values()])


@pytest.fixture
def replayed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The capture stood in for on the CPU: 'replay' runs the captured step's Python again (a real
    graph runs its kernels). Lists each capture."""
    captures: list[int] = []

    def capture(step, stream):
        captures.append(1)
        return SimpleNamespace(replay=step)

    monkeypatch.setattr(device, "capture_step", capture)
    monkeypatch.setattr(api, "graphs_refusal", lambda cfg, kind: None)  # a CPU run may capture, here
    return captures


@pytest.mark.parametrize("augment", [False, True])
def test_a_captured_step_replayed_ends_with_the_eager_runs_weights(
    replayed: list[int], monkeypatch: pytest.MonkeyPatch, augment: bool
) -> None:
    """digits: 1437 training samples, 22 full batches of 64 and a partial one per epoch: 3 eager
    warm-up steps, one capture, 41 replays, the two partial batches eager; every update the eager
    run's, and the counters and the training loss those of 46 steps. Without --augment the graph
    gathers each batch from its indices (what it was given is the indices); with it, the loop
    gathers and crops each batch and copies it in (x and y)."""
    given: list[int] = []
    take = graphs.GraphedSteps.take
    monkeypatch.setattr(
        graphs.GraphedSteps, "take", lambda self, batch, eager: (given.append(len(batch)), take(self, batch, eager))[1]
    )
    eager = distsgd.train(algo="single", augment=augment, **COMMON)
    graphed = distsgd.train(algo="single", cuda_graphs=True, augment=augment, **COMMON)
    assert set(given) == ({2} if augment else {1})
    assert replayed == [1]
    assert torch.equal(_state(graphed.model), _state(eager.model))
    s = graphed.summary
    assert s["cuda_graphs"] is True and s["graph_replays"] == 2 * 22 - graphs.WARMUP
    assert s["samples"] == eager.summary["samples"] and s["final_test_loss"] == eager.summary["final_test_loss"]


def test_a_capture_that_fails_says_so_and_the_worker_trains_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    def capture(step, stream):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(device, "capture_step", capture)
    monkeypatch.setattr(api, "graphs_refusal", lambda cfg, kind: None)
    eager = distsgd.train(algo="single", **COMMON)
    graphed = distsgd.train(algo="single", cuda_graphs=True, **COMMON)
    assert torch.equal(_state(graphed.model), _state(eager.model))
    assert graphed.summary["cuda_graphs"] is False
    assert "operation not permitted" in graphed.summary["cuda_graphs_failed"]


def test_the_capture_is_off_the_training_clock_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture runs none of the step (the replay after it trains the batch): its time is kept off
    the training clock, as --compile's compiling is, and summary.json says how long it took. A
    stand-in capture that takes 1.5 s: the run's training time stays under it, capture_s is it.
    On 424a1e3 the capture was inside the clock (issue 45: single with --cuda-graphs at 0.89 of a
    captured bare loop, its warm-up and capture in the clock)."""
    import time

    def capture(step, stream):
        time.sleep(1.5)
        return SimpleNamespace(replay=step)

    monkeypatch.setattr(device, "capture_step", capture)
    monkeypatch.setattr(api, "graphs_refusal", lambda cfg, kind: None)
    s = distsgd.train(algo="single", cuda_graphs=True, **COMMON).summary
    assert s["cuda_graphs"] is True and 1.5 <= s["capture_s"] < 3.0, s["capture_s"]
    assert s["train_wall_s"] < 1.5 and s["samples_per_s"] == pytest.approx(s["samples"] / s["train_wall_s"])


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"algo": "allreduce", "workers": 2}, "talks to other processes"),
        ({"device": "cpu"}, "needs a CUDA GPU"),
        ({"schedule": "cosine"}, "the learning rate is fixed"),
        ({"accumulate": 2}, "one batch a step"),
        ({"compile": True}, "choose one"),
        ({"algo": "hogwild", "workers": 2, "hogwild_lock": True}, "host lock"),
    ],
)
def test_what_a_graph_cannot_hold_is_refused_in_one_line(settings: dict, match: str) -> None:
    with pytest.raises(distsgd.ConfigError, match=match) as info:
        distsgd.train(**{**COMMON, "algo": "single", "cuda_graphs": True, **settings})
    assert "\n" not in str(info.value)


def test_hogwild_threads_train_one_model_in_one_process() -> None:
    """--hogwild-threads on (the default on one GPU): the workers are threads of the launcher
    binding their replicas to its model; they train what processes train (the same data, the
    band: Hogwild!'s order of updates differs run to run)."""
    threads = distsgd.train(algo="hogwild", workers=2, hogwild_threads="on", **COMMON).summary
    processes = distsgd.train(algo="hogwild", workers=2, hogwild_threads="off", **COMMON).summary
    assert threads["hogwild_threads"] is True and processes["hogwild_threads"] is False
    assert threads["samples_per_worker"] == processes["samples_per_worker"]
    # Hogwild!'s spread on this job is wide (0.77 and 0.92 from one setting): both far above chance (0.1)
    assert threads["final_test_accuracy"] > 0.6 and processes["final_test_accuracy"] > 0.6


def pytorch_hogwild_loop(run: distsgd.Run, model: torch.nn.Module) -> None:
    """pytorch/examples' mnist_hogwild habit: the model comes in ``args``, the optimiser is built on it."""
    data = torch.utils.data.TensorDataset(torch.randn(256, 64), torch.randint(0, 10, (256,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = run.setup(model, opt)
    for x, y in run.loader(data, batch_size=32):
        opt.zero_grad()
        run.backward(torch.nn.functional.cross_entropy(model(x), y))
        opt.step()


def test_a_user_loop_under_hogwild_threads_is_refused_in_one_line() -> None:
    """Threads would share the caller's model and optimiser objects, where processes each get a copy
    of ``main``'s args: one thread's ``optimizer.step()`` changed tensors another's autograd had saved
    (the GPU run of 2026-11-28: examples/mnist_hogwild with --cuda, 'modified by an inplace
    operation'). ``on`` is refused in one line; ``auto`` (threads on one GPU) keeps processes for a
    user's loop, which tests/test_examples.py's mnist_hogwild --cuda run shows on a GPU."""
    model = torch.nn.Linear(64, 10)
    with pytest.raises(distsgd.ConfigError, match="leave it at auto") as info:
        distsgd.spawn(pytorch_hogwild_loop, model, "hogwild", 2, args=(model,), hogwild_threads="on", quiet=True)
    assert "\n" not in str(info.value)


def test_hogwild_threads_replay_beside_each_other_and_capture_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hogwild!'s threads with --cuda-graphs: a thread's replay may run while another's does (they
    are there to keep the GPU busy together), and a capture runs while no other thread steps (on an
    H200 4 threads capturing beside the others' steps failed). The stand-in replay waits a moment
    for the other thread to be inside its own, the stand-in capture for one to start beside it. On
    ef5acf1 one lock held round every step made the replays take turns (4 threads of mnist_net:
    1.11x one thread's samples/s on an H200, a bare loop's 2.3x)."""
    import threading
    import time

    lock = threading.Lock()
    inside = [0]
    seen = {"together": 0, "beside_capture": 0, "captures": 0}

    def replay_of(step):
        def replay():
            with lock:
                inside[0] += 1
            try:
                until = time.monotonic() + 0.5
                while not seen["together"] and time.monotonic() < until:  # once seen, no more waiting
                    with lock:
                        if inside[0] > 1:
                            seen["together"] += 1
                    time.sleep(0.001)
                step()
            finally:
                with lock:
                    inside[0] -= 1

        return replay

    def capture(step, stream):
        seen["captures"] += 1
        until = time.monotonic() + 0.2
        while time.monotonic() < until:
            with lock:
                seen["beside_capture"] += inside[0]
            time.sleep(0.001)
        return SimpleNamespace(replay=replay_of(step))

    monkeypatch.setattr(device, "capture_step", capture)
    monkeypatch.setattr(api, "graphs_refusal", lambda cfg, kind: None)
    s = distsgd.train(algo="hogwild", workers=2, hogwild_threads="on", cuda_graphs=True, **COMMON).summary
    assert s["hogwild_threads"] is True and s["cuda_graphs"] is True
    assert seen["captures"] == 2 and seen["beside_capture"] == 0, seen
    assert seen["together"] > 0, seen
    assert s["final_test_accuracy"] > 0.6, s["final_test_accuracy"]


def test_hogwild_threads_draw_no_batch_beside_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """With --augment each thread's batch is gathered and cropped where the model is (on a GPU:
    allocations, launches and draws on the default CUDA generator, which a capture in another
    thread must not meet, as a step must not). The stand-in capture takes 0.2 s and a crop before
    the captures 0.05 s; the crops that end while a capture runs are counted. Until 2026-12-01 the
    threads drew their batches outside the gate, and one thread's crops ran beside the other's
    capture."""
    import time

    from distsgd.data import augment

    capturing = [0]
    seen = {"crops": 0, "beside_capture": 0, "captures": 0}
    crop = augment.crop_flip

    def counted_crop(*args, **kwargs):
        seen["crops"] += 1
        if seen["captures"] < 2:  # until both have captured, a crop takes a while (a GPU's would be queued)
            time.sleep(0.05)
        seen["beside_capture"] += capturing[0]
        return crop(*args, **kwargs)

    def capture(step, stream):
        seen["captures"] += 1
        capturing[0] += 1
        try:
            time.sleep(0.2)
        finally:
            capturing[0] -= 1
        return SimpleNamespace(replay=step)

    import distsgd.data as data_mod

    monkeypatch.setattr(data_mod, "crop_flip", counted_crop)
    monkeypatch.setattr(device, "capture_step", capture)
    monkeypatch.setattr(api, "graphs_refusal", lambda cfg, kind: None)
    s = distsgd.train(algo="hogwild", workers=2, hogwild_threads="on", cuda_graphs=True, augment=True, **COMMON)
    assert s.summary["cuda_graphs"] is True and s.summary["hogwild_threads"] is True
    assert seen["captures"] == 2 and seen["crops"] > 40, seen
    assert seen["beside_capture"] == 0, seen


def test_a_capture_interrupted_while_it_waits_leaves_the_gate_open() -> None:
    """The gate is the process's (Hogwild!'s threads share one GPU): a Ctrl-C in the main thread
    while its capture waits for another thread's step left the count of waiting captures up on
    80d465a, and every later step in the process (a notebook's next run) waited for ever."""
    import signal
    import threading

    gate = graphs._Gate()
    stepping, release = threading.Event(), threading.Event()

    def a_step() -> None:
        with gate.step():
            stepping.set()
            release.wait(10)

    other = threading.Thread(target=a_step)
    other.start()
    assert stepping.wait(10)
    main = threading.get_ident()
    timer = threading.Timer(0.2, lambda: signal.pthread_kill(main, signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        with gate.alone():
            pass
    release.set()
    other.join(10)
    done = threading.Event()

    def next_step() -> None:
        with gate.step():
            done.set()

    later = threading.Thread(target=next_step, daemon=True)
    later.start()
    assert done.wait(5), "a step after the interrupted capture waits for ever"
