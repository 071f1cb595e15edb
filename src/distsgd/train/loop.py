"""distsgd's own training loop, run in each worker: a client of the same
:class:`~distsgd.train.own_loop.Run` a user's ``main(run)`` drives (``distsgd.spawn``), so each
algorithm's setup, step and ending are defined once.

Per step: the next batch of this worker's shard, forward (under --precision's autocast), loss,
``run.backward`` (then ``algo.after_backward``, the gradient sync), then ``opt.step()`` (the
schedule, clipping, ``algo.apply_step`` (the update), ``algo.after_step`` (parameter sync),
progress). At every evaluation point every worker asks for the model the algorithm would return
now (``run.evaluation_model``: the average, the centre, ...) and the evaluating worker measures
it with the training clock paused, the evaluation timed when that model existed (its making, an
average, counted); at the run's last step the evaluation is of the model returned, made by
``run.final_model`` on the clock. A checkpoint saves the stateful pieces (model, optimiser,
algorithm, loop counters, random state) through one Checkpointer.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch

from distsgd.checkpoint import RngState, optimizer_layout, scatter
from distsgd.data import Dataset
from distsgd.data.partition import epoch_indices, shard_size
from distsgd.errors import STOP, ConfigError, Terminated
from distsgd.train import device, membership
from distsgd.train.context import ENDED_HERE, Start, WorkerContext, WorkerResult
from distsgd.train.evaluate import Cut, equal_states, eval_period, evaluate, snapshot
from distsgd.train.graphs import GraphedSteps, drawn_in_steps
from distsgd.train.objective import loss_function
from distsgd.train.own_loop import LoopState, Run, run_own_loop

if TYPE_CHECKING:
    from distsgd.algorithms.base import Algorithm
    from distsgd.data.torchdata import TorchData  # a stream's (``stream_batches``)

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]
Item = tuple[torch.Tensor, ...]  # what the loop steps on: a Batch, or (where the graph gathers) (indices,)
CHECK_S = 0.1  # about how often the workers ask one another whether a signal asked the run to stop


@device.float32_exact()  # float32 computed in float32 on a GPU too (not cuDNN's default TF32)
def run_worker(ctx: WorkerContext, algo: "Algorithm", replacement: bool = False) -> WorkerResult:
    """Train this worker's share of the run and return what it measured. ``replacement``: it
    takes the place of a worker that died (its launcher started it again). A run whose loop is the
    user's (``distsgd.spawn``) calls their ``main(run)`` instead."""
    if ctx.job.main is not None:
        return run_own_loop(ctx, algo, replacement)
    w = _start(ctx, algo, replacement)  # model, optimiser, counters; restored from --resume
    algo = w.algo
    final = (ctx.job.resume_from or {}).get(ENDED_HERE)
    if final and not algo.local_model and not (w.state.evals and w.state.evals[-1].get("samples") == final["samples"]):
        # a finished run, resumed to train on: its final evaluation came after its last checkpoint,
        # which kept none of it (its summary's time and samples to target were lost with it). Of the
        # checkpoint's model where the replicas are the model returned; not where that part's
        # return averaged them or took an outer step (a model the resumed part never has)
        w.state.evals.append(final)
        w.evaluated = snapshot(w.model)  # of this model: a resume that trains nothing does not measure it again
    # While it trains, a lockstep run stops on SIGTERM (SIGUSR1) at its next step, with a checkpoint there
    with STOP.listen() if algo.topology.lockstep else contextlib.nullcontext():
        while True:
            try:
                if not w.done:  # (a regrouped group whose loop had ended on any member goes to the end)
                    _train(w, ctx, algo)
                w.done = True
                return w.finish()
            except RuntimeError as exc:
                # --min-workers: the group lost a worker. The survivors regroup and take the most
                # advanced one's state, then train on from its counters: each may have been lost at
                # another point (a step, an evaluation, the end), so each starts the loop again there
                lost = membership.as_loss(exc)
                if lost is None:
                    raise
                w.recover(lost)


