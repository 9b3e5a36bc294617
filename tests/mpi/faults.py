"""Run under mpiexec: inject one fault on one rank at one step; the job must end, with reasons.

    faults.py --fault exception --rank 1 --step 2     # raise in a callback
    faults.py --fault layer --rank 1                   # a layer of stage 1 raises when traced
    faults.py --fault kill --rank 1 --step 2           # SIGKILL mid-step
    faults.py --fault mismatch --rank 0 --step 2       # rank 0 tags a message wrongly
    faults.py --fault nan --step 3                     # NaN loss at step 3, TerminateOnNaN
    faults.py --fault samples --rank 1                 # rank 1 passes fewer samples
    faults.py --fault shuffle                          # tf.data shuffled with a seed per rank
    faults.py --fault after --rank 1                   # raise after fit, the others in hf.save
    faults.py --fault save --rank 0 --timeout 3        # only rank 0 calls hf.save
    faults.py --fault unwritable                        # every rank's hf.save fails alike
    faults.py --fault leave-save --rank 0               # rank 0 calls hf.save, rank 1 ends
    faults.py --fault leave-fit --rank 0                # rank 0 calls hf.fit, rank 1 ends
    faults.py --fault save-evaluate --rank 0            # rank 0 saves alone, all evaluate
    faults.py --fault label --step 2                    # a label out of range at step 2

``--step-graph``: each step one graph (hf.Schedule(step_graph=True)), the waits inside it.

Every rank prints ``STEPS <rank> <n>`` if its fit returns. ``--plain`` calls
hf.fit inside a try/except that swallows the error, as a larger program might:
the job must end anyway.
"""

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

