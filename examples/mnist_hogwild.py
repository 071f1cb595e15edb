"""PyTorch's ``mnist_hogwild`` example (pytorch/examples), converted to distsgd's Hogwild!.

    python examples/mnist_hogwild.py                       # 2 processes, each 2 epochs of 8,000 images
    python examples/mnist_hogwild.py --num-processes 4 --epochs 10 --train-size 60000   # the original's run
    python examples/mnist_hogwild.py --partition sharded   # each process a share of each epoch

What changed from the torch.multiprocessing version (Net, train_epoch and test keep their shape):
- ``model.share_memory()`` and the ``mp.Process(target=train, ...)`` / ``join()`` loop became one
  call, ``distsgd.spawn(partial(train, args=args), model=Net, algo="hogwild", workers=...)``;
  ``train(rank, args, model)`` became ``train(run, args)``, and the test runs after it on
  ``result.model``, the shared model every process trained, as before.
- ``run.setup()`` binds this process's model to the shared weights and gives the optimiser
  (``spawn(optimizer=...)``, the original's SGD) whose ``step()`` writes them, lock-free;
  ``loss.backward()`` became ``run.backward(loss)``. ``--algo`` runs the same script under any
  other algorithm (asgd's server steps with that optimiser; allreduce averages the gradients).
- ``DataLoader(dataset, shuffle=True)`` became ``run.loader(dataset, batch_size, epoch)``; with
  ``partition="replicated"`` every process sees the whole set in its own order, as in the
  original (``sharded``, distsgd's default, splits each epoch between the processes).
- The data is Fashion-MNIST, bundled with distsgd (no download, no torchvision), already
  normalised. ``--train-size`` 8,000 and ``--lr`` 0.03 (the original: 60,000 and 0.01, for 10
  epochs) keep the run under a minute on 2 cores.
"""

import argparse
import os
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
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def datasets(train_size: int) -> tuple[TensorDataset, TensorDataset]:
    fashion = load_dataset("fashion-mnist")
    return (
        TensorDataset(fashion.x_train[:train_size], fashion.y_train[:train_size]),
        TensorDataset(fashion.x_test, fashion.y_test),
    )


def sgd(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)


def train(run: distsgd.Run, args: argparse.Namespace) -> nn.Module:
    """One Hogwild! process (``run.rank``): every process runs it on the same shared model."""
    train_set, _ = datasets(args.train_size)
    model, optimizer = run.setup()  # the shared model, and the optimiser spawn(optimizer=...) makes
    for epoch in range(1, args.epochs + 1):
        train_epoch(epoch, args, run, model, train_set, optimizer)
    return run.final_model()


def train_epoch(
    epoch: int,
    args: argparse.Namespace,
    run: distsgd.Run,
    model: nn.Module,
    dataset: TensorDataset,
    optimizer: torch.optim.Optimizer,
) -> None:
    model.train()
    pid = os.getpid()
    per_process = len(dataset) if run.cfg.partition == "replicated" else len(dataset) // run.world
    for batch_idx, (data, target) in enumerate(run.loader(dataset, args.batch_size, epoch=epoch - 1)):
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        run.backward(loss)
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print(
                f"{pid}\tTrain Epoch: {epoch} [{batch_idx * len(data)}/{per_process} "
                f"({100.0 * batch_idx * len(data) / per_process:.0f}%)]\tLoss: {loss.item():.6f}",
                flush=True,
            )


def test(args: argparse.Namespace, model: nn.Module, dataset: TensorDataset) -> tuple[float, float]:
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in torch.utils.data.DataLoader(dataset, batch_size=args.test_batch_size):
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += (output.argmax(1) == target).sum().item()
    test_loss /= len(dataset)
    print(
        f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(dataset)} "
        f"({100.0 * correct / len(dataset):.0f}%)\n"
    )
    return test_loss, correct / len(dataset)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description="PyTorch MNIST Hogwild! example, on distsgd (Fashion-MNIST)"
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--test-batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=40)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--train-size", type=int, default=8000)
    parser.add_argument("--partition", default="replicated", choices=["replicated", "sharded"])
    parser.add_argument("--out", default=None, help="a run directory (summary.json, model.pt)")
    parser.add_argument("--algo", default="hogwild", help="or any other: asgd, allreduce, local-sgd, diloco, ...")
    args = parser.parse_args()

    result = distsgd.spawn(
        partial(train, args=args),
        model=Net,
        optimizer=partial(sgd, args=args),
        algo=args.algo,
        workers=args.num_processes,
        partition=args.partition,
        seed=args.seed,
        epochs=args.epochs,
        train_size=args.train_size,
        out=args.out,
        quiet=True,
    )
    # Once training is complete, we can test the model
    _, accuracy = test(args, result.model, datasets(args.train_size)[1])
    print(f"{args.algo}: test accuracy {accuracy:.4f}, {result.summary['samples_per_s']:.0f} samples/s")
