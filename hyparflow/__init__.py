"""hyparflow: train any Keras model with data, pipeline or hybrid parallelism over MPI."""

import os as _os
import sys as _sys

from hyparflow import quiet as _quiet
from hyparflow.mpi import comm as _comm
from hyparflow.mpi import placement as _placement
from hyparflow.mpi import signals as _signals
from hyparflow.mpi import threads as _threads

if "tensorflow" not in _sys.modules:  # one banner per rank is noise; the user can override
    _os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if _comm.launched():  # what that leaves (absl starts late): see hyparflow.quiet
        _quiet.install()
_threads.configure()
_signals.install_carriers()  # under hyparflow-run: SIGTERM and SIGHUP as themselves
if _comm.launched():
    if "mpi4py.MPI" not in _sys.modules:  # MPI reads its parameters when it starts
        _comm.progress_between_nodes()
    _comm.install_abort_hook()
    _placement.PINNED_GPU = _placement.pin_gpu()

__version__ = "0.1.0"

__all__ = ["Preempted", "Schedule", "Topology", "Trace", "evaluate", "fit", "partition", "plan",
           "predict", "save", "__version__"]

_LAZY = {"fit": ("hyparflow.api", "fit"),
         "Preempted": ("hyparflow.training.preemption", "Preempted"),
         "Schedule": ("hyparflow.arguments", "Schedule"),
         "Trace": ("hyparflow.training.callbacks", "Trace"),
         "evaluate": ("hyparflow.api", "evaluate"),
         "predict": ("hyparflow.api", "predict"),
         "save": ("hyparflow.api", "save"),
         "partition": ("hyparflow.partitioner", "partition"),
         "plan": ("hyparflow.planner", "plan"),
         "Topology": ("hyparflow.mpi.topology", "Topology")}


def __getattr__(name):
    """Import the public names on first use, so that `hyparflow.run` starts fast."""
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        try:
            value = getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as exc:
            if exc.name not in ("tensorflow", "keras"):
                raise
            raise ImportError(
                f"hyparflow needs TensorFlow ≥ 2.16 with Keras 3, and {exc.name} is not "
                "installed: pip install 'hyparflow[cpu]' (or 'hyparflow[gpu]'), or load "
                "your site's TensorFlow module.") from exc
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hyparflow' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
