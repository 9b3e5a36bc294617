"""Python ops inside a compiled step, what they raise raised again as itself; among them the
gradients' sums over a stage's replicas (MPI's fused allreduce, sparse rows gathered)."""

import contextlib

import tensorflow as tf


class PythonOps:
    """Puts Python ops (`tf.py_function`) into the graph being traced; an exception one
    raises (a watchdog's report, a peer's failure) reaches the caller of the compiled
    function wrapped by TensorFlow, and `raised` unwraps it."""

    def __init__(self):
        self._error = None

    def op(self, body, tensors, dtypes, name, after=()):
        """A Python op running `body(*tensors)` (eager tensors) after the `after` tensors and
        ops, for outputs of `dtypes` (one dtype: one tensor); what it raises is kept."""
        def call(*args):
            try:
                return body(*args)
            except BaseException as exc:
                self._error = exc
                raise
        with tf.control_dependencies(list(after)):
            return tf.py_function(call, list(tensors), dtypes, name=f"hyparflow_{name}")

    @contextlib.contextmanager
    def raised(self):
        """Around a call of the compiled function: an exception its Python ops raised is
        raised again as itself (not as TensorFlow's wrapping of it)."""
        self._error = None
        try:
            yield
        except Exception:
            if self._error is not None:
                error, self._error = self._error, None
                raise error from None
            raise


class GraphSums(PythonOps):
    """Puts into the graph being traced the ops that combine a list of gradients over the
    replicas.

    `sum_dense(arrays)` sums a list of numpy arrays over the replicas (one fused
    allreduce) and returns the sums; `gather_rows(indices, values)` returns a sparse
    gradient's rows of every replica, concatenated in replica order. What either raises
    is raised again as itself by `raised`.
    """

    def __init__(self, sum_dense, gather_rows):
        super().__init__()
        self.sum_dense, self.gather_rows = sum_dense, gather_rows

    def __call__(self, grads):
        """`grads` (tensors, IndexedSlices or None) combined: dense ones summed in one op,
        sparse ones' rows gathered, None kept."""
        grads = list(grads)
        dense = [k for k, g in enumerate(grads)
                 if g is not None and not isinstance(g, tf.IndexedSlices)]
        if dense:
            summed = self.op(lambda *gs: self.sum_dense([g.numpy() for g in gs]),
                             [grads[k] for k in dense], [grads[k].dtype for k in dense],
                             "allreduce")
            for k, g in zip(dense, summed):
                g.set_shape(grads[k].shape)
                grads[k] = g
        for k, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                indices, values = self.op(
                    lambda i, v: self.gather_rows(i.numpy(), v.numpy()),
                    [g.indices, g.values], [g.indices.dtype, g.values.dtype], "gather_rows")
                indices.set_shape([None])
                values.set_shape([None] + list(g.values.shape[1:]))
                grads[k] = tf.IndexedSlices(values, indices, g.dense_shape)
        return grads
