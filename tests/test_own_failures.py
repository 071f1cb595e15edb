"""A user's own loop (``distsgd.spawn``) that fails in one worker: an exception of its code, or a
loop that stops making progress, ends the run under every topology with one error naming the
worker and the line of the user's code; a worker process that dies stays a fault the asynchronous
algorithms survive.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import distsgd
from distsgd.errors import LoopError, WorkerError, loop_failure, stall_watch

HERE = Path(__file__).name


def line_of(marker: str) -> int:
    """The line of this file that ends with the comment ``# <marker>``."""
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# {marker}"))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def samples() -> TensorDataset:
    """A few hundred samples of 16 features and 4 classes."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(384, 16, generator=g), torch.randint(0, 4, (384,), generator=g))


def train(run: distsgd.Run, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """One pass of a plain loop over samples(): batches of 16, cross-entropy, loss.backward()."""
    dtype = next(model.parameters()).dtype  # (a model converted after run.setup(): its data too)
    for x, y in run.loader(samples(), batch_size=16):
        opt.zero_grad()
        F.cross_entropy(model(x.to(dtype)).float(), y).backward()
        opt.step()


def bad_batch() -> None:
    raise ValueError("bad batch")  # raises


def failing_loop(run: distsgd.Run, victim: int, how: str) -> nn.Module:
    """Worker ``victim`` fails at its third step: ``raise`` (an exception of the user's code), ``hang``
    (it sleeps, its process alive), ``kill`` (its process is SIGKILLed) or ``refused`` (a call distsgd
    refuses: a step with no batch); ``pause``: every worker evaluates there for longer than --timeout,
    inside run.paused() (``pause-alone``: worker ``victim`` alone)."""
    model, opt = run.setup()
    for epoch in range(run.cfg.epochs):
        for x, y in run.loader(samples(), batch_size=16, epoch=epoch):
            opt.zero_grad()
            run.backward(F.cross_entropy(model(x), y))  # all-reduces
            opt.step()  # averages
            if run.rank == victim and run.steps == 3:
                if how == "raise":
                    bad_batch()
                elif how == "hang":
                    time.sleep(1000)  # hangs
                elif how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif how == "refused":
                    opt.step()
                elif how == "exit":
                    sys.exit(1)  # exits
            if how == "pause" or (how == "pause-alone" and run.rank == victim):
                if run.steps == 3:  # an evaluation longer than --timeout
                    with run.paused():
                        time.sleep(1.5 * run.cfg.timeout_s)
    if how == "exit0":
        sys.exit(0)  # a script's habit at the end of main: as a return
    return run.final_model()


def spawn(algo: str, how: str, victim: int = 1, **settings) -> distsgd.TrainResult:
    workers = 1 if algo == "single" else 2
    return distsgd.spawn(
        functools.partial(failing_loop, victim=victim, how=how),
        model=Tiny,
        algo=algo,
        workers=workers,
        epochs=3,
        lr=0.05,
        quiet=True,
        **settings,
    )


# (algorithm, the worker that fails): a process group, shared memory, a parameter server, one process
FAMILIES = [("allreduce", 1), ("hogwild", 1), ("asgd", 1), ("single", 0)]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo, victim", [*FAMILIES, ("hogwild++", 1), ("ddp", 1)])
def test_an_exception_in_one_workers_loop_ends_the_run_naming_it_and_the_line(algo: str, victim: int) -> None:
    with pytest.raises(LoopError) as raised:
        spawn(algo, "raise", victim)
    message = str(raised.value)
    assert message == f"worker {victim} failed in main (tests/{HERE}:{line_of('raises')}): ValueError: bad batch"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo, victim", [*FAMILIES, ("sync-ps", 1), ("ddp", 1)])
def test_a_loop_that_stops_in_one_worker_ends_the_run_naming_it(algo: str, victim: int) -> None:
    """Its process alive (its parameter-server client still sends heartbeats): after --timeout
    without a step it fails where it stopped, and the peer waiting for it is not blamed."""
    with pytest.raises(LoopError) as raised:
        spawn(algo, "hang", victim, timeout_s=3)
    message = str(raised.value)
    assert message == (
        f"worker {victim} made no progress for 3 s (--timeout), in main (tests/{HERE}:{line_of('hangs')}); an "
        "evaluation or a save that long between steps goes inside run.paused(), or needs a longer --timeout "
        "(timeout= in spawn)"
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo", ["allreduce", "hogwild", "asgd", "local-sgd"])
def test_an_evaluation_longer_than_timeout_inside_run_paused_is_no_stall(algo: str) -> None:
    """run.paused() is the documented place for an evaluation: before, one longer than --timeout
    there ended the run as "made no progress" (an audit's, 2026-12-01: after hours of training)."""
    result = spawn(algo, "pause", timeout_s=2)
    assert result.summary["samples"] == 3 * len(samples())


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo, waits", [("allreduce", "all-reduces"), ("local-sgd", "averages")])
def test_a_peer_evaluating_alone_longer_than_timeout_is_said_as_a_wait_not_in_gloos_words(
    algo: str, waits: str
) -> None:
    """Worker 0 evaluates alone inside run.paused() while worker 1 waits at its next all-reduce:
    that wait has --timeout's deadline. Before, the line was gloo's ("RuntimeError: [.../gloo/
    transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete")."""
    with pytest.raises(WorkerError) as raised:
        spawn(algo, "pause-alone", victim=0, timeout_s=2)
    assert str(raised.value) == (
        f"worker 1 failed: RuntimeError: waited --timeout (2 s) for the other workers at a synchronisation "
        f"(tests/{HERE}:{line_of(waits)}) and timed out: one of them stopped, or was elsewhere that long (a worker "
        "that evaluates or saves alone, inside run.paused() too, needs a longer --timeout: timeout= in spawn)"
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo", ["allreduce", "hogwild", "asgd"])
def test_sys_exit_in_one_workers_loop_ends_the_run_and_sys_exit_0_returns(algo: str) -> None:
    """sys.exit(1) in worker 1: before, Hogwild! and asgd took it for a dead worker and returned
    a model, exit 0 (SystemExit is no Exception); sys.exit(0) at the end of main: before, allreduce
    failed ("worker 0 failed: SystemExit: 0") and asgd reported both workers failed."""
    with pytest.raises(LoopError) as raised:
        spawn(algo, "exit")
    assert str(raised.value) == f"worker 1 failed in main (tests/{HERE}:{line_of('exits')}): SystemExit: 1"
    result = spawn(algo, "exit0")
    assert result.model is not None and result.summary["samples"] == 3 * 384
    assert not result.summary.get("failed_workers")


def stops_early(run: distsgd.Run) -> nn.Module:
    """Worker 1 leaves its loop after 3 steps, on its own criterion (``if loss < x: break``)."""
    model, opt = run.setup()
    for x, y in run.loader(samples(), batch_size=16):
        opt.zero_grad()
        run.backward(F.cross_entropy(model(x), y))
        opt.step()
        if run.rank == 1 and run.steps == 3:
            break
    return run.final_model()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo", ["local-sgd", "diloco"])
def test_a_worker_that_stops_early_in_a_lockstep_group_is_one_line(algo: str) -> None:
    """A period longer than the run: no collective before the end. Before, the run ended with
    exit 0 and the samples of steps worker 1 never took (12 x 16 a worker counted, 3 x 16 trained)."""
    with pytest.raises(distsgd.DistsgdError, match="the workers took from 3 to 12 steps") as raised:
        distsgd.spawn(stops_early, model=Tiny, algo=algo, workers=2, sync_every="100", quiet=True)
    assert "\n" not in str(raised.value)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo", ["allreduce", "ddp", "local-sgd", "diloco", "streaming-diloco"])
def test_a_worker_that_stops_early_while_the_others_synchronise_is_one_line(algo: str) -> None:
    """Worker 1 leaves after 3 steps; worker 0 goes on to a synchronisation worker 1 never joins
    (its next gradient all-reduce; an average every 4 steps). Before, worker 1's check at
    run.final_model(), a collective, met worker 0's all-reduce of another size: gloo aborted the
    run ("worker 0 failed: killed by SIGABRT", gloo's C++ lines before it); under ddp it waited
    for --timeout. --timeout 60 here: the line comes from the wait itself, long before it."""
    period = {} if algo in ("allreduce", "ddp") else {"sync_every": "4"}
    with pytest.raises(distsgd.DistsgdError) as raised:
        distsgd.spawn(stops_early, model=Tiny, algo=algo, workers=2, quiet=True, timeout_s=60, **period)
    assert "worker 1 reached run.final_model() after 3 steps while worker 0 (" in str(raised.value)
    assert "waits for it at a synchronisation" in str(raised.value) and "\n" not in str(raised.value)


def arrives_late(run: distsgd.Run) -> nn.Module:
    """Worker 1 reaches run.final_model() 3 s after worker 0, both after every step."""
    model, opt = run.setup()
    train(run, model, opt)
    if run.rank == 1:
        time.sleep(3)
    return run.final_model()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_that_reaches_its_final_model_late_is_waited_for() -> None:
    """The check that every worker took as many steps waits for the last (worker 0 waits on the
    store, worker 1 is in its own code: neither is taken for stranded)."""
    result = distsgd.spawn(arrives_late, model=Tiny, algo="allreduce", workers=2, quiet=True, timeout_s=60)
    assert result.summary["samples"] == 384


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo", ["hogwild", "asgd"])
def test_a_call_distsgd_refuses_in_one_worker_ends_the_run(algo: str) -> None:
    with pytest.raises(distsgd.DistsgdError, match="worker 1 failed: optimizer.step.. with no batch"):
        spawn(algo, "refused")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo", ["hogwild", "asgd"])
def test_a_killed_worker_stays_a_fault_the_asynchronous_algorithms_survive(algo: str) -> None:
    summary = spawn(algo, "kill").summary
    assert summary["failed_workers"] == [1]
    assert "SIGKILL" in summary["worker_errors"]["1"]


SCRIPT = """
import sys

import distsgd
from test_own_failures import Tiny, failing_loop
import functools
import json

if __name__ == "__main__":
    loop = functools.partial(failing_loop, victim=1, how="raise")
    extra = {"sync_every": "4"} if "diloco" in sys.argv[1] else {}  # (an outer step within its steps)
    train = functools.partial(distsgd.spawn, loop, model=Tiny, algo=sys.argv[1], workers=2, epochs=3, lr=0.05, **extra)
    if sys.argv[2] == "uncaught":
        train()
    try:
        train()
    except distsgd.DistsgdError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "algo, caught", [("hogwild", "caught"), ("asgd", "uncaught"), ("streaming-diloco", "uncaught")]
)
def test_a_script_whose_loop_raises_says_one_line(tmp_path: Path, algo: str, caught: str) -> None:
    """Not quiet: the workers print nothing of their own (no traceback, no "worker gone" warning);
    the script's one line is all there is on stderr. Uncaught, the error's traceback is the
    script's line and distsgd's entry's (on 0a3bbc7, 25 lines more through the launcher's frames,
    which said nothing of the error). On a31895c streaming-diloco's other worker, its loader's
    generator closed as the launcher's SIGTERM landed, printed "Exception ignored in ...
    Terminated: SIGTERM" (10 lines more, 3 runs of 3 in the habits audit of 2026-11-29)."""
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), "src", "tests"]))}
    done = subprocess.run(
        [sys.executable, str(script), algo, caught], capture_output=True, text=True, env=env, timeout=150
    )
    said = f"worker 1 failed in main (tests/{HERE}:{line_of('raises')}): ValueError: bad batch"
    lines = done.stderr.strip().splitlines()
    if caught == "caught":
        assert done.returncode == 2 and lines == [f"error: {said}"], done.stderr[-3000:]
    else:
        assert done.returncode == 1 and lines[0] == "Traceback (most recent call last):", done.stderr[-3000:]
        assert lines[-1] == f"distsgd.errors.LoopError: {said}" and len(lines) <= 8, done.stderr[-3000:]
        assert "distsgd/launch" not in done.stderr, done.stderr[-3000:]