import hyparflow as hf
import models


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", required=True,
                   choices=["exception", "layer", "kill", "mismatch", "nan", "samples",
                            "shuffle", "after", "save", "auto", "unwritable", "leave-save",
                            "leave-fit", "label", "save-evaluate",
                            "save-in-fit"])
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--step", type=int, default=2)
    p.add_argument("--partitions", type=int, default=2)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--step-graph", action="store_true", help="hf.Schedule(step_graph=True)")
    p.add_argument("--swallow", action="store_true",
                   help="call hf.fit inside try/except Exception: pass")
    args = p.parse_args()

    import keras
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    hit = rank == args.rank
    keras.utils.set_random_seed(0)
    if args.fault == "layer":
        class Broken(keras.layers.Layer):
            def call(self, x):
                if hit:
                    raise ValueError(f"injected failure in a layer on rank {rank}")
                return x

            def compute_output_shape(self, shape):
                return shape

        x = keras.Input((5,), name="x")
        h = keras.layers.Dense(8, name="d0")(x)
        h = keras.layers.Dense(8, name="d1")(h)
        h = Broken(name="broken")(h)
        model = keras.Model(x, keras.layers.Dense(3, name="head")(h))
    else:
        model = models.chain(n=4)
    n = 96 if not (args.fault == "samples" and hit) else 88
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 5)).astype("float32")
    y = rng.normal(size=(n, 3)).astype("float32")
    if args.fault == "label":  # 3 classes, and a label 3 in step `step` (batch 8, no shuffle)
        y = rng.integers(0, 3, size=n)
        y[args.step * 8 + 1] = 3
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
    else:
        model.compile(optimizer="sgd", loss="mse")
    callbacks = []
    timeout = args.timeout
    if args.fault == "exception":
        def explode(batch, logs):
            if hit and batch == args.step:
                print(f"FAULT {time.time():.3f}", flush=True)
                raise RuntimeError(f"injected failure on rank {rank} at step {batch}")
        callbacks.append(keras.callbacks.LambdaCallback(on_train_batch_begin=explode))
    elif args.fault == "kill":
        def kill(batch, logs):
            if hit and batch == args.step:
                print(f"FAULT {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        callbacks.append(keras.callbacks.LambdaCallback(on_train_batch_begin=kill))
    elif args.fault == "mismatch":
        from hyparflow.mpi import comm

        real_tag = comm.tag
        step = {"n": 0}

        def count(batch, logs):
            step["n"] = batch
            if hit and batch == args.step:
                print(f"FAULT {time.time():.3f}", flush=True)

        def wrong_tag(*tag_args):
            t = real_tag(*tag_args)
            return t + 1000 if hit and step["n"] == args.step else t

        comm.tag = wrong_tag
        callbacks.append(keras.callbacks.LambdaCallback(on_train_batch_begin=count))
        # Only the receiving side's watchdog should fire: the sender waits longer.
        timeout = args.timeout if not hit else 10 * args.timeout
    elif args.fault == "nan":
        x[args.step * 8 + 3, 0] = np.nan  # one sample of step `step` (batch 8, no shuffle)
        callbacks.append(keras.callbacks.TerminateOnNaN())
    elif args.fault == "save-in-fit":  # a callback of the user's saving on one rank only
        import tempfile

        path = os.path.join(tempfile.mkdtemp(), "model.keras")

        def save(epoch, logs):
            if hit:
                print(f"FAULT {time.time():.3f}", flush=True)
                model.save(path)
        callbacks.append(keras.callbacks.LambdaCallback(on_epoch_end=save))

    data = (x, y)
    if args.fault == "shuffle":  # each rank its own order (a Horovod habit): hf must catch it
        import tensorflow as tf

        data = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(96, seed=rank).batch(8),
                None)

    partitions = args.partitions
    if args.fault == "auto" and hit:  # one rank asks the planner, the other gives a number
        partitions = "auto"
    done = []
    callbacks.append(keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: done.append(batch)))
    start = time.monotonic()
    if args.fault == "leave-fit":  # the Horovod habit for a second fit: on one rank only
        print(f"FAULT {time.time():.3f}", flush=True)
        if not hit:
            return  # the end of this rank's script (the default timeout: 600 s)
    try:
        hf.fit(model, *data, partitions=partitions, replicas=args.replicas, batch_size=8,
               epochs=1, verbose=0, shuffle=False, callbacks=callbacks, timeout=timeout,
               schedule=hf.Schedule(step_graph=args.step_graph))
    except ValueError as exc:
        if args.fault not in ("samples", "auto"):
            raise
        print(f"rank {rank} raised: {exc}", flush=True)  # on every rank, then a clean exit
        sys.exit(3)
    except Exception as exc:
        if not args.swallow:
            raise
        print(f"SWALLOWED {rank} {type(exc).__name__}", flush=True)
        time.sleep(120)  # a larger program going on; the job must be ended from inside fit
    print(f"STEPS {rank} {len(done)} {time.monotonic() - start:.1f}", flush=True)
    if args.fault == "save":  # the Horovod habit: save from rank 0 only
        if hit:
            import tempfile

            print(f"FAULT {time.time():.3f}", flush=True)
            hf.save(model, os.path.join(tempfile.mkdtemp(), "model.keras"))
            print(f"SAVED {rank}", flush=True)
        else:
            time.sleep(120)  # the rest of a script, while rank 0 waits for it in hf.save
    if args.fault == "leave-save":  # rank 0 saves alone, with the default timeout
        print(f"FAULT {time.time():.3f}", flush=True)
        if hit:
            import tempfile

            hf.save(model, os.path.join(tempfile.mkdtemp(), "model.keras"))
            print(f"SAVED {rank}", flush=True)
    if args.fault == "save-evaluate":  # rank 0 saves alone, then every rank evaluates
        import tempfile

        print(f"FAULT {time.time():.3f}", flush=True)
        try:
            if hit:
                hf.save(model, os.path.join(tempfile.mkdtemp(), "model.keras"))
            hf.evaluate(model, x, y, partitions=args.partitions, replicas=args.replicas,
                        batch_size=8, verbose=0)
        except ValueError as exc:  # the job stays healthy: every rank's caller gets it
            print(f"CAUGHT {rank} {exc}", flush=True)
    if args.fault == "unwritable":  # a folder where a file is: fails alike on every rank
        import tempfile

        here = tempfile.mkdtemp()
        open(os.path.join(here, "afile"), "w").close()
        print(f"FAULT {time.time():.3f}", flush=True)
        hf.save(model, os.path.join(here, "afile", "model.keras"))
    if args.fault == "after":  # outside hf.fit: only the abort hook can end the job
        if hit:
            print(f"FAULT {time.time():.3f}", flush=True)
            raise RuntimeError(f"injected failure after fit on rank {rank}")
        import tempfile

        hf.save(model, os.path.join(tempfile.mkdtemp(), "model.keras"))  # waits for rank 1
        print(f"SAVED {rank}", flush=True)


if __name__ == "__main__":
    main()
