"""Scenarios of Model.fit's contract, run by numerics.py's launches (each prints "OK <name> <PxR>").

    own_steps       P = 1: models with their own train_step (partial freezing, a GAN with
                    two optimizers), test_step and predict_step train and log as
                    model.fit does on the global batch, a last batch of 1 sample (one
                    replica without samples) included; P > 1: one clear ValueError on
                    every rank. At every P: compute_loss / compute_metrics overrides (a
                    custom metric; one reading x; one leaving out the regularizers of
                    the first stage; one counting them half; one updating metrics with
                    the whole loss, every stage's regularizers in it, once per call on
                    batches split unevenly), a model trained
                    on its add_loss losses alone; one whose compute_metrics returns
                    values of no metric, one without any loss: refused at P > 1 with one
                    error on every rank
    per_execution   steps_per_execution: callbacks every N steps, as in model.fit
    interrupted     a callback raises at the same epoch on every rank (Keras' interrupt-and-
                    resume pattern with BackupAndRestore): every rank's caller catches it,
                    the model is model.fit's at that point, and a second hf.fit resumes
    sources         a generator and a PyDataset (two worker threads) train, evaluate and
                    predict as model.fit; a shuffled PyDataset in the same order on every
                    rank; a generator that differs between ranks: a ValueError on each;
                    partial labels (targets for the outputs with a loss only); a
                    subclassed model taking a dict of inputs (P = 1); sparse (scipy,
                    tf.SparseTensor) and ragged inputs, as arrays and in a tf.data.Dataset
    batch_callbacks a callback of the user's own (a class, a LambdaCallback) reading and
                    writing weights of other stages at every batch end: every rank sees
                    every stage's current weights, the model trained as model.fit's (also
                    with a file writer's subclass hooked in, run on one rank); the model
                    saved by a callback (model.save through a closure) on every rank, and
                    at P = 1 on rank 0 alone, by hf.save in a callback, and in
                    on_train_end: the files are model.fit's
    reductions      a loss summed over the batch trains as model.fit; one averaged over a
                    mask's entries (a graph's, a subclassed model's seen as it traces),
                    and a summed one under the model's own compute_loss: one ValueError
                    on every rank, the job going on, and again at a second call; at P = 2
                    weights tied across stages with the interleaved schedule: refused
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import warnings

import numpy as np

import custom_models as cm
import hyparflow as hf

# hf.fit's extra arguments for the configuration being run, set by numerics.py: by its
# suffix, the optimizer's state sharded ("z"), each step one graph ("g"), the interleaved
# schedule ("i"), the zero-bubble one ("w", with "g"); the scenarios here pass them where
# they pipeline (P > 1)
FIT = {}
SUFFIX_ARGS = {"z": ("shard_optimizer", True), "g": ("step_graph", True),
               "i": ("schedule", "interleaved"), "w": ("schedule", "zb-h1")}
_SUFFIX = [""]  # the configuration being run's


def configure(suffix):
    """FIT for the configuration with this suffix: the schedule's name and step graph in
    one hf.Schedule."""
    given = dict(SUFFIX_ARGS[k] for k in suffix)
    if "step_graph" in given:
        given["schedule"] = hf.Schedule(given.get("schedule", "1f1b"),
                                        step_graph=given.pop("step_graph"))
    FIT.clear()
    FIT.update(given)
    _SUFFIX[0] = "".join(k for k in SUFFIX_ARGS if k in suffix)


def schedule_name():
    """The name of the schedule the configuration runs."""
    given = FIT.get("schedule", "1f1b")
    return given if isinstance(given, str) else given.name


def with_step_graph():
    """FIT, each step one graph."""
    return dict(FIT, schedule=hf.Schedule(schedule_name(), step_graph=True))


def label(P, R):
    """"2x2", with the suffix of the configuration being run ("2x1i": interleaved)."""
    return f"{P}x{R}{_SUFFIX[0]}"

def _same_logs(want, got, what):
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=cm.RTOL, atol=cm.ATOL,
                                   err_msg=f"{what}: {k}")


def own_steps(world, P, R):
    import keras

    # 65 samples in batches of 16: the last batch has one sample, so at R = 2 one
    # replica has none (it takes part with weight zero); the others split unevenly.
    x, y = cm.data(cm.SAMPLES + 1)
    val = cm.data(24, seed=1)
    for kind in ("head_only", "penalised", "gan", "steps") + tuple(cm.LOSS_KINDS) + \
            cm.REFUSED_KINDS:
        ref, model = cm.twins(kind)
        args = dict(batch_size=cm.BATCH, epochs=2, shuffle=False, verbose=0)
        labelled = cm.LOSS_KINDS.get(kind, "xy") == "xy" and kind != "gan"
        inputs, val_inputs = ((x, y), val) if labelled else ((x,), val[:1])
        # (no_loss at P = 1: Keras' own step raises its error alike on every replica, which
        # reaches every caller, the job going on.)
        if (P > 1 and kind in ("head_only", "gan", "steps") +
                cm.REFUSED_KINDS) or (P == 1 and kind == "no_loss"):
            try:
                hf.fit(model, *inputs, partitions=P, replicas=R, **FIT, **args)
            except ValueError as exc:
                if kind == "no_loss":  # Keras' words
                    assert str(exc) == ("No loss to compute. Provide a `loss` argument in "
                                        "`compile()`."), exc
                    continue
                if kind == "odd_metrics":
                    assert str(exc).startswith(f"model {model.name!r}'s compute_metrics "
                                               "returned ['top'], which are not results "
                                               "of the model's metrics"), exc
                    # refused before the first step's update (it came after it)
                    cm.same_weights(ref, model, f"odd_metrics at {P}x{R}")
                else:
                    assert str(exc).startswith(f"model {model.name!r} overrides "), exc
                    assert f"partitions={P} cuts the model into stages" in str(exc), exc
                assert "use partitions=1 (any replicas)" in str(exc).lower(), exc
                continue
            raise AssertionError(f"{kind} at {P}x{R}: no error")
        what = f"{kind} at {P}x{R}, rank {world.Get_rank()}"
        if kind == "steps":
            want = ref.evaluate(*val, batch_size=10, verbose=0, return_dict=True)
            got = hf.evaluate(model, *val, replicas=R, batch_size=10, verbose=0,
                              return_dict=True)
            _same_logs(want, got, what)
            want, got = ref.predict(x, batch_size=10, verbose=0), \
                hf.predict(model, x, replicas=R, batch_size=10, verbose=0)
            np.testing.assert_allclose(got["probs"], want["probs"], rtol=cm.RTOL, err_msg=what)
            np.testing.assert_array_equal(got["top"], want["top"], err_msg=what)
            continue
        validated = kind != "gan"
        if validated:
            args["validation_data"] = val_inputs

        def train():  # (called at once, or never: the loop's values are this kind's)
            history = ref.fit(*inputs, **args)
            return ref, history, ref.evaluate(*val_inputs, batch_size=10, verbose=0,
                                              return_dict=True) if validated else None

        ref, ha, evaluated = cm.reference(f"own_steps {kind}", train)
        hb = hf.fit(model, *inputs, partitions=P, replicas=R, **FIT, **args)
        cm.same_weights(ref, model, what)
        _same_logs({k: v[-1] for k, v in ha.history.items()},
                   {k: v[-1] for k, v in hb.history.items()}, what)
        if validated:  # evaluate with the model's own loss logic, in inference mode
            _same_logs(evaluated,
                       hf.evaluate(model, *val_inputs, partitions=P, replicas=R, batch_size=10,
                                   verbose=0, return_dict=True), f"evaluate: {what}")
    # compute_loss takes y and sample_weight as the user gave them (one array each for a
    # model with two outputs, one labelled): they reached it as a list per output, and
    # broadcast silently.
    def given(fit):
        model, (gx, gy, gw) = cm.given_targets()
        return model, fit(model, gx, gy, sample_weight=gw, batch_size=cm.BATCH, epochs=2,
                          shuffle=False, verbose=0).history

    if P == 1 and R > 1:
        _replicas_draw_their_own(world, R)
    ref, want = cm.reference("own_steps given targets", lambda: given(keras.Model.fit))
    model, got = given(lambda m, *a, **k: hf.fit(m, *a, partitions=P, replicas=R, **FIT,
                                                 **k))
    cm.same_weights(ref, model, f"targets as given at {P}x{R}")
    _same_logs({k: v[-1] for k, v in want.items()}, {k: v[-1] for k, v in got.items()},
               f"targets as given at {P}x{R}")
    print(f"OK own_steps {label(P, R)}", flush=True)


def _replicas_draw_their_own(world, R):
    """A train_step drawing noise from its SeedGenerator: each replica draws its own (under
    model.fit the samples of a batch get different noise), and the generator ends where
    model.fit leaves it on every rank."""
    import keras

    x, y = cm.data()
    args = dict(batch_size=cm.BATCH, epochs=1, shuffle=False, verbose=0)
    ref, model = cm.twins("drawing")
    ref = cm.reference("own_steps drawing", lambda: ref.fit(x, y, **args) and ref)
    drawn = []
    hf.fit(model, x, y, replicas=R, callbacks=[keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: drawn.append(model.drawn.numpy().copy()))],
        **args)
    what = f"drawing at 1x{R}, rank {world.Get_rank()}"
    everyone = world.allgather(drawn)  # at P = 1, rank r is replica r
    assert len(drawn) == cm.SAMPLES // cm.BATCH, (what, len(drawn))
    for step in range(len(drawn)):
        firsts = np.array([mine[step] for mine in everyone])
        assert len({row.tobytes() for row in firsts}) == R, (what, step, firsts)
    np.testing.assert_array_equal(model.noise.state.numpy(), ref.noise.state.numpy(),
                                  err_msg=what)


def per_execution(world, P, R):
    import keras

    class Seen(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_train_batch_end(self, batch, logs=None):
            self.seen.append((batch, round(logs["loss"], 4)))

        def on_test_batch_end(self, batch, logs=None):
            self.seen.append(("test", batch))

    x, y = cm.data()

    def run(fit):
        keras.utils.set_random_seed(3)
        model = _deep(steps_per_execution=3)
        cb = Seen()
        fit(model, x, y, batch_size=10, epochs=2, shuffle=False, verbose=0, callbacks=[cb],
            validation_data=(x[:20], y[:20]))
        return model, cb.seen

    ref, want = cm.reference("per_execution", lambda: run(keras.Model.fit))
    model, got = run(lambda m, *a, **k: hf.fit(m, *a, partitions=P, replicas=R, **k))
    assert got == want, (P, R, got, want)
    cm.same_weights(ref, model, f"steps_per_execution at {P}x{R}")
    print(f"OK per_execution {P}x{R}", flush=True)


def _deep(**compile_kwargs):
    """Dense layers enough for 4 stages."""
    import keras

    inputs = keras.Input((6,))
    h = inputs
    for _ in range(4):
        h = keras.layers.Dense(8, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))
    model.compile(optimizer=cm._sgd(), loss="sparse_categorical_crossentropy", **compile_kwargs)
    return model


def interrupted(world, P, R):
    import tempfile

    import keras

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("Interrupting model training")

    directory = world.bcast(tempfile.mkdtemp() if world.Get_rank() == 0 else None)
    x, y = cm.data()
    args = dict(batch_size=cm.BATCH, shuffle=False, verbose=0)

    def trained(epochs):
        keras.utils.set_random_seed(3)
        model = _deep()
        model.fit(x, y, epochs=epochs, **args)
        return model

    whole, half = cm.reference("interrupted", lambda: (trained(4), trained(2)))
    keras.utils.set_random_seed(3)
    model = _deep()
    what = f"interrupted at {P}x{R}, rank {world.Get_rank()}"
    try:
        hf.fit(model, x, y, partitions=P, replicas=R, epochs=4, **args,
               callbacks=[keras.callbacks.BackupAndRestore(directory), Interrupt()])
    except RuntimeError as exc:
        assert str(exc) == "Interrupting model training", (what, exc)
    else:
        raise AssertionError(f"{what}: hf.fit did not raise")
    cm.same_weights(half, model, what + ", after the interruption")
    for u, v in zip(half.optimizer.variables, model.optimizer.variables):
        np.testing.assert_allclose(v.numpy(), u.numpy(), rtol=cm.RTOL, atol=cm.ATOL, err_msg=what)
    history = hf.fit(model, x, y, partitions=P, replicas=R, epochs=4, **args,
                     callbacks=[keras.callbacks.BackupAndRestore(directory)])
    assert history.epoch == [2, 3], (what, history.epoch)
    cm.same_weights(whole, model, what + ", resumed")
    print(f"OK interrupted {P}x{R}", flush=True)


def sources(world, P, R):
    import keras

    x, y = cm.data(cm.SAMPLES + 9)  # 73 samples: batches of 16, a last one of 9
    vx, vy = cm.data(24, seed=1)
    what = f"at {P}x{R}, rank {world.Get_rank()}"
    # A generator (a finite one feeds one epoch, then Keras' read-ahead batches) and a
    # PyDataset read by two threads, validated on a PyDataset: as model.fit trains.
    for kind in ("generator", "py_dataset"):
        def run(fit, kind=kind):
            keras.utils.set_random_seed(3)
            model = _deep()
            data = cm.generator(x, y) if kind == "generator" else cm.Batches(x, y, workers=2)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # ran out of data (the generator), shuffle
                history = fit(model, data, epochs=2, shuffle=False, verbose=0,
                              validation_data=cm.Batches(vx, vy, 10))
            return model, history.history

        ref, want = cm.reference(f"sources {kind}", lambda run=run: run(keras.Model.fit))
        model, got = run(lambda m, *a, **k: hf.fit(m, *a, partitions=P, replicas=R, **FIT,
                                                   **k))
        cm.same_weights(ref, model, f"{kind} {what}")
        _same_logs({k: v[-1] for k, v in want.items()}, {k: v[-1] for k, v in got.items()},
                   f"{kind} {what}")
        wanted = ref.evaluate(cm.generator(vx, vy, 10), verbose=0)
        np.testing.assert_allclose(
            hf.evaluate(model, cm.generator(vx, vy, 10), partitions=P, replicas=R, verbose=0),
            wanted, rtol=cm.RTOL, err_msg=f"{kind} {what}")
        np.testing.assert_allclose(
            hf.predict(model, cm.Batches(vx, None, 10), partitions=P, replicas=R, verbose=0),
            ref.predict(vx, batch_size=10, verbose=0), rtol=cm.RTOL, atol=cm.ATOL,
            err_msg=f"{kind} {what}")
    # A shuffled PyDataset (the default shuffle, no seed set): every rank reads the same
    # order, so training goes through and every rank ends with the same weights.
    model = _deep()
    hf.fit(model, cm.Batches(x, y), partitions=P, replicas=R, **FIT, epochs=2, verbose=0)
    sums = world.allgather(float(sum(np.sum(w) for w in model.get_weights())))
    assert len(set(sums)) == 1, (what, sums)
    # A generator that yields other batches on another rank: one ValueError on every rank,
    # and the job goes on.
    rank_x = x + world.Get_rank()
    try:
        hf.fit(_deep(), cm.generator(rank_x, y), partitions=P, replicas=R, **FIT, verbose=0)
    except ValueError as exc:
        assert str(exc).startswith("the Python generator gave different ranks different "
                                   "batches (batch 0 of this pass"), exc
        assert "make it yield the same batches on every rank" in str(exc), exc
    else:
        raise AssertionError(f"no error {what}")
    # Partial labels: targets for the outputs with a loss only. (Whole batches: Model.fit
    # weighs a per-output loss of a batch traced with an unknown size as one sample.)
    x, y = x[:64], y[:64]
    rng = np.random.default_rng(2)
    ya, yc = rng.normal(size=(len(x), 2)).astype("float32"), rng.normal(size=(len(x), 1))
    for targets in (ya, {"a": ya, "c": yc}):
        def run(fit, targets=targets):
            model = cm.heads(["mse", None, "mae"] if isinstance(targets, dict)
                              else ["mse", None, None], depth=3)
            history = fit(model, x, targets, batch_size=16, epochs=2, shuffle=False, verbose=0)
            return model, history.history

        ref, want = cm.reference(f"sources partial labels {type(targets).__name__}",
                                 lambda run=run: run(keras.Model.fit))
        model, got = run(lambda m, *a, **k: hf.fit(m, *a, partitions=P, replicas=R, **FIT,
                                                   **k))
        cm.same_weights(ref, model, f"partial labels {what}")
        _same_logs({k: v[-1] for k, v in want.items()}, {k: v[-1] for k, v in got.items()},
                   f"partial labels {what}")
    if P == 1:  # a subclassed model taking a dict of inputs (only P = 1 runs one)
        ref, model = cm.dict_inputs_model(), cm.dict_inputs_model()
        xd = {"a": x[:, :2], "b": x[:, 2:]}
        ref.fit(xd, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        hf.fit(model, xd, y, replicas=R, batch_size=16, epochs=2, shuffle=False, verbose=0)
        cm.same_weights(ref, model, f"dict inputs {what}")
    # Sparse inputs (scipy and tf.SparseTensor) and ragged ones, as model.fit takes them.
    for kind in ("scipy", "tf.sparse", "ragged"):
        def run(fit, kind=kind):
            model, xs, ys = cm.sparse_case(kind, depth=3)
            history = fit(model, xs, ys, batch_size=16, epochs=2, shuffle=False, verbose=0)
            return model, history.history, xs, ys

        ref, want, _, _ = cm.reference(f"sources {kind}", lambda run=run: run(keras.Model.fit))
        model, got, xs, ys = run(lambda m, *a, **k: hf.fit(m, *a, partitions=P, replicas=R,
                                                            **FIT, **k))
        cm.same_weights(ref, model, f"{kind} inputs {what}")
        _same_logs({k: v[-1] for k, v in want.items()}, {k: v[-1] for k, v in got.items()},
                   f"{kind} inputs {what}")
        np.testing.assert_allclose(hf.predict(model, xs, partitions=P, replicas=R, verbose=0),
                                   ref.predict(xs, verbose=0), rtol=cm.RTOL, atol=cm.ATOL,
                                   err_msg=f"{kind} inputs {what}")
        if kind != "scipy":  # the same tensors in a tf.data.Dataset, each replica its share
            import tensorflow as tf

            dataset = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(16)
            np.testing.assert_allclose(
                hf.evaluate(model, dataset, partitions=P, replicas=R, verbose=0),
                ref.evaluate(dataset, verbose=0), rtol=cm.RTOL,
                err_msg=f"{kind} inputs in a tf.data.Dataset {what}")
    print(f"OK sources {label(P, R)}", flush=True)


def batch_callbacks(world, P, R):
    import keras

    class Mirror(keras.callbacks.Callback):
        """Reads the first layer, writes the last (other stages at P > 1), every batch."""

        def __init__(self):
            super().__init__()
            self.seen = []

        def on_train_batch_end(self, batch, logs=None):
            first, last = self.model.layers[1], self.model.layers[-1]
            self.seen.append(float(np.abs(first.kernel.numpy()).sum()))
            last.bias.assign(0.5 * last.bias + 0.1 * first.bias[:3])

    class Logger(keras.callbacks.CSVLogger):
        """A file writer (run on one rank only) with a batch hook of the user's own."""

        def on_train_batch_end(self, batch, logs=None):
            self.model.layers[1].kernel.numpy()

    x, y = cm.data()

    def train(fit, directory, alone, saves, refusals=None):
        """Trains with the callbacks; each epoch end, model.save through the closure on every
        rank (also with include_optimizer=False), and save_weights on the ranks `alone` says
        (rank 0 alone, as Horovod scripts save); at the last, `saves(model, path)` on every
        rank (hf.save under hf.fit); at the end of training, model.save on every rank.
        `refusals`: also saves hf.fit refuses during training (several files), their errors
        kept there."""
        keras.utils.set_random_seed(3)
        model, mirror, sums = _deep(), Mirror(), []
        read = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: sums.append(
            float(np.sum(model.layers[-2].kernel.numpy()))))

        def save(epoch, logs):
            if epoch == 0:  # mid-training: the optimizer's state is in the stages
                model.save(os.path.join(directory, f"every-{epoch}.keras"))
                model.save(os.path.join(directory, f"bare-{epoch}.h5"),
                           include_optimizer=False)  # (Keras honours it in .h5 files)
                if alone(world.Get_rank()):
                    model.save_weights(os.path.join(directory, f"rank0-{epoch}.weights.h5"))
                for call, name, option in (
                        (model.save, "folder.keras", dict(zipped=False)),
                        (model.save_weights, "shards.weights.json", dict(max_shard_size=1))):
                    if refusals is not None:
                        try:
                            call(os.path.join(directory, name), **option)
                        except ValueError as exc:
                            refusals.append(str(exc))
            else:
                saves(model, os.path.join(directory, f"hf-save-{epoch}.keras"))

        history = fit(model, x, y, batch_size=cm.BATCH, epochs=2, shuffle=False, verbose=0,
                      callbacks=[mirror, read, keras.callbacks.LambdaCallback(
                          on_epoch_end=save, on_train_end=lambda logs: model.save(
                              os.path.join(directory, "end.keras"))),
                          Logger(os.path.join(directory, f"log-{world.Get_rank()}.csv"))])
        return model, history.history, mirror.seen, sums

    import tempfile

    theirs = tempfile.mkdtemp()  # this rank's: model.fit runs on every rank
    ref, *want = cm.reference("batch_callbacks", lambda: train(
        keras.Model.fit, theirs, alone=lambda rank: True, saves=lambda m, path: m.save(path)))
    ours = world.bcast(tempfile.mkdtemp() if world.Get_rank() == 0 else None)
    refusals = []
    model, *got = train(lambda m, *a, **k: hf.fit(m, *a, partitions=P, replicas=R, **k), ours,
                        alone=lambda rank: P == 1 and rank == 0, saves=hf.save,
                        refusals=refusals)
    what = f"batch_callbacks at {P}x{R}, rank {world.Get_rank()}"
    # an unzipped folder and sharded weights are several files: refused on every rank, and
    # training went on (the save on all ranks or, at P = 1, on each alone)
    assert len(refusals) == 2, (what, refusals)
    for error, option in zip(refusals, ("zipped=False", "max_shard_size=1")):
        assert f"{option}) during hf.fit: Keras writes" in error, (what, error)
        assert f"Leave {option.split('=')[0]} out while training" in error, (what, error)
    assert not any(os.path.exists(os.path.join(ours, name))
                   for name in ("folder.keras", "shards.weights.json")), what
    cm.same_weights(ref, model, what)
    _same_logs(want[0], got[0], what)
    for name, a, b in zip(("Mirror", "LambdaCallback"), want[1:], got[1:]):
        assert len(a) == len(b) == 2 * cm.SAMPLES // cm.BATCH, (what, name, a, b)
        np.testing.assert_allclose(b, a, rtol=cm.RTOL, atol=cm.ATOL, err_msg=f"{name} {what}")
    # what model.save wrote during training, weights and optimizer state, is model.fit's
    world.Barrier()
    every = ["hf-save-1.keras", "end.keras", "every-0.keras", "bare-0.h5",
             "rank0-0.weights.h5"]
    files = every if P == 1 else every[:4]
    expected = cm.reference("batch_callbacks files", lambda: {
        name: _saved(os.path.join(theirs, name)) for name in every})
    for name in files:
        for a, b, kind in zip(expected[name], _saved(os.path.join(ours, name)),
                              ("weights", "optimizer")):
            # (a file saved without its optimizer has no optimizer variables)
            assert len(a) == len(b) > 0 or (name.startswith("bare") and kind == "optimizer"
                                            and len(a) == len(b) == 0), (
                what, name, kind, len(a), len(b))
            for u, v in zip(a, b):
                np.testing.assert_allclose(v, u, rtol=cm.RTOL, atol=cm.ATOL,
                                           err_msg=f"{name} ({kind}) {what}")
    # the only batch hook a file writer's, which runs on one rank: every rank still gathers
    keras.utils.set_random_seed(3)
    hf.fit(_deep(), x, y, partitions=P, replicas=R, batch_size=cm.BATCH, verbose=0, timeout=60,
           callbacks=[Logger(os.path.join(ours, "alone.csv"))])
    # hooks that read no weights (timing steps), said so by the callback's attribute
    # batch_hooks_read_weights = False: no per-step gathering, and training is the same; a
    # rank then holds other stages' weights as of the epoch's start
    def one_epoch(fit, **kwargs):
        keras.utils.set_random_seed(3)
        model, seen = _deep(), []
        timer = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs:
                                               seen.append(float(np.sum(
                                                   model.layers[-1].kernel.numpy()))))
        timer.batch_hooks_read_weights = False
        fit(model, x, y, batch_size=cm.BATCH, shuffle=False, verbose=0, callbacks=[timer],
            **kwargs)
        return model, seen

    ref, want = cm.reference("batch_callbacks one epoch", lambda: one_epoch(keras.Model.fit))
    model, seen = one_epoch(hf.fit, partitions=P, replicas=R)
    cm.same_weights(ref, model, f"batch_hooks_read_weights = False: {what}")
    last = world.Get_rank() % P == P - 1  # this rank's stage holds the last layer
    assert len(seen) == len(want) and (len(set(seen)) > 1 if last else len(set(seen)) == 1), (
        what, last, seen)
    print(f"OK batch_callbacks {P}x{R}", flush=True)