# -- the pieces, in this process ---------------------------------------------------------------------


def _raised(fn) -> Exception:
    try:
        fn()
    except Exception as exc:
        return exc
    raise AssertionError("it did not raise")


def test_an_exception_of_the_users_code_is_the_loops_failure() -> None:
    failure = loop_failure(_raised(bad_batch), "worker 3")
    assert str(failure) == f"worker 3 failed in main (tests/{HERE}:{line_of('raises')}): ValueError: bad batch"


def test_an_exception_of_torch_names_the_users_line() -> None:
    def shapes() -> None:
        nn.Linear(4, 3)(torch.zeros(2, 5))  # wrong shape

    failure = loop_failure(_raised(shapes), "worker 0")
    assert failure is not None and f"(tests/{HERE}:{line_of('wrong shape')}): RuntimeError: " in str(failure)


def test_symptoms_of_a_fault_elsewhere_are_not_the_loops() -> None:
    """What a collective raises (torch.distributed), a library's "broken pipe", and distsgd's own
    refusals are left to the launcher; the same words raised by the user's code are the loop's. And
    torch.distributed called by the loop where no group was formed (a converted script's
    dist.get_rank() under hogwild) is the loop's: since 2026-11-30 it names the line."""
    import multiprocessing

    import torch.distributed as dist

    assert loop_failure(_raised(lambda: dist.all_reduce("x")), "worker 0") is None  # raised in torch.distributed
    assert isinstance(loop_failure(_raised(lambda: dist.all_reduce(torch.zeros(1))), "worker 0"), LoopError)

    def broken_pipe() -> None:
        mine, theirs = multiprocessing.Pipe()
        theirs.close()
        try:
            mine.send(b"x" * 100_000)
        finally:
            mine.close()

    assert loop_failure(_raised(broken_pipe), "worker 0") is None
    assert loop_failure(distsgd.ConfigError("refused"), "worker 0") is None

    def says_reset() -> None:
        raise RuntimeError("Connection reset by peer")

    assert isinstance(loop_failure(_raised(says_reset), "worker 0"), LoopError)


