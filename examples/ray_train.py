"""distsgd on a Ray cluster: each Ray Train worker is one rank of the run.

    python examples/ray_train.py                           # a local Ray cluster: allreduce, 2 workers
    python examples/ray_train.py --algo asgd               # a server and 2 workers: 3 Ray workers
    python examples/ray_train.py --dataset /data/my.npz    # any --dataset distsgd reads
    RAY_ADDRESS=HEAD:6379 python examples/ray_train.py --workers 8 --storage s3://bucket/runs

Ray Train's TorchTrainer forms the torch process group in every worker before it calls
train_loop_per_worker; distsgd.train joins that group, trains this rank and leaves the group as
it was. Rank 0 writes the run directory (summary.json, metrics.jsonl, model.pt) and hands it to
Ray as the run's checkpoint, with the final figures as its metrics, so the driver gets both from
the result wherever the workers ran. Needs `pip install 'distsgd[ray]'`.
"""

import argparse
import os
import tempfile

import ray
import ray.train
from ray.train.torch import TorchTrainer

import distsgd
from distsgd.algorithms import registry


def train_loop_per_worker(config: dict) -> None:
    """One Ray worker: one rank of the run (under a parameter server, rank 0 serves)."""
    rank = ray.train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "run")  # rank 0's, handed to Ray below; the others write nothing
        result = distsgd.train(
            model="mlp", data=config["data"], algo=config["algo"], max_samples=12_000, lr=0.05, out=out, quiet=True
        )
        metrics = {k: result.summary[k] for k in ("final_test_accuracy", "samples_per_s", "workers")}
        run = ray.train.Checkpoint.from_directory(out) if rank == 0 else None
        ray.train.report(metrics, checkpoint=run)  # every worker reports; Ray keeps rank 0's metrics


if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--algo", default="allreduce")
    parser.add_argument("--dataset", default="fashion-mnist", help="as distsgd train's --dataset")
    parser.add_argument("--workers", type=int, default=2, help="training workers (a parameter server adds a rank)")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--storage", default=None, help="where Ray keeps the run (default: ~/ray_results)")
    args = parser.parse_args()
    serves = registry.get(args.algo).topology.kind == "server"  # asgd, sync-ps, ssp, dcasgd
    ray.init()  # RAY_ADDRESS: a running cluster; else a local one on this machine
    result = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"algo": args.algo, "data": args.dataset},
        scaling_config=ray.train.ScalingConfig(
            num_workers=args.workers + serves, resources_per_worker={"CPU": args.cpus_per_worker}
        ),
        run_config=ray.train.RunConfig(storage_path=args.storage, name=f"distsgd-{args.algo}"),
    ).fit()
    print(
        f"{args.algo} on Ray, {result.metrics['workers']} workers: test accuracy "
        f"{result.metrics['final_test_accuracy']:.4f}, {result.metrics['samples_per_s']:.0f} samples/s; "
        f"the run directory: {result.checkpoint.path}"
    )