def _start(ctx: WorkerContext, algo: "Algorithm", replacement: bool) -> "_Worker":
    """The worker built (model, optimiser, counters; restored from --resume), joined to its group
    and at the training clock's start. In a group that trains through losses (``--min-workers``),
    a member lost before the first step (while the others build, or at the barrier that starts
    the clock) makes the survivors build again in the next generation's group, with a fresh
    algorithm: every worker builds from the run's seed, so nothing trained is lost; the recovery is
    recorded at the first step."""
    began: float | None = None
    gone: list[int] = []
    while True:
        try:
            w = _Worker(ctx, algo, replacement)
            if replacement and membership.current() is not None:  # joins a group that trains through losses
                w.join()
            ended = (ctx.job.resume_from or {}).get(ENDED_HERE)  # kept (below): its time was this run's too
            kept = ended["train_wall_s"] if ended and not algo.local_model else 0.0
            w.run._begin(max(w.state.train_wall_s, kept))  # every worker together, the clock from here
        except RuntimeError as exc:
            member = membership.current()
            if member is None or replacement:  # (a replacement's losses while it joins: w.join regroups)
                raise
            lost = membership.as_loss(exc)
            if lost is None:
                raise
            began = time.perf_counter() if began is None else began
            log.info("worker %d: %s before the first step; building again", member.first_rank, lost)
            g, _ = member.regroup(ctx.cfg.backend)
            gone = sorted(set(gone) | set(g))
            if ctx.shard is None:
                ctx.shard = (member.first_rank, member.first_world)
            ctx.rank, ctx.world = member.rank, member.world
            ctx.reports = ctx.evaluates = member.rank == 0
            algo = type(algo)(ctx.cfg)
            continue
        if began is not None:
            member = membership.current()
            assert member is not None
            w.recovering = {
                "generation": member.gen,
                "lost": gone,
                "joined": [],
                "began": began,
                "from_worker": None,  # (none: every member built its state afresh)
                "workers": ctx.world,
                "dropped": 0,
            }
        return w


def _train(w: "_Worker", ctx: WorkerContext, algo: "Algorithm") -> None:
    """The loop's epochs and steps, up to the run's budget, its target or a signal's stop: from
    where the counters stand (a resumed run's, or those a regrouped group took), so that every
    worker that enters it with the same counters goes through the same collectives."""
    stop = False
    if w.state.owed:  # resumed from a signal's checkpoint: the evaluation the signal cut comes first
        w.state.owed = False
        stop = w.evaluate()
    while not stop and w.more_epochs():
        for micro in _groups(w.epoch_batches(), ctx.cfg.accumulate):
            if w.out_of_samples() or not algo.keep_going(ctx):
                stop = True
                break
            w.step(micro)
            if w.signalled():
                w.stop_for_signal()
            # the run's last step: finish() evaluates the model returned, made on the training clock
            if w.state.evals_at.due(w.all_samples) and not w.budget_spent() and w.evaluate(cut_stops=True):
                stop = True
                break
            if w.state.checkpoints_at.due(w.all_samples):
                w.checkpoint()
        if stop:
            break
        w.end_epoch()
        if w.eval_every is None and not w.budget_spent():
            stop = w.evaluate(cut_stops=True)
        if w.checkpoint_each_epoch:
            w.checkpoint()
    if w.signalled(at_once=True):  # one that came since the last look: this last step's checkpoint keeps it all
        w.stop_for_signal()


def check_saved(saved: dict[str, Any], model: torch.nn.Module) -> None:
    """The launcher's look at a worker's file of a checkpoint before a resumed run writes anything
    (its config.toml): the pieces every worker restores alike, each checked as it loads: the model
    (into ``model``, one built as the workers build theirs, which it changes), the loop's counters,
    the random state (not applied), the optimiser's layout. A worker checks all its pieces again
    as it restores them: the algorithm's too, and the optimiser against its own."""
    scatter({"model": model, "loop": LoopState(), "rng": RngState(apply=False), "optimizer": _Layout()}, saved)