def _saved(path):
    """(weights, optimizer variables) of a file Model.save or save_weights wrote."""
    import keras

    if path.endswith(".weights.h5"):
        model = _deep()
        model.optimizer.build(model.trainable_variables)
        model.load_weights(path)
    else:
        model = keras.models.load_model(path)
    optimizer = getattr(model, "optimizer", None)  # (none in a file saved without it)
    return model.get_weights(), [v.numpy() for v in optimizer.variables] if optimizer else []


def reductions(world, P, R):
    import keras

    what = f"at {P}x{R}, rank {world.Get_rank()}"
    def run(fit):
        model, x, y, _ = cm.reduced("sum")
        return model, fit(model, x, y, batch_size=cm.BATCH, epochs=2, shuffle=False,
                          verbose=0).history

    ref, want = cm.reference("reductions sum", lambda: run(keras.Model.fit))
    model, got = run(lambda m, *a, **k: hf.fit(m, *a, partitions=P, replicas=R, **FIT, **k))
    cm.same_weights(ref, model, f"sum {what}")
    _same_logs({k: v[-1] for k, v in want.items()}, {k: v[-1] for k, v in got.items()},
               f"sum {what}")
    kinds = ("masked", "sum_own") + (("masked_subclassed",) if P == 1 else ())
    for kind, why in zip(kinds, ("averages output 'tags' over the entries",
                                 "sums over the batch where the model's own train_step",
                                 "averages output 'output' over the entries")):
        model, x, y, _ = cm.reduced(kind)
        before = [np.array(w) for w in model.get_weights()]
        # twice: a caller that catches the refusal and calls again is refused again (a
        # subclassed model's masks are seen as its first step traces, before any update)
        for attempt in (1, 2):
            try:
                hf.fit(model, x, y, partitions=P, replicas=R, **FIT, batch_size=cm.BATCH,
                       verbose=0)
            except ValueError as exc:
                assert f"compiled loss {why}" in str(exc), (kind, what, attempt, exc)
                assert f"with replicas={R} and microbatches=" in str(exc), (kind, what, exc)
            else:
                raise AssertionError(f"{kind} {what}: no error at call {attempt}")
            # refused: nothing trained
            for w, b in zip(model.get_weights(), before):
                np.testing.assert_array_equal(w, b, err_msg=f"{kind} {what}: weights moved")
            assert int(model.optimizer.iterations.numpy()) == 0, (kind, what)
    if P == 2:  # weights tied across stages cannot be summed with two stages a rank (the
        # model's 5 calls make at most 2 ranks × 2 stages)
        import models

        keras.utils.set_random_seed(0)
        model = models.tied()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        rng = np.random.default_rng(0)
        try:
            hf.fit(model, rng.normal(size=(16, 8)).astype("float32"), rng.integers(0, 3, 16),
                   partitions=P, replicas=R, **{**FIT, "schedule": "interleaved"},
                   batch_size=8, verbose=0)
        except ValueError as exc:
            assert "with weights that several stages hold (shared: a layer called on each)" \
                in str(exc), (what, exc)
        else:
            raise AssertionError(f"tied weights with the interleaved schedule {what}: no error")
    print(f"OK reductions {label(P, R)}", flush=True)
