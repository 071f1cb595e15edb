"""A siamese network (two inputs, a contrastive loss of your own) trained by asynchronous SGD on a
parameter server: distsgd runs any model and any loss, since the algorithm sees only gradients.

    python examples/siamese_asgd.py                        # asgd: a server and 2 workers
    python examples/siamese_asgd.py --algo ssp --workers 3

Each item is a pair of Fashion-MNIST images and whether they show the same kind of garment; the
network embeds both and is trained so that pairs of one kind lie close and others at least
``MARGIN`` apart (Hadsell, Chopra and LeCun 2006). A test pair is called "same" when its distance
is under ``MARGIN / 2``: the figure printed is that call's accuracy on 4,000 test pairs.

Under the parameter server the server steps: its optimiser is ``spawn(optimizer=make_optimizer)``
(or settings such as ``lr=``), not ``run.setup()``'s. A worker's ``run.final_model()`` is that
worker's copy of the server's last weights; the model the run returns and saves is the server's.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import distsgd
from distsgd.data import load_dataset

MARGIN = 1.0
TRAIN_PAIRS, TEST_PAIRS = 16000, 4000


class Siamese(nn.Module):
    """Two images in, the distance between their embeddings out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 128), nn.ReLU(), nn.Linear(128, 32))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.pairwise_distance(self.embed(a), self.embed(b))


def contrastive_loss(distance: torch.Tensor, same: torch.Tensor) -> torch.Tensor:
    return (same * distance.pow(2) + (1 - same) * F.relu(MARGIN - distance).pow(2)).mean()


class Pairs(Dataset):
    """``n`` pairs ``(img_a, img_b, same)`` of ``images``, half of one label, half of two; the same
    pairs in every process (a seeded generator)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = images
        self.a = torch.randint(len(labels), (n,), generator=g)
        self.same = (torch.arange(n) % 2 == 0).float()
        other = (labels[self.a] + torch.randint(1, 10, (n,), generator=g)) % 10  # any label but a's
        label_b = torch.where(self.same.bool(), labels[self.a], other)
        by_label = torch.argsort(labels, stable=True)  # image indices, label 0's first
        count = torch.bincount(labels, minlength=10)
        start = torch.cumsum(count, 0) - count
        pick = (torch.rand(n, generator=g) * count[label_b]).long()
        self.b = by_label[start[label_b] + pick]

    def __len__(self) -> int:
        return len(self.a)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.images[self.a[i]], self.images[self.b[i]], self.same[i]


def pair_datasets() -> tuple[Pairs, Pairs]:
    fashion = load_dataset("fashion-mnist")
    return (
        Pairs(fashion.x_train, fashion.y_train, TRAIN_PAIRS, seed=0),
        Pairs(fashion.x_test, fashion.y_test, TEST_PAIRS, seed=1),
    )


def pair_accuracy(model: nn.Module, pairs: Pairs) -> float:
    model.eval()
    with torch.no_grad():
        a, b, same = (torch.stack(t) for t in zip(*(pairs[i] for i in range(len(pairs)))))
        called_same = (model(a, b) < MARGIN / 2).float()
    return (called_same == same).float().mean().item()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The server's optimiser (module level: the server process builds it)."""
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)


def main(run: distsgd.Run) -> nn.Module:
    train_pairs, test_pairs = pair_datasets()
    model, opt = run.setup()  # the optimiser is the server's: spawn(optimizer=make_optimizer)
    for epoch in range(run.cfg.epochs):
        for a, b, same in run.loader(train_pairs, batch_size=64, epoch=epoch):
            opt.zero_grad()
            loss = contrastive_loss(model(a, b), same)
            run.backward(loss)
            opt.step()  # push the gradient, pull the server's new weights
            run.log(loss=loss)
    return run.final_model()  # every worker calls it once: here, this worker's copy of the server's


def evaluate(model: nn.Module) -> dict:
    """Run by distsgd on the model the run returns and saves (the server's): the final figure."""
    return {"test_accuracy": pair_accuracy(model, pair_datasets()[1])}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--algo", default="asgd", help="asgd, sync-ps, ssp or dcasgd")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = distsgd.spawn(
        main,
        model=Siamese,
        algo=args.algo,
        workers=args.workers,
        optimizer=make_optimizer,
        evaluate=evaluate,
        epochs=2,
        train_size=TRAIN_PAIRS,
        out=args.out,
    )
    print(
        f"{args.algo}: pair accuracy {result.summary['final_test_accuracy']:.4f} (the server's model), "
        f"{result.summary['samples_per_s']:.0f} samples/s"
    )
