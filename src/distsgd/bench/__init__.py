"""distsgd bench: run algorithms side by side, one after another, and report them.

``run_bench(...)`` runs every (algorithm, workers, repeat) configuration sequentially, each in its
own run directory, then writes ``bench.json`` (every summary plus the derived figures), ``bench.md``
(a table of medians with min-max over repeats) and PNG plots. See :mod:`.report`.

``compare_runs(...)`` (distsgd compare) writes the same table and plots for runs that already
exist, from their run directories: :mod:`.compare`.
"""

from distsgd.bench.compare import compare_runs
from distsgd.bench.runner import AlgoSpec, parse_algos, run_bench

__all__ = ["AlgoSpec", "parse_algos", "run_bench", "compare_runs"]
