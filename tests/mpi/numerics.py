"""Run under mpiexec: set-ups where hf.fit used to differ silently from model.fit.

    numerics.py SEQUENCE CONFIGS [SCENARIO ...]

SEQUENCE is the P×R configurations the optimizer-state scenario passes through,
e.g. "fit,2x2,4x1,1x4,fit" ("fit" is model.fit in each process). The other
scenarios run at each of CONFIGS (e.g. "2x1,1x2"):

    seeds       ranks build the model with different seeds: all train rank 0's model
    structure   one rank's model has another width / an extra layer: one clear error
    aggregated  a layer's own counters and totals: merged over replicas by `aggregation`
    unbuilt     a Sequential without an input shape: built from the data, then cut
    ragged      targets a tf.RaggedTensor, read by a loss that pads them
    few         batches with fewer samples than replicas (batch_size 1, one sample, a last
                batch smaller than R; sparse gradients; a model's own train_step); with
                synchronized BatchNormalization, trained or refused
    norms       BatchNormalization: synchronized over replicas; moving statistics once a
                step from the pooled moments of its micro-batches
    unused      an auxiliary head compiled with loss None: its variables get no gradient
    f1          F1Score / FBetaScore (metrics that build their state lazily)
    options     global_clipnorm (clips by the norm over all stages), clipnorm, clipvalue,
                loss_scale_factor, use_ema
    sparse      an Embedding with Adam: IndexedSlices gradients, Keras' sparse update
    bfloat16    mixed_bfloat16: bfloat16 boundary tensors
    float16     mixed_float16 with an overflow at a chosen step: the loss scale's path; and
                one where only the whole batch's float16 sums overflow (summed_in_half)

Scenarios of Model.fit's contract (own_steps, per_execution) are in contract.py.
Each rank compares its own model with a model.fit it runs itself from the same
initial weights, and prints "OK <scenario>"; any mismatch raises (ending the job).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

import contract
import hyparflow as hf

BATCH, STEPS = 16, 4
FIT = contract.FIT  # hf.fit's extra arguments for the configuration run (by its suffix)
# the scenarios run sharded: no gradient, every optimizer option, sparse rows, mixed precision
SHARDED = ("unused", "options", "sparse", "few", "bfloat16", "float16")
# the scenarios run with step_graph=True: besides those, a layer's own state and metrics, and
# metrics that build their state lazily (traced, not run, before the step graph's first call)
STEP_GRAPH = ("aggregated", "f1") + SHARDED
# the scenarios run interleaved: a rank holding two stages must agree on what has gradients
# over both, combine the norm and the loss scale's verdict over all, and send stage state
# and metrics from the stage that holds them
INTERLEAVED = STEP_GRAPH + ("own_steps", "reductions")
SUFFIXES = {k: (*contract.SUFFIX_ARGS[k], scenarios) for k, scenarios in
            (("z", SHARDED), ("g", STEP_GRAPH), ("i", INTERLEAVED), ("w", STEP_GRAPH))}


def configuration(config):
    """"2x2" → (2, 2, ""); "2x2z" → (2, 2, "z"): the optimizer's state sharded over the
    replicas (shard_optimizer=True); "2x2g": each step one graph
    (hf.Schedule(step_graph=True)); "2x1i": the interleaved schedule (two stages a rank);
    "2x1ig": both; "2x1gw": the zero-bubble
    schedule (each backward split, with the step graph)."""
    shape = config.rstrip("".join(SUFFIXES))
    P, R = (int(v) for v in shape.split("x"))
    return P, R, config[len(shape):]


label = contract.label


def mlp(width=12, extra=False, head=None):
    """Dense layers enough for 4 stages; a float32 softmax, as Keras advises for mixed precision."""
    import keras

    x = keras.Input((6,), name="x")
    h = x
    for k in range(4 + extra):
        h = keras.layers.Dense(width, activation="tanh", name=f"d{k}")(h)
    out = keras.layers.Dense(3, name="logits")(h)
    out = keras.layers.Activation("softmax", dtype="float32", name="probs")(out)
    if head is not None:
        return keras.Model(x, {"probs": out, "aux": keras.layers.Dense(2, name="aux")(head(x))})
    return keras.Model(x, out)


def data(n=BATCH * STEPS, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, size=n)


def same_weights(a, b, rtol, atol, what):
    for u, v, w in zip(a.get_weights(), b.get_weights(), a.weights):
        np.testing.assert_allclose(v, u, rtol=rtol, atol=atol, err_msg=f"{what}: {w.path}")


def same_optimizer(a, b, rtol, atol, what):
    theirs, ours = a.optimizer.variables, b.optimizer.variables
    assert [v.name for v in theirs] == [v.name for v in ours], (what, theirs, ours)
    for u, v in zip(theirs, ours):
        np.testing.assert_allclose(v.numpy(), u.numpy(), rtol=rtol, atol=atol,
                                   err_msg=f"{what}: {u.name}")


def built(build, optimizer, seed=3, **compile_kwargs):
    """`build()` compiled with a new `optimizer()` (and `compile_kwargs`, a callable one
    called), its initial weights those of every other model of this seed."""
    import keras

    keras.utils.set_random_seed(seed)
    m = build()
    kwargs = {k: v() if callable(v) else v for k, v in compile_kwargs.items()}
    m.compile(optimizer=optimizer(), **kwargs)
    return m


def twins(build, optimizer, seed=3, **compile_kwargs):
    return [built(build, optimizer, seed, **compile_kwargs) for _ in range(2)]


def oracle(key, build, optimizer, fit, seed=3, **compile_kwargs):
    """(model, History) of model.fit — `fit(model)` — on a model `built` alike, trained once
    per process (`custom_models.reference`): every configuration compares with it."""
    def train():
        ref = built(build, optimizer, seed, **compile_kwargs)
        return ref, fit(ref)
    return contract.cm.reference(key, train)


def warm_up():
    """The first fit in a TensorFlow process rounds differently from later ones."""
    import keras

    a, _ = twins(mlp, lambda: keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    x, y = data()
    a.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def sequence(configs, world):
    """model.fit and hf.fit at several P × R, one epoch each, equal an uninterrupted model.fit.

    SGD with momentum must agree to float32 rounding. Adam divides by the root of
    its second moment, which turns summation-order rounding of the gradients
    (micro-batches and replicas sum in another order than one batch) into
    relative differences of up to ~1e-5 in a few steps (measured: 3e-6).
    """
    import keras

    x, y = data()
    for name, make, rtol, atol in (
            ("sgd", lambda: keras.optimizers.SGD(0.1, momentum=0.9), 1e-5, 1e-6),
            ("adam", lambda: keras.optimizers.Adam(0.01), 1e-4, 1e-5)):
        ref, model = twins(mlp, make, loss="sparse_categorical_crossentropy")
        for step, config in enumerate(configs):
            ref.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            if config == "fit":
                model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            else:
                P, R, suffix = configuration(config)
                shard = "z" in suffix
                hf.fit(model, x, y, partitions=P, replicas=R, batch_size=BATCH, epochs=1,
                       shuffle=False, verbose=0, shard_optimizer=shard,
                       schedule=hf.Schedule("interleaved" if "i" in suffix else
                                            "zb-h1" if "w" in suffix else "1f1b",
                                            step_graph="g" in suffix))
                assert model.optimizer.built and len(model.optimizer._trainable_variables) == \
                    len(model.trainable_variables), f"{name} after {config}: optimizer not whole"
                if shard:
                    shared_out(model, world, P, R, f"{name} at {config}")
                    # evaluate reuses the sharded trainer fit built, not a second one
                    trainers = len(model._hyparflow_trainers)
                    hf.evaluate(model, x, y, partitions=P, replicas=R, batch_size=BATCH,
                                verbose=0)
                    assert len(model._hyparflow_trainers) == trainers, \
                        f"{name} at {config}: hf.evaluate built a trainer of its own"
            what = f"{name}, after {' → '.join(configs[:step + 1])}, rank {world.Get_rank()}"
            same_weights(ref, model, rtol, atol, what)
            same_optimizer(ref, model, rtol, atol, what)
    print(f"OK sequence {','.join(configs)}", flush=True)


def shared_out(model, world, P, R, what):
    """Sharded: each stage's variables are split among its replicas, each updated by one,
    and a rank's optimizer holds the slots of its share only: at most 1/R of the stage's
    slots plus one variable's (the balance of whole variables)."""
    executor = model._hyparflow_fit.executor
    stage = executor.variables  # every stage the rank holds (interleaved: two)
    nbytes = lambda v: int(np.prod(v.shape)) * 4  # noqa: E731
    slots = sum(nbytes(v) for v in executor.optimizer.variables if len(v.shape))
    rows = world.allgather((executor.topology.stage,
                            [v.path for v in executor.shard.owned_variables], slots))
    per_variable = slots // max(1, sum(nbytes(v) for v in executor.shard.owned_variables))
    for s in range(P):
        mine = [row for row in rows if row[0] == s]
        if s == executor.topology.stage:
            assert sorted(p for row in mine for p in row[1]) == sorted(v.path for v in stage), \
                (what, "the shares do not cover the stage once", mine)
            total = per_variable * sum(nbytes(v) for v in stage)
            largest = per_variable * max(nbytes(v) for v in stage)
            assert len(mine) == R and all(row[2] <= total / R + largest for row in mine), \
                (what, total, largest, mine)


