"""A loop with the habits of a real script: two optimisers, a schedule, clipping, accumulation.

    python examples/two_optimizers.py                      # allreduce, 2 workers on this machine
    python examples/two_optimizers.py --algo local-sgd     # or ddp, hogwild, easgd

``run.setup`` takes one function per optimiser and returns the model with both optimisers (a
model and optimisers you built yourself work too, Lightning Fabric's way, except under hogwild,
whose shared model is spawn's): the body learns with SGD and a cosine schedule, the head with Adam. Each step accumulates two micro-batches (the first under ``run.no_sync()``,
a speed-up only), clips the gradient norm and steps both optimisers. Every habit here takes
effect as in one process: the gradients ``run.backward`` leaves are the ones the steps apply
(docs/OWN_LOOP.md: "Habits of your own loop"). The parameter-server algorithms (asgd, sync-ps, ssp, dcasgd)
step one optimiser on the server, whose lr, momentum, betas and weight decay each push carries,
and refuse two in one line, saying so.

Fashion-MNIST (bundled with distsgd), the first 12,000 training images, two epochs: under a
minute on 2 cores.
"""

import argparse
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import distsgd
from distsgd.data import load_dataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def data() -> tuple[TensorDataset, TensorDataset]:
    fashion = load_dataset("fashion-mnist")
    return (
        TensorDataset(fashion.x_train[:12000], fashion.y_train[:12000]),
        TensorDataset(fashion.x_test, fashion.y_test),
    )


def final_figures(model: nn.Module) -> dict:
    """The test accuracy of the model the run returns (distsgd calls it once, at the end)."""
    x, y = data()[1].tensors
    where = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        return {"test_accuracy": (model(x.to(where)).argmax(1) == y.to(where)).float().mean().item()}


def main(run: distsgd.Run, epochs: int, micro: int) -> nn.Module:
    train_set, _ = data()
    model, body, head = run.setup(  # spawn's model, and one optimiser per function
        lambda m: torch.optim.SGD(m.body.parameters(), lr=0.1, momentum=0.9),
        lambda m: torch.optim.Adam(m.head.parameters(), lr=1e-3),
    )
    steps = epochs * len(train_set) // (run.world * 2 * micro)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(body, T_max=max(1, steps))
    for epoch in range(epochs):
        batches = iter(run.loader(train_set, batch_size=micro, epoch=epoch))
        for first, second in zip(batches, batches):  # two micro-batches a step
            body.zero_grad()
            head.zero_grad()
            with run.no_sync():  # the first micro-batch's gradient waits for the second's
                run.backward(F.cross_entropy(model(first[0]), first[1]) / 2)
            loss = F.cross_entropy(model(second[0]), second[1]) / 2
            run.backward(loss)  # the algorithm's gradient, all micro-batches', every worker's
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            body.step()
            head.step()
            schedule.step()
            run.log(loss=2 * loss, lr=schedule.get_last_lr()[0])
    return run.final_model()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--algo", default="allreduce")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    try:
        result = distsgd.spawn(
            partial(main, epochs=args.epochs, micro=args.micro_batch),
            model=Net,
            algo=args.algo,
            workers=args.workers,
            epochs=args.epochs,
            out=args.out,
            evaluate=final_figures,
            quiet=True,
        )
    except distsgd.DistsgdError as exc:  # a setting or habit refused: its one line, as distsgd's command says it
        raise SystemExit(f"error: {exc}") from None
    if result.model is not None:  # under torchrun, rank 0 has the run's figures
        print(
            f"{args.algo}: test accuracy {result.summary['final_test_accuracy']:.4f}, "
            f"{result.summary['samples_per_s']:.0f} samples/s"
        )
