"""Multi-rank tier: set-ups that used to train a different model than model.fit, silently.

One launch per job size runs every scenario of numerics.py (launches cost more
than the scenarios): the optimizer state carried through model.fit and hf.fit
at changing P × R, ranks seeded differently, a rank with another model, a head
without gradients, lazily built metrics, bfloat16 and float16 mixed precision; and
Model.fit's contract (contract.py): the model's own steps, steps_per_execution, a
callback that interrupts training on every rank, generators and PyDatasets, a
callback of the user's own touching other stages' weights at every batch, losses
reduced over the whole batch.
"""

import re

import pytest

from mpi.launch import launch

SCENARIOS = ("seeds", "structure", "unbuilt", "ragged", "aggregated", "norms", "unused", "f1",
             "options", "sparse", "few", "bfloat16", "float16", "own_steps", "per_execution",
             "interrupted", "sources", "batch_callbacks", "reductions")  # the last six: contract.py
# what a sharded optimizer ("z" configurations) must get right besides the sequence: no
# gradient, every optimizer option (global_clipnorm, EMA, ...), sparse rows, replicas without
# samples, mixed precision
SHARDED = ("unused", "options", "sparse", "few", "bfloat16", "float16")
# what each step as one graph ("g" configurations, step_graph=True) must get right besides the
# sequence: the same, a layer's own state and metrics, metrics built lazily
STEP_GRAPH = ("aggregated", "f1") + SHARDED
# what the interleaved schedule ("i" configurations, two stages a rank) must get right: the
# same, and the contract's compute_loss overrides (a last batch of one sample: m < P) and
# reductions
INTERLEAVED = STEP_GRAPH + ("own_steps", "reductions")


@pytest.mark.parametrize("ranks, sequence, configs", [
    # a fresh model: pipelined, then data parallel, then interleaved (and so with each step
    # one graph: "ig"), then model.fit
    # each step one graph ("g", step_graph=True) at two stages; the interleaved schedule ("i",
    # two stages a rank)
    # the zero-bubble schedule ("w", with the step graph: each backward split in B and W)
    (2, "2x1,1x2,2x1i,2x1ig,2x1gw,fit", "2x1,1x2,2x1g,2x1i,2x1gw"),
    # the sequence, then the optimizer's state sharded over replicas ("z",
    # shard_optimizer=True) at one and two stages, and each step one graph at four stages
    # and at two stages of two replicas (gradient buckets), and interleaved over two replicas
    # (also sharded: "iz")
    (4, "fit,2x2,4x1,4x1g,2x2g,2x2i,2x2iz,1x4,1x4z,2x2z,fit", "2x2,4x1,2x2z"),
])
def test_hf_fit_trains_what_model_fit_trains(ranks, sequence, configs):
    # the 4-rank launch takes ~300 s on a quiet machine and took 413 s beside another job
    code, out, err, _ = launch(ranks, "numerics.py", sequence, configs, *SCENARIOS, timeout=600)
    assert code == 0, f"exit {code}\n{out}\n{err[-5000:]}"
    assert out.count(f"OK sequence {sequence}") == ranks, out

    def done(name, config):  # "OK f1 2x2" lines, not "OK f1 2x2z" ones
        return len(re.findall(rf"^OK {name} {config}(?![\w])", out, re.MULTILINE))

    for config in configs.split(","):
        only = {"z": SHARDED, "g": STEP_GRAPH, "i": INTERLEAVED, "w": STEP_GRAPH}
        for scenario in [s for s in SCENARIOS
                         if all(s in only[k] for k in config.lstrip("0123456789x"))]:
            name = f"mixed_{scenario}" if scenario in ("bfloat16", "float16") else scenario
            assert done(name, config) == ranks, (scenario, config, out)
        assert done("bfloat16", config) == ranks, (config, out)  # bfloat16 variables
        assert done("summed_in_half", config) == ranks, (config, out)