def seeds(world, P, R):
    """Every rank seeds its model differently; hf.fit trains rank 0's model."""
    import keras

    x, y = data()
    keras.utils.set_random_seed(100 + world.Get_rank())
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    initial = world.bcast(model.get_weights(), root=0)

    def train():
        ref = mlp()
        ref.set_weights(initial)
        ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                    loss="sparse_categorical_crossentropy")
        return ref, ref.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)

    if world.Get_rank() != 0:
        assert not np.allclose(model.get_weights()[0], initial[0])  # they did differ
    ref, hr = contract.cm.reference("seeds", train)
    hm = hf.fit(model, x, y, partitions=P, replicas=R, batch_size=BATCH, **FIT, epochs=2,
                shuffle=False, verbose=0)
    same_weights(ref, model, 1e-5, 1e-6, f"seeds at {label(P, R)}, rank {world.Get_rank()}")
    np.testing.assert_allclose(hm.history["loss"], hr.history["loss"], rtol=1e-5)
    # A second call starts from what the first left on every rank (the same model: nothing
    # to send); but a rank that changed its weights or optimizer state since trains rank 0's
    # again, on every rank (ranks != 0 add 1 to a kernel, then to a momentum slot; at R = 1,
    # 2 × 1 and 4 × 1: make test's time)
    def two_calls_more():
        again, _ = train()
        return [(again.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                           verbose=0).history["loss"], again.get_weights()) for _ in range(2)]

    later = contract.cm.reference("seeds, two calls more", two_calls_more)
    for changed, (loss, weights) in zip(("weights", "optimizer"), later if R == 1 else []):
        if world.Get_rank() != 0:
            v = model.weights[0] if changed == "weights" else model.optimizer.variables[-1]
            v.assign(v + 1.0)
        hm = hf.fit(model, x, y, partitions=P, replicas=R, batch_size=BATCH, **FIT, epochs=1,
                    shuffle=False, verbose=0)
        for got, want in zip(model.get_weights(), weights, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=(
                f"seeds at {label(P, R)}, rank {world.Get_rank()}, {changed} changed"))
        np.testing.assert_allclose(hm.history["loss"], loss, rtol=1e-5)
    print(f"OK seeds {label(P, R)}", flush=True)