@pytest.mark.timeout(60)
def test_a_stopped_loop_is_interrupted_where_it_stopped() -> None:
    start = time.monotonic()
    with pytest.raises(LoopError, match=rf"worker 0 made no progress for 0.5 s \(--timeout\), in main \(tests/{HERE}:"):
        with stall_watch("worker 0", lambda: 0, 0.5):
            time.sleep(30)
    assert time.monotonic() - start < 30


@pytest.mark.timeout(60)
def test_a_loop_that_is_not_training_or_makes_progress_is_left_alone() -> None:
    with stall_watch("worker 0", lambda: None, 0.2):  # before run.setup(), after run.final_model()
        time.sleep(1)
    steps = iter(range(1000))
    with stall_watch("worker 0", lambda: next(steps), 0.2):
        time.sleep(1)
    assert signal.getsignal(signal.SIGRTMAX) is signal.SIG_DFL  # put back


def habit_loop(run: distsgd.Run, how: str) -> nn.Module:
    """``numpy``: run.log is given a numpy float32; ``list``: a list; ``big``: batches larger than a
    worker's shard, with drop_last; ``diverge``: an lr that makes the weights inf."""
    model, opt = run.setup(lambda m: torch.optim.SGD(m.parameters(), lr=1e30 if how == "diverge" else 0.05))
    for x, y in run.loader(samples(), batch_size=300 if how == "big" else 16, drop_last=True):
        opt.zero_grad()
        F.cross_entropy(model(x), y).mul(1e30 if how == "diverge" else 1).backward()
        opt.step()
        if how in ("numpy", "list"):
            run.log(train_metric=np.float32(0.5) if how == "numpy" else [1, 2])
    return run.final_model()


