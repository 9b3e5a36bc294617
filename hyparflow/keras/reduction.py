"""How a compiled loss splits over replicas and micro-batches:
each piece's weight, or one clear refusal."""

import numpy as np

from hyparflow.keras import keras_private

# Reductions that give a batch's per-sample mean: a piece of the batch counts by its share.
MEAN = ("sum_over_batch_size", "mean")
SUM = "sum"


def reductions(model, out_names=None):
    """The reduction of each output's compiled loss (None where the output has no loss).

    A loss given by name or as a function reduces as Keras wraps it (a per-sample
    mean); a `keras.losses.Loss` by its own `reduction`. Without `out_names`, a dict
    of losses is read in its own order.
    """
    loss = getattr(model, "loss", None)
    n = len(out_names or [None])
    if isinstance(loss, dict):
        entries = [loss.get(name) for name in out_names] if out_names else list(loss.values())
    elif isinstance(loss, (list, tuple)):
        entries = list(loss)
    else:
        entries = [loss] * n
    return [None if e is None else getattr(e, "reduction", "sum_over_batch_size")
            for e in entries]


def summed(model):
    """Whether every output's compiled loss sums over the batch (a piece then counts whole)."""
    kinds = [r for r in reductions(model) if r is not None]
    return bool(kinds) and all(r == SUM for r in kinds)


def _entries(model, out_names):
    """Each output's compiled loss as given to compile (None where it has none)."""
    loss = getattr(model, "loss", None)
    if isinstance(loss, dict):
        return [loss.get(name) for name in out_names]
    if isinstance(loss, (list, tuple)):
        return list(loss)
    return [loss] * len(out_names)


def _value(loss, y_true, y_pred):
    """The compiled loss of one batch, reduced as Keras reduces it without sample weights: the
    loss `compile` makes of `loss` (a function wrapped as Keras wraps it: its per-sample values
    averaged over their entries, targets brought to the prediction's rank)."""
    import keras

    fn = keras_private.loss_object(loss, y_true, y_pred)
    return float(keras.ops.convert_to_numpy(fn(y_true, y_pred)))


def splits(loss, kind, y_sample, out_shape, seed=0):
    """Whether `loss` of a batch is the share-weighted mean (reduction `kind` a mean) or the
    sum (`kind` "sum") of its values on the batch's pieces, tried on one batch of five made
    from the data's first target and predictions drawn at random, low on one piece and high
    on the other (True when it cannot be
    tried). A loss computed over the whole batch (Dice or Tversky with axis=None, a
    function returning one value per batch) does not split."""
    n, cut = 5, 3
    y_true = np.repeat(np.asarray(y_sample)[:1], n, axis=0)
    shape = [n] + [d if d is not None else (y_true.shape[k] if k < y_true.ndim else 2)
                   for k, d in enumerate(out_shape[1:], start=1)]
    # the pieces' predictions far apart, so that a loss of a batch statistic shows it
    rng = np.random.default_rng(seed)
    y_pred = np.concatenate([rng.uniform(0.05, 0.35, size=[cut] + shape[1:]),
                             rng.uniform(0.55, 0.95, size=[n - cut] + shape[1:])]
                            ).astype("float32")
    try:
        whole = _value(loss, y_true, y_pred)
        first, second = _value(loss, y_true[:cut], y_pred[:cut]), \
            _value(loss, y_true[cut:], y_pred[cut:])
    except Exception:  # the loss does not take these: nothing learned
        return True
    pieces = first + second if kind == SUM else (cut * first + (n - cut) * second) / n
    return bool(np.isclose(whole, pieces, rtol=1e-4, atol=1e-6))