def structure(world, P, R):
    """A rank whose model differs: one ValueError on every rank, naming the difference. A
    loss or metrics compiled differently too (rank 0's loss trained, silently)."""
    import keras

    x, y = data()
    sparse = keras.losses.SparseCategoricalCrossentropy
    for change, loss, metrics, expect in (
            ({"width": 13}, None, None, "'weight d0/kernel (6, 13) float32' on ranks [1]"),
            ({"extra": True}, None, None, "on ranks [1]"),
            ({}, sparse(from_logits=True), None, "'from_logits': True"),
            ({}, None, ["accuracy"], "\"compiled metrics ['accuracy']\" on ranks [1]")):
        other = world.Get_rank() == 1
        model = mlp(**(change if other else {}))
        model.compile(optimizer="sgd", loss=loss if other and loss else sparse(),
                      metrics=metrics if other else None)
        try:
            hf.fit(model, x, y, partitions=P, replicas=R, batch_size=BATCH, **FIT, verbose=0)
        except ValueError as exc:
            message = str(exc)
            assert "hf.fit got different models (layers, weights, optimizer, loss, metrics) " \
                   "on different ranks" in message and expect in message, message
        else:
            raise AssertionError(f"rank {world.Get_rank()}: a different model on rank 1 trained")
    print(f"OK structure {label(P, R)}: {message}", flush=True)


def normed(synchronized):
    """`mlp` with a BatchNormalization on its inputs and one after d0 (another stage at
    P > 1), synchronized or not."""
    import keras

    x = keras.Input((6,), name="x")
    h = keras.layers.BatchNormalization(synchronized=synchronized, name="bn_in")(x)
    for k in range(4):
        h = keras.layers.Dense(12, activation="tanh", name=f"d{k}")(h)
        if k == 0:
            h = keras.layers.BatchNormalization(synchronized=synchronized, name="bn_d0")(h)
    out = keras.layers.Dense(3, name="logits")(h)
    return keras.Model(x, keras.layers.Activation("softmax", dtype="float32", name="probs")(out))


def norms(world, P, R):
    """BatchNormalization as model.fit trains it. Synchronized layers at one micro-batch:
    the moments summed over the replicas, so every weight and moving statistic is
    model.fit's (each replica normalized by its own share: 0.39 off at 1 x 2). Plain
    layers at 4 micro-batches: the moving statistics updated once a step from the moments
    pooled over the step's micro-batches; the layer on the inputs, whose input does not
    depend on the micro-batching, then holds model.fit's (updated at every micro-batch,
    they drifted m times as fast): its moving mean, and with one replica its variance."""
    import keras

    if P > 2:  # (2 x 1 and 2 x 2 cut the model as 4 x 1 does)
        print(f"OK norms {label(P, R)}", flush=True)
        return
    x, y = data()
    sgd = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
    fit = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    what = f"norms {label(P, R)}, rank {world.Get_rank()}"
    for synchronized, m in ((True, 1), (False, 4)):
        ref, _ = oracle(f"norms {synchronized}", lambda: normed(synchronized), sgd,
                        lambda model: model.fit(x, y, **fit),
                        loss="sparse_categorical_crossentropy")
        model = built(lambda: normed(synchronized), sgd, loss="sparse_categorical_crossentropy")
        hf.fit(model, x, y, partitions=P, replicas=R, microbatches=m, **fit, **FIT)
        if synchronized:
            same_weights(ref, model, 1e-5, 1e-6, f"{what}, synchronized")
        else:
            # (over replicas, each normalizes by its own share, as under Keras' strategies:
            # their mean of equal shares is the batch's, their variance is not)
            layer, theirs = model.get_layer("bn_in"), ref.get_layer("bn_in")
            for v, u in list(zip(layer.non_trainable_weights,
                                 theirs.non_trainable_weights))[:1 if R > 1 else 2]:
                np.testing.assert_allclose(v.numpy(), u.numpy(), rtol=1e-5, atol=1e-6,
                                           err_msg=f"{what}, {m} micro-batches: {v.path}")
    print(f"OK norms {label(P, R)}", flush=True)


def unbuilt(world, P, R):
    """A Sequential without an input shape is built from the first batch's shapes, as
    model.fit builds it, then cut (it was refused at P > 1: "start it with keras.Input"):
    built by an hf.fit of no epoch, it then trains as model.fit from the same weights."""
    import keras

    def build():
        return keras.Sequential([keras.layers.Dense(12, activation="tanh") for _ in range(4)]
                                + [keras.layers.Dense(3, activation="softmax")])

    if P != 2:  # (at P = 1 nothing is cut; 4 stages cut as 2 do)
        print(f"OK unbuilt {label(P, R)}", flush=True)
        return
    x, y = data()
    keras.utils.set_random_seed(3)
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    fit = dict(batch_size=BATCH, shuffle=False, verbose=0)
    hf.fit(model, x, y, partitions=P, replicas=R, epochs=0, **fit, **FIT)
    assert model.built and model.inputs[0].shape[1:] == (6,), model.inputs
    ref = keras.models.clone_model(model)
    ref.set_weights(model.get_weights())
    ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                loss="sparse_categorical_crossentropy")
    ref.fit(x, y, epochs=2, **fit)
    hf.fit(model, x, y, partitions=P, replicas=R, epochs=2, **fit, **FIT)
    same_weights(ref, model, 1e-5, 1e-6, f"unbuilt {label(P, R)}, rank {world.Get_rank()}")
    print(f"OK unbuilt {label(P, R)}", flush=True)


