"""Every algorithm declares its state where the class is: each attribute its methods set on
``self`` is annotated in the class body (or a base's), so a reader finds all of it there, typed,
rather than first in ``setup`` or ``finish``. The parameter server's rules likewise."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

from distsgd.algorithms import registry  # noqa: F401  (imports, so registers, every algorithm)
from distsgd.algorithms.base import Algorithm
from distsgd.algorithms.param_server.rules import Rule


def _subclasses(root: type) -> list[type]:
    found, todo = [], [root]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted({c for c in found if c.__module__.startswith("distsgd.")}, key=lambda c: c.__qualname__)


def _targets(node: ast.expr) -> list[ast.expr]:
    return [t for e in node.elts for t in _targets(e)] if isinstance(node, (ast.Tuple, ast.List)) else [node]


def assigned(cls: type) -> set[str]:
    """The names ``self.NAME = ...`` (or ``+=``) sets in the class's own methods."""
    names = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in _targets(target)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        names |= {
            t.attr
            for t in targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
        }
    return names


def declared(cls: type) -> set[str]:
    return {name for c in cls.__mro__ for name in inspect.get_annotations(c)}


@pytest.mark.parametrize("cls", _subclasses(Algorithm) + _subclasses(Rule), ids=lambda c: c.__qualname__)
def test_every_attribute_an_algorithm_sets_is_declared_in_its_class(cls: type) -> None:
    undeclared = assigned(cls) - declared(cls)
    assert not undeclared, f"{cls.__qualname__} sets {sorted(undeclared)} without declaring them in its class body"


def test_the_check_sees_an_undeclared_attribute() -> None:
    class Sloppy(Algorithm):
        counted: int

        def setup(self, ctx, model, start):
            self.counted, (self.rounds, self.items[0]) = 0, (0, 1)
            self.total += 1
            return model

    assert assigned(Sloppy) - declared(Sloppy) == {"rounds", "total"}


GROUP = {"bytes_sent", "sent_alike", "eval_share", "largest"}


@pytest.mark.parametrize(
    "algo, options, keys",
    [
        ("allreduce", {}, GROUP),
        ("allreduce", {"compress": "powersgd:1"}, GROUP | {"compressor"}),
        ("ddp", {}, GROUP),
        ("local-sgd", {"sync_every": 2}, GROUP | {"averagings", "period"}),
        ("local-sgd", {"sync_every": 2, "compress": "fp16"}, GROUP | {"averagings", "period", "compressor", "anchor"}),
        ("diloco", {"sync_every": 2}, GROUP | {"rounds", "period", "global", "outer", "compressor"}),
        ("streaming-diloco", {"sync_every": 4}, GROUP | {"rounds", "flight", "periods", "thetas", "outers", "global"}),
        # center_ints since --min-workers (a survivor takes the centre's counters too); read if present
        ("easgd", {"tau": 2}, GROUP | {"center", "center_ints", "period"}),
    ],
)
def test_a_checkpoint_holds_the_keys_it_always_held(group_of_one, algo: str, options: dict, keys: set) -> None:
    """The checkpoint's layout, key for key, as written before the state was declared in the class
    bodies (and still read back into a fresh worker): a checkpoint of an earlier run resumes."""
    from types import SimpleNamespace

    from distsgd.config import RunConfig, resolve
    from distsgd.train.context import Start, Step

    cfg = resolve(RunConfig(algo=algo, workers=1, options=options))
    cls = registry.class_for(algo, cfg)
    ctx = SimpleNamespace(
        world=1, rank=0, device=torch.device("cpu"), job=SimpleNamespace(optimizer=None, param_groups=None, main=None)
    )

    def worker() -> tuple[Algorithm, torch.nn.Module]:
        torch.manual_seed(0)
        algo_obj = cls(cfg)
        return algo_obj, algo_obj.setup(ctx, torch.nn.Linear(6, 4), Start.FRESH)

    trained, model = worker()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for number in range(1, 4):
        model(torch.ones(2, 6)).sum().backward()
        step = Step(number=number, samples=2 * number)
        trained.after_backward(ctx, model, step)
        trained.apply_step(ctx, optimizer, step)
        trained.after_step(ctx, model, step)
    saved = trained.state_dict()
    assert set(saved) == keys
    resumed, _ = worker()
    resumed.load_state_dict(saved)
    assert set(resumed.state_dict()) == keys
    if algo == "easgd":  # a checkpoint written before center_ints was kept still resumes
        worker()[0].load_state_dict({k: v for k, v in saved.items() if k != "center_ints"})
