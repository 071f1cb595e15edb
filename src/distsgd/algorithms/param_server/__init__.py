"""A parameter server: asgd, sync-ps, ssp and dcasgd (and the centre of async easgd).

Roles: rank 0 is the server, ranks 1..N are the workers (world size N+1). The server holds the
model and the optimiser. A worker pulls the weights once, as one flat tensor with their version;
then, every step, it computes a gradient on its shard and pushes it with the version it read, and
gets the new weights (and their version) back in the same call.

The package, by part:

- :mod:`.core`: the server's mechanics (one lock, versions, sample counts, barriers, the workers'
  buffers, futures completed outside the lock), whatever the rule;
- :mod:`.rules`: the update rules, one small class each, with their papers;
- :mod:`.wire`: the wire format (the messages, their headers and their payloads' aligned sections);
- :mod:`.hyper`: the worker optimiser's settings each push carries (lr, momentum, betas, weight
  decay), how a HELLO describes its parameter groups, and how the server checks and applies them;
- :mod:`.transport`: how workers reach the server (TCP sockets, the server's threads, the client);
- :mod:`.role`: the server process: the core, a watcher that evaluates its model, checkpoints;
- :mod:`.worker`: the topology (what the launcher asks: serve), the workers' side, and the
  registered algorithms.

The optimiser's settings: the server's optimiser, built by the same factory on the same model as
each worker's, steps on a push's gradient with the hyperparameters the worker's optimiser held at
that step (its lr, momentum, betas, weight decay: what a user's LR scheduler, OneCycleLR included,
or the run's ``--schedule`` and ``--lr-warmup-steps`` set there). They are the one source of the
lr: the server has no schedule of its own. So ``--schedule`` follows the run's progress as the
worker knows it (every worker's samples as of its last answer, as under every other algorithm),
and the warm-up counts each worker's own steps (W steps of each of N workers: about N W server
updates under asgd, W rounds under sync-ps), as under allreduce and hogwild. How they compose
with ``--staleness-lr`` and DC-ASGD's compensation: :mod:`.rules`.

Buffers (BatchNorm statistics): the server's model would otherwise keep its initial running
statistics, since only gradients reach it. Each push also carries the worker's buffers; the
server's floating-point buffers are the mean of every worker's most recent ones, and its integer
buffers (``num_batches_tracked``) those of the latest push. They are set whenever the server's
model is taken (evaluated, checkpointed, returned), so the model evaluated is the model saved.
"""

from distsgd.algorithms.param_server.core import ParameterServer, staleness_stats
from distsgd.algorithms.param_server.rules import dc_lambda
from distsgd.algorithms.param_server.worker import ASGD, DCASGD, SSP, ServerAlgorithm, ServerTopology, SyncPS

__all__ = [
    "ParameterServer",
    "staleness_stats",
    "dc_lambda",
    "ServerAlgorithm",
    "ServerTopology",
    "ASGD",
    "SyncPS",
    "SSP",
    "DCASGD",
]