class _Layout:
    """An optimiser's saved state, checked but restored into nothing (see :func:`check_saved`)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        optimizer_layout(state)


def _groups(batches: Iterator[Item], k: int) -> Iterator[list[Item]]:
    """The micro-batches of each step: ``k`` at a time (the epoch's last step may have fewer)."""
    group: list[Item] = []
    for batch in batches:
        group.append(batch)
        if len(group) == k:
            yield group
            group = []
    if group:
        yield group


class _Worker:
    """One worker's run of distsgd's loop, driving a :class:`~distsgd.train.own_loop.Run` as a
    user's loop does: the run's model, optimiser, step and ending are the Run's; the data order,
    the loss, evaluations and checkpoints are the loop's."""

    def __init__(self, ctx: WorkerContext, algo: "Algorithm", replacement: bool = False) -> None:
        ctx.job = ctx.job.replace(data=ctx.job.data.to(ctx.device))  # the data on this worker's device, once
        cfg, ds = ctx.cfg, ctx.dataset
        self.ctx, self.algo, self.cfg = ctx, algo, cfg
        self.stream = getattr(ds, "stream", False)  # an epoch is a pass over a stream: its length is not known
        if not self.stream and shard_size(ds.n_train, ctx.data_world, cfg.partition) == 0:
            raise ConfigError(f"{ds.n_train} training samples cannot be shared among {ctx.data_world} workers")
        self.run = run = Run(ctx, algo, replacement)
        self.per_epoch = run.per_epoch
        self.loss_fn = loss_function(cfg.loss, ctx.job.loss, ds.task)
        period = cfg.checkpoint_period
        self.checkpoint_each_epoch = period is not None and period.each_epoch
        self.eval_every = eval_period(cfg, run.global_per_epoch)  # None: at each epoch's (a stream's pass's) end
        # the counters, with this loop's evaluation and checkpoint periods, restored by run.setup()
        self.state = run._state = LoopState(self.eval_every, period.count if period is not None else None)
        # as a user's loop sets up: --model built with the run's seed, --optimizer; --resume's
        # checkpoint restored; a worker its launcher started again (or, in a resumed asynchronous
        # run, a rank that had no part in the checkpoint) rejoins the running model; the clock starts
        run._begin_later = True  # run_worker starts it, once --compile has warmed up (below)
        self.model, _ = run.setup()
        if run._started is Start.REPLACEMENT:  # from the samples this rank had trained, in its own shard
            st = self.state  # (a stream's: its rank's samples, skipped from the first pass on)
            st.epoch, st.start = divmod(st.local, self.per_epoch) if self.per_epoch else (0, st.local)
        straggler = cfg.straggler_spec  # a simulated straggler sleeps (factor - 1) x its own step time
        self.slowdown = straggler.factor - 1 if straggler is not None and straggler.rank == ctx.rank else 0.0
        # --cuda-graphs on tensors on the device (no --augment: a graph would replay the same crops):
        # the graph gathers each batch itself, and the loop gives it the batch's indices only
        source = (ds.x_train, ds.y_train) if cfg.cuda_graphs and isinstance(ds, Dataset) and not ds.augment else None
        self.gathers = source is not None
        self.graphed = GraphedSteps(run, self.model, self.loss_fn, ctx.device, source) if cfg.cuda_graphs else None
        if cfg.compile and device.compiles():  # compiled before the clock starts, for every shape it will meet
            run._where["compile_s"] = round(self.warm_compiled(), 3)
        self.next_check, self.checked = 0, (time.perf_counter(), 0)  # signalled(): the next step it asks at
        self.cut = False  # an evaluation a signal cut short, since the workers last asked (stop_owing)
        self.evaluated: dict[str, torch.Tensor] | None = None  # the state of the model last evaluated
        self.recovering: dict[str, Any] | None = None  # a recovery whose next step is yet to come
        self.done = False  # the loop has ended (--min-workers: shared when the group regroups)
        self.all_samples = algo.global_samples(ctx, self.state.local)  # all workers' samples, read once a step

    def warm_compiled(self) -> float:
        """--compile: torch.compile compiles at a forward of a shape (and mode) it has not seen; made
        here, off the training clock, for the full training batch, the epoch's last partial one, and
        the evaluation's full and last batches, so the run meets no compilation (it counted in
        samples/s: 1.8k against 19.3k eager on an H200's first run). Nothing of these passes stays:
        no gradient, no synchronisation (``no_sync``), the buffers (BatchNorm's statistics) put back.
        A compiled step slower than an eager one is said in one warning. Returns the seconds taken."""
        ds, cfg, run = self.ctx.dataset, self.cfg, self.run
        module = self.algo.unwrap(self.model)
        started = time.perf_counter()
        buffers = [b.detach().clone() for b in module.buffers()]
        if self.stream:  # the first full batch (a stream's last, partial one is not known ahead)
            batch = next(iter(cast("TorchData", ds).stream_batches(self.ctx.rank, self.ctx.world, 0, cfg.batch_size)))
            train_sizes = [len(batch[1])]
        else:
            order = self.epoch_order()
            full = min(cfg.batch_size, len(order))
            train_sizes = [full] + ([len(order) % full] if len(order) % full else [])
            batch = next(iter(ds.batches(order[:full], 0, full)))

        def fwd_bwd(call: Callable[..., Any], x: torch.Tensor, y: torch.Tensor) -> None:
            self.loss_fn(call(x), y).backward()

        with run.no_sync():  # the algorithm sees none of these passes
            for size in train_sizes:
                fwd_bwd(module, batch[0][:size], batch[1][:size])
            n_test, eval_full = getattr(ds, "n_test", 0), cfg.eval_batch_size
            test = next(iter(ds.test_batches(eval_full)), None)
            if test is not None:
                module.eval()
                with torch.no_grad():
                    for size in [min(eval_full, n_test)] + (
                        [n_test % eval_full] if n_test > eval_full and n_test % eval_full else []
                    ):
                        module(test[0][:size].to(self.ctx.device))
                module.train()
            compile_s = time.perf_counter() - started
            sync = device.synchronizer(self.ctx.device) or (lambda: None)
            times = {}
            for name, call in (("compiled", module), ("eager", device.eager_call(module))):
                t0 = time.perf_counter()
                for _ in range(3):
                    fwd_bwd(call, *batch)
                sync()
                times[name] = (time.perf_counter() - t0) / 3
        for p in module.parameters():
            p.grad = None
        with torch.no_grad():
            for b, saved in zip(module.buffers(), buffers):
                b.copy_(saved)
        if times["compiled"] > 1.05 * times["eager"]:
            log.warning(
                "--compile: a compiled step took %.2f ms, an eager one %.2f ms, for this model on %s; "
                "training compiled anyway (leave out --compile to train eagerly)",
                1e3 * times["compiled"],
                1e3 * times["eager"],
                self.ctx.device,
            )
        return compile_s

    def more_epochs(self) -> bool:
        return self.cfg.max_samples is not None or self.state.epoch < self.cfg.epochs

    def out_of_samples(self) -> bool:
        return self.cfg.max_samples is not None and self.all_samples >= self.cfg.max_samples

    def budget_spent(self) -> bool:
        """Whether the step just taken was the run's last (--max-samples, or the last epoch's last
        step). An evaluation there is left to :meth:`finish`, which measures the model returned:
        its last synchronisation (the average, the outer step of a round cut short) runs on the
        training clock, so the evaluation's time is the time that model existed. Measured here,
        the same model would be made twice: on copies for the evaluation, then again, all-reduce
        and all, by finish."""
        if self.cfg.max_samples is not None:
            return self.out_of_samples()
        st, last = self.state, self.cfg.epochs - 1
        # a stream's last step is known only once its pass has ended: an evaluation may fall on it
        return st.epoch > last or (st.epoch == last and bool(self.per_epoch) and st.start >= self.per_epoch)

    def epoch_batches(self) -> Iterator[Item]:
        """This epoch's batches for this worker, from where the epoch stands (a resumed run's); with
        --cuda-graphs each drawn inside a step of the process's gate, never beside a capture."""
        if self.graphed is not None:
            return drawn_in_steps(self._epoch_batches)
        return self._epoch_batches()

    def _epoch_batches(self) -> Iterator[Item]:
        ctx, ds, st = self.ctx, self.ctx.dataset, self.state
        if self.stream:
            return cast("TorchData", ds).stream_batches(ctx.data_rank, ctx.data_world, st.start, self.cfg.batch_size)
        if self.gathers:  # a batch's indices, as a 1-tuple: the graph, or eager_step, gathers it
            order = self.epoch_order().to(cast(Dataset, ds).x_train.device)
            bs = self.cfg.batch_size
            return ((order[first : first + bs],) for first in range(st.start, len(order), bs))
        return ds.batches(self.epoch_order(), st.start, self.cfg.batch_size)

    def epoch_order(self) -> torch.Tensor:
        ctx, cfg = self.ctx, self.cfg
        return epoch_indices(
            ctx.dataset.n_train, self.state.epoch, ctx.data_rank, ctx.data_world, cfg.seed, cfg.partition
        )

    def step(self, micro: list[Item]) -> None:
        """One update from ``micro`` (``--accumulate`` micro-batches): each one's loss is weighted
        by its share of the step's samples, so the gradient is the mean over all of them, and the
        algorithm synchronises only after the last one."""
        run = self.run
        started = time.perf_counter()
        n = sum(len(batch[-1]) for batch in micro)  # (x, y)'s y, or (indices,)
        run.count(n)
        if self.graphed is not None:  # --cuda-graphs: replayed once captured (a partial batch: eagerly)
            self.graphed.take(micro[0], lambda: self.eager_step(micro, n))
        else:
            self.eager_step(micro, n)
        if self.slowdown:
            time.sleep(self.slowdown * (time.perf_counter() - started))
        self.all_samples = self.algo.global_samples(self.ctx, self.state.local)
        if self.recovering is not None:  # the first step since a recovery: it is done
            self.recovered()

    def recover(self, lost: membership.Lost) -> None:
        """The group lost a worker, or a replacement is ready to join (``--min-workers``): join the
        next generation's group, take the state of the most advanced member (model, optimiser,
        algorithm, counters; not the random state; an algorithm whose models are local keeps
        its own model and optimiser), and keep this worker's shard of the data.
        The step in flight here, if it did not complete, is dropped, and the loop starts again from
        the counters taken."""
        member = membership.current()
        if member is None:  # (Lost is raised only where a membership waits)
            raise lost
        log.info("worker %d: %s; regrouping", member.first_rank, lost)
        self._take_over_through(member, time.perf_counter(), [], [], regroup=True)

    def join(self) -> None:
        """A replacement (``--min-workers`` with ``--restart-workers``): in the group it entered at
        the others' next step (before it was built: DDP builds on a group; the others wait for its
        build, counted in its recovery), it takes the most advanced member's state, not the
        checkpoint's."""
        member = membership.current()
        assert member is not None
        self._take_over_through(member, member.entered_at, [], [member.first_rank], regroup=False)

    def _take_over_through(
        self, member: membership.Membership, began: float, gone: list[int], joined: list[int], regroup: bool
    ) -> None:
        """:meth:`take_over` in the next generation's group (``regroup``) or the one just formed,
        again in the one after where the group loses a member while its state is shared (a second
        loss during a regrouping: each is one more generation, and one recovery)."""
        world = self.ctx.world  # the group's size before the loss (the departed samples' count)
        in_flight = self.run._batch_samples  # this worker's step in flight: computed, and dropped
        self.run._abandon_step()
        while True:
            if regroup:
                g, j = member.regroup(self.cfg.backend)
                gone, joined = sorted(set(gone) | set(g)), sorted(set(joined) | set(j))
            try:
                self.take_over(member, began, gone, joined, world, in_flight)
                return
            except membership.Lost as again:
                log.info("worker %d: %s while regrouping; regrouping again", member.first_rank, again)
                regroup = True

    def take_over(
        self,
        member: membership.Membership,
        began: float,
        gone: list[int],
        joined: list[int],
        old_world: int,
        in_flight: int,
    ) -> None:
        """This worker's place in the group ``member`` just formed (of ``old_world`` workers before;
        ``in_flight``: the samples of this worker's step that was dropped),
        and the state of its most advanced member (all of it; a survivor of an algorithm whose
        models are local between its synchronisations, ``Algorithm.local_model``, keeps its own
        model and optimisers). :class:`membership.Lost` where that group loses a member meanwhile."""
        ctx, run, algo, st = self.ctx, self.run, self.algo, self.state
        if ctx.shard is None:
            ctx.shard = (member.first_rank, member.first_world)
        ctx.rank, ctx.world = run.rank, run.world = member.rank, member.world
        ctx.reports = ctx.evaluates = member.rank == 0
        algo.regrouped(ctx)
        pieces = {k: v for k, v in run._pieces().items() if k != "rng"}  # each worker's own random state
        sent = algo.sent_counts()  # what this worker sent is its own
        st.train_wall_s = run._clock.elapsed()  # a replacement's clock goes on from the others'
        states = {k: v.state_dict() for k, v in pieces.items()}
        states["group"] = {"departed_samples": ctx.departed_samples, "world": old_world}
        loaded, source, self.done = membership.share_state(states, st.steps, ctx.device, self.done)
        dropped = membership.total(in_flight)
        group = states["group"]
        if loaded is not None:
            group = loaded.pop("group")
            if algo.local_model and member.first_rank not in joined:  # a survivor's own model and optimisers stay
                pieces = {k: v for k, v in pieces.items() if k != "model" and not k.startswith("optimizer")}
            scatter(pieces, loaded)
            run._lr_set = None  # the learning rate is the source's, set by its schedule (maybe a step on)
            if member.first_rank not in joined:
                algo.restore_sent_counts(sent)
            else:  # a replacement: its counts from nothing (its clock starts from the others' time)
                algo.restore_sent_counts({k: 0 for k in sent})
        # the workers lost had trained as many samples as each member; one that joined, none
        ctx.departed_samples = int(group["departed_samples"]) + st.local * (int(group["world"]) - ctx.world)
        self.all_samples = algo.global_samples(ctx, st.local)
        self.next_check = st.steps  # signalled(): ask at the next step, in the new group
        self.recovering = {
            "generation": member.gen,
            "lost": gone,
            "joined": joined,
            "began": began,
            "from_worker": member.members[source],
            "workers": ctx.world,
            "dropped": dropped,
        }

    def recovered(self) -> None:
        """The first step after a recovery completed: the reporting worker tells the launcher how
        long it took (from the failed collective to this step's end)."""
        rec, self.recovering = self.recovering, None
        assert rec is not None
        if self.ctx.reports:
            self.ctx.sink.emit(
                {
                    "event": "recovery",
                    "generation": rec["generation"],
                    "lost": rec["lost"],
                    "joined": rec["joined"],
                    "workers": rec["workers"],
                    "state_from": rec["from_worker"],
                    "recovery_s": round(time.perf_counter() - rec["began"], 3),
                    "samples": self.all_samples,
                    # the survivors' steps in flight, dropped (at most: a step whose collective
                    # completed on the most advanced member is in the model it gave the others);
                    # what the lost worker trained since its last synchronisation is not known here
                    "samples_lost": rec["dropped"],
                }
            )

    def gathered(self, batch: Item) -> Batch:
        """(x, y) of a batch given as such or, where the graph gathers (``self.gathers``), as its indices."""
        if len(batch) == 2:
            return batch[0], batch[1]
        ds = cast(Dataset, self.ctx.dataset)
        return ds.x_train[batch[0]], ds.y_train[batch[0]]

    def eager_step(self, micro: list[Item], n: int) -> None:
        run = self.run
        # with --cuda-graphs the gradients stay the tensors the graph writes
        run.optimizer.zero_grad(set_to_none=self.graphed is None)
        for i, batch in enumerate(micro):
            x, y = self.gathered(batch)
            with run.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                loss = self.loss_fn(self.model(x), y)  # the forward under --precision's autocast (run.setup)
                run.backward(loss, len(y) / n if len(micro) > 1 else 1.0)
        run.optimizer.step()

    def evaluate(self, cut_stops: bool = False) -> bool:
        """Measure the model the algorithm would return now (clock paused); True: every worker stops.
        ``cut_stops``: where a signal came meanwhile, on any worker, the run stops at this step (see
        :meth:`stop_owing`)."""
        with self.run.paused():
            returned = self.run.evaluation_model()  # on every worker: may be a collective
            reached = False
            if self.ctx.evaluates:
                reached = self.measure(returned)
        if cut_stops:
            self.stop_owing()
        return self.algo.agree(self.ctx, reached) if self.ctx.job.may_stop else False

    def stop_owing(self) -> None:
        """After an evaluation during training, where the workers listen for a signal: if one came
        to any of them meanwhile, they stop at this step, and its checkpoint owes the evaluation
        where a signal cut it short, which the resumed run makes first (:func:`_train`). Until
        2026-12-01 the workers took another step first, and a resume never made it: its time and
        samples to a target, and with --stop-at-target its model, were another's (an audit's:
        27,284 samples to target for 25,848). Every worker asks, at once: one small all-reduce an
        evaluation."""
        if not STOP.listening:
            return
        cut, asked = self.algo.sum_started(self.ctx, [int(self.cut), int(STOP.requested is not None)])()
        self.cut = False
        if asked:
            self.state.owed = cut > 0
            self.stop_for_signal()

    def measure(self, model: torch.nn.Module, final: bool = False) -> bool:
        """Evaluate ``model`` (this worker evaluates) and report it as ``run.log`` reports a user's
        test figures; keep what was evaluated. True: the figures reach the run's target. One
        during training is given up where a signal asks the run to stop (its checkpoint at the
        next step comes first: a long evaluation held it back past a scheduler's grace period,
        and the work since the last checkpoint was lost to its SIGKILL); the final one is not."""
        cut = None if final else (lambda: STOP.requested is not None)
        try:
            acc, loss = evaluate(model, self.ctx.dataset, self.cfg.eval_batch_size, self.loss_fn, cut=cut)
        except Cut:
            # (the workers then stop at this step: see stop_owing)
            log.info("worker %d: evaluation at %d samples given up: the run stops", self.ctx.rank, self.all_samples)
            self.cut = True
            return False
        self.evaluated = snapshot(model)
        return self.run._evaluation({"test_accuracy": acc, "test_loss": loss})

    def signalled(self, at_once: bool = False) -> bool:
        """Whether a signal asked the run to stop, on any worker. The workers ask together, at the
        same steps: every few steps, as many as take about :data:`CHECK_S` (each worker proposes
        a number from its own step time; all take the largest, which they learn with the answer),
        so that the asking costs nothing much and the stop comes within a fraction of a second.
        ``at_once``: ask now (every worker does, at the loop's end).

        With ``--min-workers`` they ask, the same way, whether the launcher announced a
        replacement ready to join: if any saw it, all raise :class:`membership.Lost` at the same
        step and form the group again with it (a join is taken in only where all agree to; the
        last chance is the loop's end)."""
        st = self.state
        member = membership.current()
        if not (STOP.listening or member is not None) or (st.steps < self.next_check and not at_once):
            return False
        now = time.perf_counter()
        per_step = (now - self.checked[0]) / max(1, st.steps - self.checked[1])
        every = max(1, min(1000, int(CHECK_S / per_step))) if per_step > 0 else 1
        self.checked = (now, st.steps)
        joins = int(member is not None and member.announced())
        seen = self.algo.max_of(self.ctx, [int(STOP.requested is not None), every, joins])
        self.next_check = st.steps + (seen[1] if seen is not None else 1)
        if seen is not None and seen[2]:
            raise membership.Lost("a replacement is ready to join")
        return seen is not None and bool(seen[0])

    def stop_for_signal(self) -> NoReturn:
        """A signal asked the run to stop: every worker is at this step. A checkpoint of it (where
        the run has a directory), so that ``--resume`` (a requeued job's, by itself) loses no step;
        then :class:`Terminated`, which the command reports with that ``--resume``."""
        # (in a group short of workers it lost, of the workers it has: a resume gives the others a peer's)
        if self.cfg.out and self.algo.checkpoints:
            self.checkpoint()
            self.algo.barrier(self.ctx)  # rank 0 has committed it: no worker's exit (srun's --kill-on-bad-exit,
            # torchrun's stop of the others) can end rank 0 before
        raise Terminated(*(STOP.requested or ("SIGTERM", 15)))

    def checkpoint(self) -> None:
        """Every worker writes its pieces; once all have, the manifest points at the new set.
        A checkpoint's number is the one of the point it is taken at (the k-th multiple of
        --checkpoint-every samples, or the epoch), so workers that are not in lockstep agree; and
        always above the last one's (a signal's checkpoint falls between two points: the next
        point's must not write over it)."""
        st, period = self.state, self.cfg.checkpoint_period
        point = st.epoch if period is None or period.count is None else self.all_samples // period.count
        self.run._save_checkpoint(max(point, st.seq + 1), self.all_samples)

    def end_epoch(self) -> None:
        self.algo.on_epoch_end(self.ctx, self.model, self.state.epoch)
        self.state.epoch += 1
        self.state.start = 0
        self.all_samples = self.algo.global_samples(self.ctx, self.state.local)

    def finish(self) -> WorkerResult:
        """The model the algorithm returns (``run.final_model``: its last synchronisation inside
        the training clock, its checks outside), evaluated unless the last evaluation was of
        exactly this model (the same values in every parameter and buffer): the final figures
        always describe the model returned and saved, and nothing changes it afterwards."""
        if self.stream and self.state.steps == 0:  # (a set too small to share is refused before training)
            raise ConfigError(
                f"the training stream gave worker {self.ctx.rank} no sample: each of {self.ctx.data_world} workers "
                f"reads one item in {self.ctx.data_world} (a last row of fewer is left out), so it needs at least "
                f"{self.ctx.data_world} items"
            )
        self.model = self.run.final_model()
        if self.recovering is not None:  # regrouped at the very end: the model returned is the step after
            self.recovered()
        if self.graphed is not None:
            self.run._where.update(self.graphed.summary())
        self.all_samples = self.algo.global_samples(self.ctx, self.state.local)
        if self.ctx.evaluates and not equal_states(self.model.state_dict(), self.evaluated):
            self.measure(self.model, final=True)
        return self.run._result()


__all__ = ["run_worker", "check_saved", "LoopState"]
