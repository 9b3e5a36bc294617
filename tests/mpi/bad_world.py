"""Run under mpiexec with a world size that is not partitions × replicas: must fail everywhere."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

import hyparflow as hf
import models

model = models.chain(n=2)
model.compile(optimizer="sgd", loss="mse")
try:
    hf.fit(model, np.zeros((8, 5)), np.zeros((8, 3)), partitions=2, replicas=2, verbose=0)
except ValueError as exc:
    from mpi4py import MPI

    print(f"rank {MPI.COMM_WORLD.Get_rank()} raised: {exc}", flush=True)
    sys.exit(3)
