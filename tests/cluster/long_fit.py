"""Run across the box: a 2 × 2 hf.fit that lasts (a pause per step), saying each step it ends."""

import time

import hyparflow as hf  # isort: skip  (before TensorFlow)
import keras
import numpy as np
from mpi4py import MPI


def main():
    rank = MPI.COMM_WORLD.Get_rank()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, name="d0"),
                              keras.layers.Dense(8, name="d1"), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(64, 5)).astype("float32")
    y = x[:, :3] * 2.0

    def said(batch, logs):
        print(f"STEP {rank} {batch} ON {MPI.Get_processor_name()}", flush=True)
        time.sleep(0.2)

    hf.fit(model, x, y, partitions=2, replicas=2, batch_size=16, epochs=200, verbose=0,
           callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=said)])
    print(f"FINISHED {rank}", flush=True)


if __name__ == "__main__":
    main()
