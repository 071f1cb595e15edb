"""A Hugging Face ``transformers`` language model trained with DiLoCo, in your own loop: dict
batches, ``loss = model(**batch).loss``, your own evaluation.

    pip install 'distsgd[hf]'                              # transformers
    python examples/hf_diloco.py                           # diloco: 2 workers, an outer step every 8 steps
    python examples/hf_diloco.py --algo allreduce          # the same loop under another algorithm

The model is GPT-2's architecture at a toy size, built from a config (random weights: nothing is
downloaded); the text is Python's standard library as bytes (token ids 0-255), cut into
sequences of 64. Each worker takes 8 inner AdamW steps on its shard, then the workers average
their pseudo-gradients and take DiLoCo's outer Nesterov step. The figure printed is the test
loss per token in nats (a uniform guess over 256 bytes scores ln 256 = 5.55; a guess from the
bytes' frequencies alone about 2.9) of the model the run returns, on text the workers never saw.
"""

import argparse
import math

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

import distsgd
from distsgd.data.text import stdlib_text

CONTEXT = 64
TRAIN_BYTES, TEST_BYTES = 192 * 1024, 32 * 1024


def tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=64,
        vocab_size=256,
        n_positions=CONTEXT,
        bos_token_id=ord("\n"),
        eos_token_id=ord("\n"),
    )
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # its class name does not tell transformers which loss (else a warning)
    return model


class ByteSequences(Dataset):
    """Non-overlapping sequences of ``CONTEXT`` bytes; each item a dict, as a tokeniser gives:
    the model shifts ``labels`` by one itself."""

    def __init__(self, data: bytes) -> None:
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.rows = tokens[: len(tokens) // CONTEXT * CONTEXT].view(-1, CONTEXT)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def corpus() -> tuple[ByteSequences, ByteSequences]:
    text = stdlib_text(TRAIN_BYTES + TEST_BYTES)
    return ByteSequences(text[:TRAIN_BYTES]), ByteSequences(text[TRAIN_BYTES:])


def test_loss(model: nn.Module, test_set: ByteSequences) -> float:
    """Mean loss per predicted token over the whole test set."""
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(test_set), 64):
            ids = test_set.rows[start : start + 64]
            n = ids.numel() - len(ids)  # every position but the first of each row is predicted
            total += model(input_ids=ids, labels=ids).loss.item() * n
            tokens += n
    return total / tokens


def main(run: distsgd.Run) -> nn.Module:
    train_set, test_set = corpus()
    model, opt = run.setup()  # DiLoCo's inner AdamW at lr=, weight_decay=
    for epoch in range(run.cfg.epochs):
        for batch in run.loader(train_set, batch_size=16, epoch=epoch):
            opt.zero_grad()
            loss = model(**batch).loss
            run.backward(loss)
            opt.step()  # an inner step; every sync_every steps, the outer step
            run.log(loss=loss)
    final = run.final_model()  # theta after the last outer step, the same in every worker
    if run.rank == 0:
        run.log(test_loss=test_loss(final, test_set))
    return final


if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--algo", default="diloco")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    options = {"sync_every": 8} if args.algo in ("diloco", "streaming-diloco", "local-sgd") else {}
    result = distsgd.spawn(
        main,
        model=tiny_gpt2,
        algo=args.algo,
        workers=args.workers,
        optimizer="adamw",
        lr=1e-3,
        epochs=1,
        train_size=TRAIN_BYTES // CONTEXT,
        out=args.out,
        **options,
    )
    loss = result.summary["final_test_loss"]
    print(
        f"{args.algo}: test loss {loss:.3f} nats per token ({loss / math.log(2):.2f} bits), "
        f"{result.summary['samples_per_s']:.0f} sequences/s"
    )
