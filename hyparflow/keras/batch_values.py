"""A value the model's own code gives a metric once per call (a batch's loss),
counted by its piece's share of the batch."""

import contextlib

import keras


@contextlib.contextmanager
def by_share(model, share):
    """While the model's own step, compute_loss or compute_metrics runs (or traces) on one
    piece of a batch — a replica's share, a micro-batch — whose `share` of the batch is a
    scalar tensor or variable: a `Mean` or `Sum` among `model.metrics` updated with one
    value and no sample weight counts it with weight `share`.

    `model.fit` updates such a metric once per batch (`tracker.update_state(loss)`
    counts 1). Cut into pieces, each piece would count 1: the pieces of a batch
    of unequal sizes (a last, smaller batch) would weigh it wrongly. Weighted by
    their shares, which sum to 1 over a batch, the pieces count the batch once
    and its value as the share-weighted sum of theirs: the batch's value exactly
    for a mean over its samples, as a loss is (the same assumption that splits
    the loss). A value given with a sample weight, or one per sample, is left as
    it is.
    """
    wrapped = []
    plain = (keras.metrics.Mean.update_state, keras.metrics.Sum.update_state)
    for metric in model.metrics:
        # a Mean or Sum as such: not a metric built on one that takes (y_true, y_pred), as
        # MeanAbsoluteError and the accuracies are (per sample, left alone), nor one whose
        # update_state is replaced
        if type(metric).update_state not in plain or "update_state" in vars(metric):
            continue

        def update_state(values, sample_weight=None, _original=metric.update_state):
            if sample_weight is None and keras.ops.ndim(values) == 0:
                sample_weight = share
            return _original(values, sample_weight=sample_weight)

        object.__setattr__(metric, "update_state", update_state)
        wrapped.append(metric)
    try:
        yield
    finally:
        for metric in wrapped:
            object.__delattr__(metric, "update_state")
