"""A plain PyTorch training loop, converted to distsgd: the same loop, any algorithm.

    python examples/plain_loop.py                          # allreduce, 2 workers on this machine
    python examples/plain_loop.py --algo local-sgd --workers 4
    torchrun --standalone --nproc-per-node 2 examples/plain_loop.py   # the same script under torchrun

Fashion-MNIST (bundled with distsgd), the first 12,000 training images, one epoch: under a minute
on 2 cores. Everything but five lines is the loop you would write for one process.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import distsgd
from distsgd.data import load_dataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def data() -> tuple[TensorDataset, TensorDataset]:
    fashion = load_dataset("fashion-mnist")
    return (
        TensorDataset(fashion.x_train[:12000], fashion.y_train[:12000]),
        TensorDataset(fashion.x_test, fashion.y_test),
    )


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def final_figures(model: nn.Module) -> dict:
    """The test accuracy of the model the run returns (distsgd calls it once, at the end)."""
    x, y = data()[1].tensors
    where = next(model.parameters()).device
    return {"test_accuracy": accuracy(model, x.to(where), y.to(where))}


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    """The optimiser, given to spawn: the parameter server steps with it too."""
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def main(run: distsgd.Run) -> nn.Module:
    train_set, test_set = data()
    model, opt = run.setup()  # the model, and the optimiser spawn(optimizer=...) makes
    for epoch in range(run.cfg.epochs):
        for x, y in run.loader(train_set, batch_size=64, epoch=epoch):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            run.backward(loss)
            opt.step()
            run.log(loss=loss)
        evaluated = run.evaluation_model()  # every worker: it may average the replicas
        if run.rank == 0:
            with run.paused():
                run.log(test_accuracy=accuracy(evaluated, *run.to_device(test_set.tensors)))
            evaluated.train()
    return run.final_model()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--algo", default="allreduce")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = distsgd.spawn(
        main,
        model=Net,
        algo=args.algo,
        workers=args.workers,
        epochs=1,
        out=args.out,
        optimizer=sgd,
        evaluate=final_figures,
    )
    if result.model is not None:  # under torchrun, rank 0 has the run's figures
        print(
            f"{args.algo}: test accuracy {result.summary['final_test_accuracy']:.4f}, "
            f"{result.summary['samples_per_s']:.0f} samples/s"
        )