def fitting(model, out_names, probes, what=""):
    """Raise one clear ValueError when the data's first target does not fit its output's
    compiled loss (a one-hot target with a sparse loss, a wrong rank): tried on that target
    and a prediction of the output's shape, before any message, as Model.fit would fail at
    its first step. Outputs whose shape is not fully known are not tried."""
    if not keras_private.has_compiled_loss(model) or probes is None:
        return
    for name, loss, probe in zip(out_names, _entries(model, out_names), probes):
        if loss is None or probe is None or None in probe[1][1:]:
            continue
        y_true = np.asarray(probe[0])[:1]
        y_pred = np.full((1,) + tuple(probe[1][1:]), 0.5, "float32")
        try:
            _value(loss, y_true, y_pred)
        except (ValueError, TypeError) as exc:
            shown = loss if isinstance(loss, str) else getattr(loss, "name", None) or \
                getattr(loss, "__name__", type(loss).__name__)
            raise ValueError(
                f"{what}y for output {name!r} (samples of shape {y_true.shape[1:]}, dtype "
                f"{y_true.dtype}) does not fit its loss {shown!r} with the output's shape "
                f"{tuple(probe[1][1:])}: {str(exc).strip().splitlines()[-1]} Give targets "
                "the loss takes (class indices for a sparse loss, one-hot rows for a "
                "categorical one).") from None


def check(model, out_names, masked, weighted, own, P, R, m, what="", probes=None):
    """Raise the explanation when the compiled loss of one batch cannot be cut into R × m
    pieces whose weighted losses add up to it, as hyparflow's global batch needs.

    Args:
        out_names: the model's outputs' names (one name for a subclassed model).
        masked: per output, whether Keras gives it a mask (None: unknown).
        weighted: sample or class weights are given.
        own: the model's own train_step or compute_loss scales the loss by each piece's
            share (a summed loss cannot be told apart there).
        m: micro-batches of each replica's share (None: one per step).
        what: where the call is (e.g. "validation_data: "), for the message.
        probes: per output, (the data's first target, the output's shape) to try the loss
            on (`splits`), or None where unknown (a subclassed model); None: not tried.
    """
    if not keras_private.has_compiled_loss(model) or (R == 1 and (m or 1) == 1):
        return
    kinds = reductions(model, out_names)
    masked = masked or [False] * len(kinds)
    why = None
    use = ("Use a per-sample mean (the default reduction) or reduction='sum' on every output (a "
           "constant factor through loss_weights), which split exactly")
    for name, kind, mask in zip(out_names, kinds, masked):
        if kind is None:
            continue
        if kind in MEAN and mask:
            why = (f"averages output {name!r} over the entries of the whole batch its mask "
                   "keeps (Keras divides by their count)")
            use = ("Use reduction='sum' on every output (the kept entries' losses summed, "
                   "which splits exactly; a constant factor through loss_weights)")
        elif kind == "mean_with_sample_weight" and weighted:
            why = (f"divides output {name!r}'s weighted losses by the sum of the whole "
                   "batch's sample weights")
        elif kind not in MEAN + (SUM, "mean_with_sample_weight"):
            why = f"reduces output {name!r} with reduction={kind!r}"
        if why:
            break
    for name, kind, loss, probe in zip(out_names, kinds, _entries(model, out_names),
                                       probes or [None] * len(kinds)):
        if why is None and not own and kind in MEAN + (SUM,) and probe is not None \
                and not splits(loss, kind, *probe):
            why = (f"for output {name!r} is not a {'sum' if kind == SUM else 'mean'} over "
                   "samples: its value on a batch is not what its values on the batch's "
                   "pieces add up to (a loss computed over the whole batch, such as Dice or "
                   "Tversky with axis=None)")
    present = {k for k in kinds if k is not None}
    if why is None and SUM in present:
        if own:
            why = ("sums over the batch where the model's own train_step or compute_loss "
                   "scales each piece's loss by its share")
        elif present != {SUM}:
            why = "sums output losses over the batch where other outputs average theirs"
        elif len(kinds) > 1:
            why = ("sums over the batch, and Keras logs each output's sum per batch (the "
                   "pieces' per-output logs would be their own sums)")
    if why is None:
        return
    raise ValueError(
        f"{what}model {model.name!r}'s compiled loss {why}: with replicas={R} and "
        f"microbatches={m or 1} each batch is cut into {R * (m or 1)} pieces, whose losses "
        f"would not add up to Model.fit's. {use}; or replicas=1 and microbatches=1.")