def spawn_habit(how: str, **settings) -> distsgd.TrainResult:
    loop = functools.partial(habit_loop, how=how)
    return distsgd.spawn(loop, model=Tiny, algo="allreduce", workers=2, **settings)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_run_log_takes_a_numpy_scalar_and_refuses_a_list_in_one_line(tmp_path: Path) -> None:
    """Before, the launcher writing metrics.jsonl failed on np.float32 (not JSON) with a traceback."""
    spawn_habit("numpy", quiet=True, out=str(tmp_path / "run"))
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("train_metric") == 0.5 for e in logged)
    with pytest.raises(distsgd.DistsgdError, match=r"run.log\(train_metric=...\) takes a number, a string"):
        spawn_habit("list", quiet=True)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_loop_that_takes_no_step_is_one_line_and_a_diverged_model_is_said(tmp_path: Path) -> None:
    """Batches of 300 from a shard of 192 with drop_last: before, 0 steps and the untrained model
    returned, exit 0, no word. Weights gone to inf with a plain loss.backward(): no line said it."""
    with pytest.raises(distsgd.DistsgdError, match=r"reached run.final_model\(\) without a step: its run.loader"):
        spawn_habit("big", quiet=True)
    script = tmp_path / "diverge.py"  # (its own process: the workers' stderr is its, whatever ran before)
    script.write_text(
        "import functools, distsgd\nfrom test_own_failures import Tiny, habit_loop\n"
        "if __name__ == '__main__':\n    distsgd.spawn(functools.partial(habit_loop, how='diverge'), "
        "model=Tiny, algo='allreduce', workers=2)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), "src", "tests"]))}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=100)
    assert done.returncode == 0 and "the model returned has NaN or inf in 4 of its parameters" in done.stderr


def test_sync_every_epoch_in_your_own_loop_is_refused() -> None:
    """Before, local-sgd and diloco never averaged before the end (on_epoch_end is distsgd's loop's)."""
    with pytest.raises(distsgd.ConfigError, match="--sync-every epoch synchronises at the end of each of distsgd"):
        distsgd.spawn(stops_early, model=Tiny, algo="local-sgd", workers=2, sync_every="epoch", quiet=True)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x.view(-1, 1, 4, 4)).flatten(1))