def ragged(world, P, R):
    """Targets a tf.RaggedTensor (1 to 4 numbers a sample, a loss that pads them): split by
    rows over replicas and micro-batches, read by the last stage; the weights, losses and
    hf.evaluate are model.fit's (they were refused at every P x R: "pad the targets")."""
    import keras

    import models

    if P == 1:  # (rows over replicas as over micro-batches: 2 x 2 takes both)
        print(f"OK ragged {label(P, R)}", flush=True)
        return
    x, y = models.ragged_targets(n=BATCH * STEPS)
    sgd = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
    fit = dict(batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    ref, history = oracle("ragged", models.regressor, sgd, lambda m: m.fit(x, y, **fit),
                          loss=lambda: models.padded_mse)
    model = built(models.regressor, sgd, loss=lambda: models.padded_mse)
    ours = hf.fit(model, x, y, partitions=P, replicas=R, **fit, **FIT)
    what = f"ragged {label(P, R)}, rank {world.Get_rank()}"
    same_weights(ref, model, 1e-5, 1e-6, what)
    np.testing.assert_allclose(ours.history["loss"], history.history["loss"], rtol=1e-5,
                               err_msg=what)
    np.testing.assert_allclose(
        hf.evaluate(model, x, y, partitions=P, replicas=R, batch_size=BATCH, verbose=0),
        ref.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=1e-5, err_msg=what)
    print(f"OK ragged {label(P, R)}", flush=True)


def table():
    """An Embedding (its gradient IndexedSlices) under a pooled head."""
    import keras

    tokens = keras.Input((6,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(50, 8, name="table")(tokens)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    h = keras.layers.Dense(8, activation="tanh", name="d")(h)
    return keras.Model(tokens, keras.layers.Dense(3, activation="softmax", name="probs")(h))


def tf_batches(x, y, batch=BATCH):
    """(x, y) as a tf.data.Dataset of batches of `batch` (the last one smaller)."""
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def few(world, P, R):
    """Batches with fewer samples than replicas — batch_size 1, one sample in all, a last batch
    smaller than R, an Embedding's sparse gradient among them, the model's own train_step —
    train as model.fit trains them: a replica without samples takes part with nothing (they
    were refused: "batch_size=1 is smaller than replicas"; the sparse gradient with a small
    last batch hung the job)."""
    import keras

    import custom_models as cm

    if R == 1:  # (nothing to leave a replica out of)
        print(f"OK few {label(P, R)}", flush=True)
        return
    sgd = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
    what = f"few {label(P, R)}, rank {world.Get_rank()}"
    loss = "sparse_categorical_crossentropy"
    x, y = data(n=5)
    for n, batch in ((5, 1), (1, BATCH)):
        fit = dict(batch_size=batch, epochs=2, shuffle=False, verbose=0)
        ref, history = oracle(f"few {n} {batch}", mlp, sgd,
                              lambda m: m.fit(x[:n], y[:n], **fit), loss=loss)
        model = built(mlp, sgd, loss=loss)
        ours = hf.fit(model, x[:n], y[:n], partitions=P, replicas=R, **fit, **FIT)
        same_weights(ref, model, 1e-5, 1e-6, f"{what}, {n} samples in batches of {batch}")
        np.testing.assert_allclose(ours.history["loss"], history.history["loss"], rtol=1e-5,
                                   err_msg=f"{what}, {n} samples in batches of {batch}")
    one = x[:1], y[:1]
    np.testing.assert_allclose(
        hf.evaluate(model, *one, partitions=P, replicas=R, verbose=0),
        model.evaluate(*one, verbose=0), rtol=1e-5, err_msg=f"{what}: evaluate, 1 sample")
    np.testing.assert_allclose(
        hf.predict(model, one[0], partitions=P, replicas=R, verbose=0),
        model.predict(one[0], verbose=0), rtol=1e-5, err_msg=f"{what}: predict, 1 sample")

    tokens = np.random.default_rng(1).integers(0, 12, size=(2 * BATCH + 1, 6)).astype("int32")
    labels = np.random.default_rng(2).integers(0, 3, size=2 * BATCH + 1)
    stages = P * (2 if contract.schedule_name() == "interleaved" else 1)
    for n, batch in ((2 * BATCH + 1, BATCH), (3, 1)):  # the last batch, every batch: 1 sample
        fit = dict(batch_size=batch, epochs=2, shuffle=False, verbose=0)
        ref, history = oracle(f"few table {n} {batch}", table, sgd,
                              lambda m: m.fit(tokens[:n], labels[:n], **fit), loss=loss)
        model = built(table, sgd, loss=loss)
        hf.fit(model, tokens[:n], labels[:n], partitions=P, replicas=R, **fit, **FIT,
               balance={2: [1, 3], 4: [1, 1, 1, 1]}.get(stages))
        same_weights(ref, model, 1e-5, 1e-6, f"{what}: an Embedding, {n} samples in "
                                             f"batches of {batch}")
    if P > 1:  # each step one graph, the replica without samples running none of it
        fit = dict(batch_size=1, epochs=1, shuffle=False, verbose=0)
        ref, history = oracle("few 5 1 graph", mlp, sgd, lambda m: m.fit(x, y, **fit),
                              loss=loss)
        model = built(mlp, sgd, loss=loss)
        hf.fit(model, x, y, partitions=P, replicas=R, **fit, **contract.with_step_graph())
        same_weights(ref, model, 1e-5, 1e-6, f"{what}, step_graph=True")
    if P <= 2:  # synchronized BatchNormalization: its moments summed over the replicas
        xs, ys = data(n=2 * BATCH + R + 1)  # a last batch of R + 1: 2 + 1 + ... samples
        fit = dict(batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        ref, _ = oracle(f"few synchronized {R}", lambda: normed(True), sgd,
                        lambda m: m.fit(xs, ys, **fit), loss=loss)
        model = built(lambda: normed(True), sgd, loss=loss)
        hf.fit(model, xs, ys, partitions=P, replicas=R, microbatches=1, **fit, **FIT)
        same_weights(ref, model, 1e-5, 1e-6, f"{what}: synchronized, a last batch of {R + 1}")
        # 2 micro-batches a replica, but 1 in the last batch (every replica as many: the
        # replicas sum micro-batch by micro-batch; it hung)
        hf.fit(model, xs, ys, partitions=P, replicas=R, microbatches=2, **fit, **FIT)
        left = "replica 1" if R == 2 else f"replicas 1..{R - 1}"
        message = f"a batch of 1 sample leaves {left} without samples, and synchronized"
        for given in (xs[:2 * BATCH + 1], tf_batches(xs[:2 * BATCH + 1], ys[:2 * BATCH + 1])):
            try:  # arrays: before any message; a dataset: at its last batch
                hf.fit(model, given, None if not isinstance(given, np.ndarray) else
                       ys[:2 * BATCH + 1], partitions=P, replicas=R, microbatches=1, **fit,
                       **FIT)
            except ValueError as exc:
                assert message in str(exc), (what, exc)
            else:
                raise AssertionError(f"{what}: a batch of 1 sample with synchronized "
                                     "BatchNormalization was not refused")
        hf.fit(model, xs, ys, partitions=P, replicas=R, microbatches=1, **fit, **FIT)
    if P == 1 and not FIT:  # the model's own train_step (unsharded), every batch one sample
        fit = dict(batch_size=1, epochs=1, shuffle=False, verbose=0)
        ref, history = cm.reference("few gan", lambda: (
            lambda m: (m, m.fit(x, **fit)))(cm.seeded("gan")))
        model = cm.seeded("gan")
        ours = hf.fit(model, x, partitions=P, replicas=R, **fit, **FIT)
        same_weights(ref, model, 1e-5, 1e-6, f"{what}: a GAN's train_step")
        for key in ("c_loss", "g_loss"):
            np.testing.assert_allclose(ours.history[key], history.history[key], rtol=1e-5,
                                       err_msg=f"{what}: a GAN's {key}")
    print(f"OK few {label(P, R)}", flush=True)


def aggregated(world, P, R):
    """A layer's own state, updated in call(), merged over replicas by its `aggregation`.

    Two Tally layers (one on the inputs, one after d1: other stages at P > 1) count
    the samples they see (int32, "sum"), total them (float32, "sum"), total them for
    the first replica only ("only_first_replica") and count the positive ones
    (int32, left at "none": the first replica's). With "sum" the replicas' counts
    add up to model.fit's, whatever P × R; the others are replica 0's, on every rank.
    They also count what they see in inference ("sum"): fit's validation, read by a
    callback at each epoch's end, and hf.evaluate and hf.predict afterwards. Each keeps a
    Mean metric of what it sees in training (Keras logs a layer's metrics): logged as
    model.fit logs it, from the stage that updates it; and after hf.fit every rank's
    metrics (these and the compiled accuracy) hold model.fit's state.
    """
    import keras
    from keras import ops

    from hyparflow.data.batches import shard

    class Tally(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.mean = keras.metrics.Mean(name=f"{self.name}_mean")

        def build(self, shape):
            def state(name, dtype, aggregation):
                return self.add_weight(shape=(), dtype=dtype, initializer="zeros",
                                       trainable=False, aggregation=aggregation, name=name)
            self.seen = state("seen", "int32", "sum")
            self.total = state("total", "float32", "sum")
            self.first = state("first", "float32", "only_first_replica")
            self.positive = state("positive", "int32", "none")
            self.inferred = state("inferred", "int32", "sum")

        def call(self, h, training=False):
            if training:
                self.seen.assign_add(ops.shape(h)[0])
                self.total.assign_add(ops.sum(h))
                self.first.assign_add(ops.sum(h))
                self.positive.assign_add(ops.sum(ops.cast(h[:, 0] > 0, "int32")))
                self.mean.update_state(h)
            else:
                self.inferred.assign_add(ops.shape(h)[0])
            return h

    class Read(keras.callbacks.Callback):  # what every rank's model holds at each epoch's end
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_epoch_end(self, epoch, logs=None):
            self.seen.append([int(self.model.get_layer(k).inferred.numpy()) +
                              1000 * int(self.model.get_layer(k).seen.numpy())
                              for k in ("t_in", "t_mid")])

    def build():
        x = keras.Input((6,), name="x")
        h = Tally(name="t_in")(x)
        h = keras.layers.Dense(12, activation="tanh", name="d0")(h)
        h = keras.layers.Dense(12, activation="tanh", name="d1")(h)
        h = Tally(name="t_mid")(h)
        for k in (2, 3):
            h = keras.layers.Dense(12, activation="tanh", name=f"d{k}")(h)
        return keras.Model(x, keras.layers.Dense(3, activation="softmax", name="probs")(h))

    x, y = data()
    val = data(24, seed=1)
    make = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731

    def fit(m, reader, run=keras.Model.fit, **kw):
        history = run(m, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                      validation_data=val, callbacks=[reader], **kw)
        return history.history, reader.seen

    model = built(build, make, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    ref, (logged, want) = oracle("aggregated", build, make, lambda m: fit(m, Read()),
                                 loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    m = 2 * P
    logs, read = fit(model, Read(), lambda *a, **k: hf.fit(*a, partitions=P, replicas=R, **k),
                     microbatches=m, **FIT)
    what = f"aggregated at {label(P, R)}, rank {world.Get_rank()}"
    assert read == want == [[24 + 1000 * 64] * 2, [48 + 1000 * 128] * 2], (what, read, want)
    assert sorted(logs) == sorted(logged) and "t_in_mean" in logs, (what, logs, logged)
    for k in logged:
        np.testing.assert_allclose(logs[k], logged[k], rtol=1e-5, atol=1e-7, err_msg=f"{what}: {k}")
    mine, theirs = model.get_metrics_result(), ref.get_metrics_result()
    assert sorted(mine) == sorted(theirs), (what, mine, theirs)
    for k in theirs:  # (the validation's state, as Keras leaves it)
        np.testing.assert_allclose(mine[k], theirs[k], rtol=1e-5, atol=1e-7, err_msg=f"{what}: {k}")
    for u, v in zip(ref.trainable_weights, model.trainable_weights):
        np.testing.assert_allclose(v.numpy(), u.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=f"{what}: {v.path}")
    tin, tmid = model.get_layer("t_in"), model.get_layer("t_mid")
    for layer in (tin, tmid):
        mine = ref.get_layer(layer.name)
        assert int(layer.seen.numpy()) == int(mine.seen.numpy()) == 2 * len(x), what
        np.testing.assert_allclose(layer.total.numpy(), mine.total.numpy(), rtol=1e-5,
                                   atol=1e-5, err_msg=f"{what}: {layer.name} total")
    # replica 0's samples (its share of each batch), two epochs
    own = np.concatenate([i for step in range(STEPS) for i in shard(
        np.arange(step * BATCH, (step + 1) * BATCH), R, m, 0)])
    np.testing.assert_allclose(tin.first.numpy(), 2 * x[own].sum(), rtol=1e-5, atol=1e-5,
                               err_msg=f"{what}: replica 0's total")
    assert int(tin.positive.numpy()) == 2 * int((x[own, 0] > 0).sum()), what
    hf.evaluate(model, *val, partitions=P, replicas=R, batch_size=BATCH, verbose=0)
    hf.predict(model, val[0], partitions=P, replicas=R, batch_size=BATCH, verbose=0)
    assert [int(t.inferred.numpy()) for t in (tin, tmid)] == [96, 96], what
    states = world.allgather([[v.numpy() for v in layer.non_trainable_weights]
                              for layer in (tin, tmid)])
    for other in states[1:]:  # every rank holds the same state
        for u, v in zip(np.concatenate(states[0], axis=None), np.concatenate(other, axis=None)):
            assert u == v, (what, states)
    print(f"OK aggregated {label(P, R)}", flush=True)


def unused(world, P, R):
    """An output compiled with loss None: Keras leaves the variables only it uses alone.

    With weight decay a variable given a zero gradient would still move. The chain
    d1..d3 → probs feeds only the output without a loss; d1, d2 sit on the first
    stage (their output sent on to the last, whose loss ignores it): they must get
    None there, not zeros. The short head aux_h → aux carries the loss.
    """
    import keras

    def build():
        x = keras.Input((6,), name="x")
        h = keras.layers.Dense(12, activation="tanh", name="d0")(x)
        aux = keras.layers.Dense(2, name="aux")(keras.layers.Dense(4, name="aux_h")(h))
        for k in range(1, 4):
            h = keras.layers.Dense(12, activation="tanh", name=f"d{k}")(h)
        out = keras.layers.Dense(3, activation="softmax", name="probs")(h)
        return keras.Model(x, {"probs": out, "aux": aux})

    x, y = data()
    make = lambda: keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.05)  # noqa: E731
    model = built(build, make, loss={"probs": None, "aux": "mse"})
    unused = ("d1", "d2", "d3", "probs")
    initial = {w.path: w.numpy() for w in model.weights if w.path.split("/")[0] in unused}
    ys = {"probs": y, "aux": np.random.default_rng(2).normal(size=(len(y), 2))}
    # P = 2: d1, d2 on stage 0; P = 4: d1 on stage 0, d2 on stage 1, d3 and probs on stage 2
    # (the dead chain crosses three cuts)
    # (interleaved, P = 2 is four stages: the dead chain crosses three cuts and both chunks)
    stages = P * (2 if contract.schedule_name() == "interleaved" else 1)
    balance = {1: "layers", 2: [3, 4], 4: [2, 1, 2, 2]}[stages]
    if P > 1:
        part = hf.partition(model, stages, balance=balance)
        assert part.stages[0].calls[:2] == ["d0", "d1"], part.stages
    ref, hr = oracle("unused", build, make, lambda m: m.fit(
        x, ys, batch_size=BATCH, epochs=1, shuffle=False, verbose=0),
        loss={"probs": None, "aux": "mse"})
    hm = hf.fit(model, x, ys, partitions=P, replicas=R, batch_size=BATCH, **FIT, epochs=1,
                shuffle=False, verbose=0, balance=balance)
    same_weights(ref, model, 1e-5, 1e-6, f"unused at {label(P, R)}, rank {world.Get_rank()}")
    np.testing.assert_allclose(hm.history["loss"], hr.history["loss"], rtol=1e-5)
    moved = [w.path for w in model.weights if w.path in initial
             and not np.array_equal(w.numpy(), initial[w.path])]
    assert not moved, f"variables without gradient moved: {moved}"
    print(f"OK unused {label(P, R)}", flush=True)


def f1(world, P, R):
    import keras

    x, y = data()
    yy = keras.utils.to_categorical(y, 3)
    compiled = dict(loss="categorical_crossentropy",
                    metrics=lambda: [keras.metrics.F1Score(),  # per class; not shared
                                     keras.metrics.FBetaScore(beta=2.0, average="micro")])
    model = built(mlp, lambda: keras.optimizers.SGD(0.1), **compiled)
    _, hr = oracle("f1", mlp, lambda: keras.optimizers.SGD(0.1), lambda m: m.fit(
        x, yy, batch_size=BATCH, epochs=2, shuffle=False, verbose=0), **compiled)
    hm = hf.fit(model, x, yy, partitions=P, replicas=R, batch_size=BATCH, **FIT, epochs=2,
                shuffle=False, verbose=0)
    assert sorted(hm.history) == sorted(hr.history), (sorted(hm.history), sorted(hr.history))
    for k in hr.history:
        np.testing.assert_allclose(hm.history[k], hr.history[k], rtol=1e-5, atol=1e-6,
                                   err_msg=k)
    print(f"OK f1 {label(P, R)}", flush=True)


def options(world, P, R):
    """Optimizer options: global_clipnorm (the norm over every stage's gradients), clipnorm,
    clipvalue, loss_scale_factor, EMA (finalised per stage), weight decay with variables
    excluded from it (state outside the optimizer's config), a callable learning rate."""
    import keras

    def excluded():
        opt = keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.05)
        opt.exclude_from_weight_decay(var_names=["bias"])
        return opt

    x, y = data()
    makers = [lambda kw=kw: keras.optimizers.SGD(0.1, momentum=0.9, **kw) for kw in (
        {"global_clipnorm": 0.05}, {"clipnorm": 0.02}, {"clipvalue": 0.005},
        {"loss_scale_factor": 128.0, "global_clipnorm": 0.05},
        {"use_ema": True, "ema_momentum": 0.5})]
    makers += [excluded, lambda: keras.optimizers.SGD(learning_rate=lambda: 0.1, momentum=0.9)]
    for k, make in enumerate(makers):
        model = built(mlp, make, loss="sparse_categorical_crossentropy")
        ref, _ = oracle(f"options {k}", mlp, make, lambda m: m.fit(
            x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0),
            loss="sparse_categorical_crossentropy")
        hf.fit(model, x, y, partitions=P, replicas=R, batch_size=BATCH, **FIT, epochs=2,
               shuffle=False, verbose=0)
        same_weights(ref, model, 1e-5, 1e-6,
                     f"optimizer {k} at {label(P, R)}, rank {world.Get_rank()}")
        if k < 5:
            assert model.optimizer.get_config() == ref.optimizer.get_config() | {
                "name": model.optimizer.name}, "the user's optimizer keeps its configuration"
    print(f"OK options {label(P, R)}", flush=True)


def sparse(world, P, R):
    """An Embedding trained with Adam: its gradient stays IndexedSlices, applied as Keras does.

    Adam's moments move only on the rows looked up (each look-up, duplicates
    included); rows 12..49 are never looked up, so a densified gradient would
    move their moments and weights (by ~0.1).
    """
    import keras

    rng = np.random.default_rng(1)
    x = rng.integers(0, 12, size=(BATCH * STEPS, 6)).astype("int32")
    y = rng.integers(0, 3, size=BATCH * STEPS)
    make = lambda: keras.optimizers.Adam(0.05)  # noqa: E731
    model = built(table, make, loss="sparse_categorical_crossentropy")
    ref, _ = oracle("sparse", table, make, lambda m: m.fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0),
        loss="sparse_categorical_crossentropy")
    stages = P * (2 if contract.schedule_name() == "interleaved" else 1)  # the table alone on one
    hf.fit(model, x, y, partitions=P, replicas=R, batch_size=BATCH, **FIT, epochs=2,
           shuffle=False, verbose=0, balance={2: [1, 3], 4: [1, 1, 1, 1]}.get(stages),
           microbatches=2)
    # Adam: summation-order rounding to ~1e-6 relative (see `sequence`)
    same_weights(ref, model, 1e-4, 1e-5, f"sparse at {label(P, R)}, rank {world.Get_rank()}")
    same_optimizer(ref, model, 1e-4, 1e-5, f"sparse at {label(P, R)}, rank {world.Get_rank()}")
    print(f"OK sparse {label(P, R)}", flush=True)


def mixed(world, P, R, policy):
    """Mixed precision: the same weights up to the compute dtype's rounding.

    float16 (10-bit mantissa) and bfloat16 (7-bit) round each product to 2^-11 and
    2^-8 relative; the two runs do the same float16 / bfloat16 ops on the same
    samples, but in micro-batches and replicas the float16 reductions (a kernel's
    gradient sums over the samples) run over fewer samples at a time and so round
    differently: we allow a few units of the compute dtype's rounding on weights
    that move by ~0.1 (2e-3 relative for float16, 2e-2 for bfloat16).
    With mixed_float16, a sample of 6e4 at step 2 overflows the float16 gradients:
    model.fit skips that step and halves the loss scale; hf.fit must agree on every
    stage (the overflow shows on one stage first) and follow the same scale.
    """
    import keras

    keras.mixed_precision.set_global_policy(policy)
    try:
        x, y = data()
        if policy == "mixed_float16":
            x[2 * BATCH + 3] = 6e4
        make = lambda: keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731
        if policy == "mixed_float16":
            make = lambda: keras.optimizers.LossScaleOptimizer(  # noqa: E731
                keras.optimizers.SGD(0.05, momentum=0.9), initial_scale=2.0 ** 10,
                dynamic_growth_steps=2)
        model = built(mlp, make, loss="sparse_categorical_crossentropy")
        ref, _ = oracle(policy, mlp, make, lambda m: m.fit(
            x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0),
            loss="sparse_categorical_crossentropy")
        hf.fit(model, x, y, partitions=P, replicas=R, batch_size=BATCH, **FIT, epochs=2,
               shuffle=False, verbose=0)
        rtol = 2e-3 if policy == "mixed_float16" else 2e-2
        if policy == "bfloat16":  # the weights themselves round to 8 bits: a few of their units
            rtol = 3e-2
        same_weights(ref, model, rtol, rtol / 10,
                     f"{policy} at {label(P, R)}, rank {world.Get_rank()}")
        if policy == "mixed_float16":
            for name in ("dynamic_scale", "step_counter", "iterations"):
                assert float(getattr(model.optimizer, name).numpy()) == float(
                    getattr(ref.optimizer, name).numpy()), name
            assert float(ref.optimizer.dynamic_scale.numpy()) != 2.0 ** 10
    finally:
        keras.mixed_precision.set_global_policy("float32")
    print(f"OK {policy} {label(P, R)}", flush=True)


def summed_in_half(world, P, R):
    """mixed_float16 where only the whole batch's gradient overflows float16.

    Keras computes a bias's gradient as one float16 sum over the batch: here 98304,
    which is inf in float16, so model.fit skips the step and halves the loss scale.
    hf.fit sums micro-batches and replicas in float32: each part (at most half the batch)
    is finite and so is their sum. It must still skip where model.fit skips, and follow the
    same loss scale. At P = 1 also a model with its own train_step (Keras' own, inherited:
    hf.fit combines the gradients its tape takes over the replicas).
    """
    import keras

    class Stepping(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    def build(kind=keras.Model):
        x = keras.Input((4,))
        h = x
        for name in "abc":
            h = keras.layers.Dense(4, kernel_initializer="ones", name=name)(h)
        return kind(x, keras.layers.Dense(1, dtype="float32", kernel_initializer="ones",
                                          name="out")(h))

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        # every sample alike: the model predicts 64, the gradients are ~1024 × 2 × 3 × 16
        x = np.full((BATCH * STEPS, 4), 0.25, "float32")
        y = np.full((BATCH * STEPS, 1), 61.0, "float32")
        make = lambda: keras.optimizers.LossScaleOptimizer(  # noqa: E731
            keras.optimizers.SGD(1e-5, momentum=0.9), initial_scale=2.0 ** 10,
            dynamic_growth_steps=2)
        ref, _ = oracle("summed_in_half", build, make, lambda m: m.fit(
            x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0), loss="mse")
        assert int(ref.optimizer.iterations.numpy()) < STEPS  # model.fit skipped steps
        own = P == 1 and not FIT  # (refused sharded and with the step graph)
        for kind in (keras.Model, Stepping)[:2 if own else 1]:
            model = built(lambda: build(kind), make, loss="mse")
            hf.fit(model, x, y, partitions=P, replicas=R, batch_size=BATCH, **FIT, epochs=1,
                   shuffle=False, verbose=0)
            what = f"{kind.__name__} at {label(P, R)}, rank {world.Get_rank()}"
            for name in ("dynamic_scale", "step_counter", "iterations"):
                ours, theirs = (float(getattr(m.optimizer, name).numpy()) for m in (model, ref))
                assert ours == theirs, f"{name}: {ours} under hf.fit, {theirs} under model.fit " \
                                       f"({what})"
            same_weights(ref, model, 2e-3, 2e-4, f"summed float16 overflow, {what}")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    print(f"OK summed_in_half {label(P, R)}", flush=True)


def main():
    from mpi4py import MPI

    from hyparflow.mpi import comm

    world = MPI.COMM_WORLD
    # Broadcasts of rank 0's model go in messages of at most CHUNK bytes, a larger array on
    # its own, in place: with 256 bytes these small models take both paths.
    comm.CHUNK = 256
    warm_up()
    sequence(sys.argv[1].split(","), world)
    for config in sys.argv[2].split(","):
        P, R, suffix = configuration(config)
        contract.configure(suffix)
        for scenario in sys.argv[3:]:
            if any(scenario not in SUFFIXES[letter][2] for letter in suffix):
                continue  # the others are not about the optimizer's state or the step graph
            if scenario in ("bfloat16", "float16"):
                mixed(world, P, R, f"mixed_{scenario}")
                if scenario == "float16":
                    summed_in_half(world, P, R)
                if scenario == "bfloat16":  # bfloat16 variables too: bfloat16 gradients
                    mixed(world, P, R, "bfloat16")
            elif scenario in globals():
                globals()[scenario](world, P, R)
            else:  # Model.fit's contract (contract.py)
                getattr(contract, scenario)(world, P, R)


if __name__ == "__main__":
    main()
