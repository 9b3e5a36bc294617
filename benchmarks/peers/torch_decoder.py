"""PyTorch peer of benchmarks/transformer.py: the GPT-2-shaped decoder trained in one process,
or with torch.distributed.pipelining on CPU.

Usage (with the venv from benchmarks/peers/setup_torch.sh):

    .venv-torch/bin/python benchmarks/peers/torch_decoder.py --mode single
    .venv-torch/bin/python benchmarks/peers/torch_decoder.py --mode pipeline --schedule 1f1b \\
        --ranks 2 --microbatches 4

The batches are transformer.py's (`transformer.batches`: the same seed, lengths and tokens).
One process trains each at its own length; pipelining's stages take one shape for every step
(`PipelineStage` sizes its receive buffers once; variable lengths are not supported:
pytorch/pytorch#159942), so there each batch is padded to the longest length, its padding
left out of the loss. The rate counts the same tokens in both (each batch at its own length).
The model: token and position embeddings, pre-LayerNorm blocks (causal attention, a GELU MLP
of 4 × width), a final LayerNorm and a head to the vocabulary — keras-hub's GPT2CausalLM's
layers and sizes; its head is tied to the token embedding, here a separate matrix of the
same shape (pipelining cannot tie weights across stages), the same arithmetic. Right padding
under causal attention changes no real token's output, so no padding mask is applied. SGD
0.01 with momentum 0.9, one intra-op and one inter-op thread a process. One warm-up pass,
then --reps timed passes; a pipeline pass's time is the maximum over ranks (the ResNet peer's
`pipeline_rank`). stdout gets one `RESULT {json}` line.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from torch_pipeline import (  # noqa: E402
    RESULT_PREFIX,
    SCHEDULES,
    dispatch,
    one_thread,
    peak_rss_mib,
    pipeline_rank,
    timed,
)
from transformer import batches  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--mode", choices=["single", "pipeline"], required=True)
    p.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    for name, default in (("layers", 12), ("width", 128), ("heads", 4), ("vocabulary", 4096),
                          ("batch-size", 16), ("steps", 8), ("reps", 3), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lengths", default="32,128")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--_rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result-file", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build(args):
    """[embeddings, block, ..., block, head] as nn.Modules, alike on every rank."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    d, longest = args.width, int(args.lengths.split(",")[1])

    class Embeddings(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(args.vocabulary, d), nn.Embedding(longest, d)

        def forward(self, ids):
            return self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
            self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, args.heads, -1).permute(
                2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(b, n, d))
            return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.logits = nn.LayerNorm(d, eps=1e-5), nn.Linear(d, args.vocabulary,
                                                                          bias=False)

        def forward(self, x):
            return self.logits(self.norm(x))

    torch.manual_seed(args.seed)
    return [Embeddings()] + [Block() for _ in range(args.layers)] + [Head()]


def data(args, pad):
    """transformer.py's batches as tensors: (ids, targets with -100 where padded), padded to
    `pad` tokens (None: each at its own length)."""
    import numpy as np
    import torch

    out = []
    made, tokens = batches(args)
    for x, y, mask in made:
        ids, targets = x["token_ids"], np.where(mask > 0, y, -100)
        if pad is not None:
            extra = pad - ids.shape[1]
            ids = np.pad(ids, ((0, 0), (0, extra)))
            targets = np.pad(targets, ((0, 0), (0, extra)), constant_values=-100)
        out.append((torch.from_numpy(ids.astype(np.int64)),
                    torch.from_numpy(targets.astype(np.int64))))
    return out, tokens


def loss_fn(logits, targets):
    from torch.nn import functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=-100)


def result(args, seconds, first, rss, tokens):
    import torch

    rates = [tokens / s for s in seconds]
    return {"peer": "torch", "mode": args.mode, "schedule": args.schedule,
            "microbatches": args.microbatches, "seconds": seconds, "tokens_per_s": rates,
            "median_tokens_per_s": statistics.median(rates), "first_call_s": first,
            "peak_rss_mib": rss, "torch": torch.__version__}


def run_single(args):
    one_thread()
    import torch
    from torch import nn

    model = nn.Sequential(*build(args)).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    steps, tokens = data(args, None)

    def train_pass():
        for ids, targets in steps:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(ids), targets).backward()
            opt.step()

    start = time.perf_counter()
    train_pass()  # warm-up
    first = time.perf_counter() - start
    seconds = timed(train_pass, args.reps)
    print(RESULT_PREFIX + json.dumps(result(args, seconds, first, [peak_rss_mib()], tokens)),
          flush=True)


def run_rank(args):
    one_thread()
    import torch

    steps, tokens = data(args, int(args.lengths.split(",")[1]))
    pipeline_rank(args, build(args),
                  lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9), loss_fn,
                  steps, lambda seconds, first, rss, split: result(args, seconds, first, rss,
                                                                   tokens))


def main(argv=None):
    return dispatch(argv, parse_args, run_single, run_rank, script=__file__)


if __name__ == "__main__":
    sys.exit(main())