def init_normal(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, 0.0, 0.02)


def changed_after_setup(run: distsgd.Run, how: str) -> nn.Module:
    """The model changed between run.setup() and the first step: ``init`` (DCGAN's
    ``model.apply(weights_init)``), ``channels_last``, or ``load`` (one set of weights, every worker)."""
    model, opt = run.setup()
    if how == "init":
        model.apply(init_normal)
    elif how == "channels_last":
        model.to(memory_format=torch.channels_last)
    elif how in ("double", "half"):  # (the data follows the model's dtype: see train)
        getattr(model, how)()
    else:
        model.load_state_dict({k: torch.full_like(v, 0.01) for k, v in model.state_dict().items()})
    train(run, model, opt)
    return run.final_model()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "algo, how, said",
    [
        ("allreduce", "init", "parameter head.weight was changed in place after run.setup() (model.apply(init)?"),
        ("sync-ps", "init", "parameter head.weight was changed in place after run.setup()"),
        ("hogwild", "init", "parameter head.weight was changed in place after run.setup()"),
        ("hogwild", "channels_last", "parameter conv.weight was replaced after run.setup()"),
        ("asgd", "channels_last", "parameter conv.weight was replaced after run.setup()"),
        ("allreduce", "load", None),
        ("allreduce", "channels_last", None),
        ("allreduce", "half", None),
    ],
)
def test_a_model_changed_between_setup_and_the_first_step(algo: str, how: str, said: str | None) -> None:
    """Before, silent: under allreduce each worker's own random init (the replicas apart all run,
    replica_max_abs_diff 1.97), under sync-ps the init overwritten by the server's weights; under
    hogwild and asgd a channels_last copy trained apart from the shared model (its conv weight
    never moved). Weights every worker loads alike, and a copy allreduce does not bind, work."""
    loop = functools.partial(changed_after_setup, how=how)
    if said is None:
        distsgd.spawn(loop, model=ConvNet, algo=algo, workers=2, quiet=True)
        return
    with pytest.raises(distsgd.DistsgdError) as raised:
        distsgd.spawn(loop, model=ConvNet, algo=algo, workers=2, quiet=True)
    assert said in str(raised.value) and "\n" not in str(raised.value)


