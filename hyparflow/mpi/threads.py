"""Give each rank its share of the cores as TensorFlow threads."""

import os

ENV = "HYPARFLOW_THREADS"

# TensorFlow's thread variables `configure` set in this process itself (not the user): the
# launcher, which imports hyparflow too, must not hand its own share down to the ranks.
_SET_HERE = {}

# Variables that MPI launchers set to the number of ranks on this node.
_LOCAL_SIZE_VARS = (
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "MV2_COMM_WORLD_LOCAL_SIZE",
    "SLURM_NTASKS_PER_NODE",
)


def cores():
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def local_ranks():
    """Ranks sharing this node, as the launcher reports it (1 when not launched)."""
    for name in _LOCAL_SIZE_VARS:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def share():
    """Threads this rank should use: `$HYPARFLOW_THREADS`, else cores / local ranks."""
    value = os.environ.get(ENV, "")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(
                f"{ENV}={value!r} is not a positive whole number; "
                f"set it to the TensorFlow threads each rank should use, e.g. {ENV}=1."
            )
        return int(value)
    return max(1, cores() // local_ranks())


def set_here():
    """{variable: value} of TensorFlow's thread variables that `configure` set in this
    process (a launcher leaves them out of its ranks' environment)."""
    return {k: v for k, v in _SET_HERE.items() if os.environ.get(k) == v}


def in_use(kind):
    """TensorFlow's "intra" or "inter" op threads in this process: what
    ``tf.config.threading`` was set to, else ``TF_NUM_INTRAOP_THREADS`` /
    ``TF_NUM_INTEROP_THREADS`` (which TensorFlow reads as it starts and its getters do
    not report), else 0: TensorFlow's default, a thread per core."""
    import tensorflow as tf

    getter = getattr(tf.config.threading, f"get_{kind}_op_parallelism_threads")
    try:
        return getter() or max(0, int(os.environ.get(f"TF_NUM_{kind.upper()}OP_THREADS", 0)))
    except ValueError:  # not a number: TensorFlow's default
        return 0


def configure():
    """Set TensorFlow's intra- and inter-op threads to this rank's share.

    Before TensorFlow is imported this only sets ``TF_NUM_INTRAOP_THREADS`` and
    ``TF_NUM_INTEROP_THREADS`` (unless the user set them), so importing hyparflow
    stays cheap. Afterwards it uses ``tf.config.threading``, unless the user has
    already chosen thread counts or TensorFlow has started (then they are fixed).

    Returns:
        The number of intra-op threads asked for (0 means TensorFlow's default).
    """
    import sys

    if "tensorflow" not in sys.modules:
        n = share()
        for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
            if name not in os.environ:
                os.environ[name] = _SET_HERE[name] = str(n)
        return int(os.environ["TF_NUM_INTRAOP_THREADS"])
    import tensorflow as tf

    threading = tf.config.threading
    if threading.get_intra_op_parallelism_threads():
        return threading.get_intra_op_parallelism_threads()
    n = share()
    try:
        threading.set_intra_op_parallelism_threads(n)
        threading.set_inter_op_parallelism_threads(n)
    except RuntimeError:  # TensorFlow already initialised by the user's code
        return threading.get_intra_op_parallelism_threads()
    return n