class ConvNet4(nn.Module):
    """A convolution over 4 channels (its channels_last layout is another order in memory; ConvNet's
    one input channel keeps the same order)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 2, 2)
        self.head = nn.Linear(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x.view(-1, 4, 2, 2)).flatten(1))


@pytest.mark.slow
def test_channels_last_after_setup_is_refused_under_ddp() -> None:
    """Under ddp (until 2026-11-30) torch's DistributedDataParallel copied the averaged gradient back
    into weights made channels_last after it was built in its buckets' old layout, scrambled (an
    audit's: 0.09 from DDP's own result in 2 epochs, allreduce on the same script 4e-7; torch's
    warning says "This is not an error"). Now one line at the first step."""
    loop = functools.partial(changed_after_setup, how="channels_last")
    with pytest.raises(distsgd.DistsgdError) as raised:
        distsgd.spawn(loop, model=ConvNet4, algo="ddp", workers=2, quiet=True)
    said = "parameter conv.weight's memory layout changed after run.setup()"
    assert said in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "how, dtypes",
    [("double", "float32 to float64"), pytest.param("half", "float32 to float16", marks=pytest.mark.slow)],
)
def test_a_dtype_changed_after_setup_is_refused_under_ddp(how: str, dtypes: str) -> None:
    """Under ddp, model.double() (or .half(), .to(torch.bfloat16)) after run.setup(): torch's
    DistributedDataParallel averaged nothing of the converted parameters, and the model returned
    was worker 0's trained alone (an audit's: 0.11 from one process, exit 0; plain torch DDP the
    same, silently; OWN_LOOP.md said it was refused). Now one line at the first step."""
    loop = functools.partial(changed_after_setup, how=how)
    with pytest.raises(distsgd.DistsgdError) as raised:
        distsgd.spawn(loop, model=ConvNet, algo="ddp", workers=2, quiet=True)
    said = f"parameter conv.weight's dtype changed after run.setup() ({dtypes}"
    assert said in str(raised.value) and "\n" not in str(raised.value)


def test_a_parameter_made_finer_after_setup_is_refused_under_allreduce() -> None:
    """Under allreduce, model.double() after run.setup(): the float64 gradients were averaged in the
    float32 buckets made at setup (an audit's: 6.9e-09 from one process in 16 steps, exit 0). Now one
    line at the first step. (.half() stays: its gradients are averaged exactly, in float32.)"""
    loop = functools.partial(changed_after_setup, how="double")
    with pytest.raises(distsgd.DistsgdError) as raised:
        distsgd.spawn(loop, model=ConvNet, algo="allreduce", workers=2, quiet=True)
    said = "a parameter's dtype changed after run.setup() (float32 to float64: model.double()?)"
    assert said in str(raised.value) and "\n" not in str(raised.value)


def logs_on_rank_0(run: distsgd.Run) -> nn.Module:
    """The plain_loop.py habit: rank 0 alone evaluates and logs its test figures, every 4 steps."""
    model, opt = run.setup()
    for x, y in run.loader(samples(), batch_size=16):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if run.rank == 0 and run.steps % 4 == 0:
            run.log(test_accuracy=0.1)
    return run.final_model()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_test_figures_logged_on_rank_0_alone_with_stop_at_target_are_one_line() -> None:
    """Under --stop-at-target the workers decide together (a broadcast): rank 0's alone met the
    others' gradient all-reduce, and the run waited for --timeout (300 s), then gloo's timeout.
    Now rank 0 waits on the store and the others, found waiting for it, say so (--timeout 60 here:
    the line comes long before it)."""
    with pytest.raises(distsgd.DistsgdError) as raised:
        distsgd.spawn(
            logs_on_rank_0,
            model=Tiny,
            algo="allreduce",
            workers=2,
            quiet=True,
            timeout_s=60,
            stop_at_target=True,
            target_accuracy=0.9,
        )
    said = "worker 0 called run.log() with test figures (under allreduce with --stop-at-target they decide together"
    assert said in str(raised.value) and "and worker 1 did not" in str(raised.value)
    assert "\n" not in str(raised.value)


class SparseNet(nn.Module):
    """An embedding with sparse gradients (nn.Embedding(sparse=True)) of 16 ids, one per feature's sign."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 4, sparse=True)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(16, device=x.device) * 2 + (x > 0).long()
        return self.head(self.embed(ids).mean(1))


class LateSparseNet(SparseNet):
    """SparseNet whose embedding is left out of its first forward: its first gradient, sparse, comes
    at the second step."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.head(torch.zeros(len(x), 4)) if self.calls == 1 else super().forward(x)


def sgd_loop(run: distsgd.Run) -> nn.Module:
    """A plain loop: SGD, loss.backward(), opt.step()."""
    model, opt = run.setup(lambda m: torch.optim.SGD(m.parameters(), lr=0.05))
    train(run, model, opt)
    return run.final_model()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo", ["allreduce", "sync-ps"])
@pytest.mark.parametrize("model", [SparseNet, LateSparseNet])
def test_a_sparse_gradient_where_the_algorithm_flattens_gradients_is_one_line(algo: str, model: type) -> None:
    """Before: torch's "reshape is not implemented for sparse tensors", a traceback; then, where the
    first sparse gradient came after the first step (the audit of 2026-11-30: the layouts were
    looked at once), torch's line."""
    with pytest.raises(distsgd.DistsgdError) as raised:
        distsgd.spawn(sgd_loop, model=model, algo=algo, workers=2, quiet=True)
    assert "has a sparse gradient (nn.Embedding(sparse=True)?)" in str(raised.value)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("algo", ["local-sgd", pytest.param("diloco", marks=pytest.mark.slow)])
def test_a_sparse_gradient_trains_where_workers_train_apart(algo: str) -> None:
    """What the sparse refusal advises (local-sgd) trains: the watch for a loop's own gradient
    all-reduce (ba1551b) read every gradient's storage at distsgd's own averaging, and a sparse one
    has none ("NotImplementedError", the run failed at its first synchronisation: a review's)."""
    s = distsgd.spawn(sgd_loop, model=SparseNet, algo=algo, workers=2, quiet=True, sync_every=2).summary
    assert s["samples"] > 0 and s["bytes_sent"] > 0, s


def backward_with_graph(run: distsgd.Run, penalty: float) -> nn.Module:
    """A penalty on the gradient: loss.backward(create_graph=True), then backward through the
    loss plus ``penalty`` times the squared gradient (of the averaged gradient: the penalty's
    gradient, all-reduced in its turn, is the global one, 2 H g, as the average is linear)."""
    model, opt = run.setup(lambda m: torch.optim.SGD(m.parameters(), lr=0.05))
    for x, y in run.loader(samples(), batch_size=16):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward(create_graph=True)
        pen = sum((p.grad**2).sum() for p in model.parameters())
        for p in model.parameters():
            p.grad = None
        (loss + penalty * pen).backward()
        opt.step()
    return run.final_model()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_penalty_on_the_gradient_under_allreduce_trains() -> None:
    """Before, allreduce's bucket copies recorded the first backward's graph into its buffers: the
    second backward failed ("Trying to backward through the graph a second time")."""
    models = [
        distsgd.spawn(
            functools.partial(backward_with_graph, penalty=penalty),
            model=Tiny,
            algo="allreduce",
            workers=2,
            quiet=True,
        ).model
        for penalty in (0.5, 0.0)
    ]
    assert all(bool(torch.isfinite(p).all()) for p in models[0].parameters())
    assert max(float((a - b).abs().max()) for a, b in zip(models[0].parameters(), models[1].parameters())) > 1e-4


class Checkpointed(nn.Module):
    """Tiny's layers with the middle ones under activation checkpointing (``reentrant``: the
    older form, whose backward runs a backward pass of its own inside the loop's)."""

    reentrant = True

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.c = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.c(checkpoint(self.b, torch.tanh(self.a(x)), use_reentrant=self.reentrant))


class CheckpointedNonReentrant(Checkpointed):
    reentrant = False


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo", ["allreduce", "ddp"])
def test_reentrant_checkpointing_with_a_plain_backward_synchronises_once(algo: str) -> None:
    """torch.utils.checkpoint(use_reentrant=True) runs a backward pass inside the loop's: its end
    was taken for the end of loss.backward(), so allreduce synchronised twice (2-3x the bytes) and
    ddp refused the step with a false reason ("has no gradient"). Now as the non-reentrant form."""
    runs = [
        distsgd.spawn(sgd_loop, model=m, algo=algo, workers=2, quiet=True)
        for m in (Checkpointed, CheckpointedNonReentrant)
    ]
    assert runs[0].summary["bytes_sent"] == runs[1].summary["bytes_sent"]
    for a, b in zip(runs[0].model.parameters(), runs[1].model.parameters()):
        torch.testing.assert_close(a, b)
