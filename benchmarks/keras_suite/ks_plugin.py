"""pytest plugin: run Keras' own tests with
keras.Model.fit/evaluate/predict redirected to hyparflow.

Loaded by run.py as ``python -m pytest -p ks_plugin ...`` (this folder on PYTHONPATH).
Environment:

  KS_MODE   "plain": Keras untouched, calls only counted; "hf": calls go to hf.fit/evaluate/predict
  KS_P, KS_R        partitions and replicas given to hyparflow (KS_MODE=hf)
  KS_HF_TIMEOUT     hf's watchdog timeout in seconds (default 30 in run.py; the first step gets 3x)
  KS_OUT            directory for the per-rank result files (<KS_TAG>.rank<r>.jsonl)
  KS_TAG            name of this launch
  KS_SEED           keras.utils.set_random_seed(KS_SEED) at the start of every test (default 1337)
  KS_TMP            a directory shared by every rank of the launch: temporary directories
                    made during a test (tempfile.mkdtemp, TemporaryDirectory, Keras'
                    TestCase.get_temp_dir) get the same name on every rank there, and are not
                    deleted while the launch runs (run.py removes KS_TMP afterwards), so that
                    a file one rank writes (a checkpoint, a CSV log) is where every rank looks.

Every rank appends one "start" record when a test starts and one "end" record when it has
finished (outcome, exception, number of fit/evaluate/predict calls on a keras.Model, errors
hyparflow raised), flushed at once: when a launch dies (MPI_Abort, timeout), run.py knows
which test was running and which never started.
"""

import collections
import functools
import hashlib
import inspect
import json
import os
import re
import shutil
import sys
import tempfile
import time
import types

import pytest

MODE = os.environ.get("KS_MODE", "plain")
P = int(os.environ.get("KS_P", "1"))
R = int(os.environ.get("KS_R", "1"))
HF_TIMEOUT = float(os.environ.get("KS_HF_TIMEOUT", "60"))
RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
OUT = os.environ.get("KS_OUT")
TAG = os.environ.get("KS_TAG", "run")
TMP = os.environ.get("KS_TMP")

if MODE == "hf":
    import hyparflow as hf  # before TensorFlow: it sets the threads of this rank

SEED = int(os.environ.get("KS_SEED", "1337"))
SIZE = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
_sync = None
BARRIER_TIMEOUT = 3 * HF_TIMEOUT + 30


def _barrier(limit=None):
    """Every rank starts and ends each test together (a rank that fails an assertion early
    must not run ahead into the next test's hf.fit while another rank is still in this one).
    On a communicator of its own (never matched against hyparflow's collectives), polled
    with sleeps so that a waiting rank leaves the core to the others."""
    global _sync
    if SIZE == 1:
        return
    if _sync is None:
        from mpi4py import MPI
        _sync = MPI.COMM_WORLD.Dup()
    request = _sync.Ibarrier()
    limit = BARRIER_TIMEOUT if limit is None else limit
    deadline = time.monotonic() + limit
    while not request.Test():
        if time.monotonic() > deadline:
            # Another rank is stuck (typically in hf.fit's entry check, which waits without a
            # watchdog for this rank, which failed the test before calling it): end the job,
            # run.py relaunches the tests not yet run.
            sys.stderr.write(f"ks_plugin: rank {RANK} waited {limit:.0f} s for the "
                             f"other ranks at the start or end of {_state['nodeid']}; "
                             "aborting the job\n")
            sys.stderr.flush()
            from mpi4py import MPI
            MPI.COMM_WORLD.Abort(3)
        time.sleep(0.005)


_state = {"nodeid": None, "calls": collections.Counter(), "hf_errors": [], "depth": 0,
          "exc": None, "phase_outcomes": {}, "tmp_count": 0, "t0": 0.0}
_out_file = None


def _write(record):
    global _out_file
    if OUT is None:
        return
    if _out_file is None:
        os.makedirs(OUT, exist_ok=True)
        _out_file = open(os.path.join(OUT, f"{TAG}.rank{RANK}.jsonl"), "a")
    _out_file.write(json.dumps(record) + "\n")
    _out_file.flush()
    os.fsync(_out_file.fileno())


# ---------------------------------------------------------------- temporary directories

_real_mkdtemp = tempfile.mkdtemp
_real_rmtree = shutil.rmtree


def _called_by_test():
    """Whether the directory is asked for by the test's own code (the test module, or Keras'
    TestCase.get_temp_dir), not by a library (Keras' saving, hyparflow) running on one rank
    only, whose calls would make the ranks' numbering diverge."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == tempfile.__file__:
        frame = frame.f_back
    name = frame.f_code.co_filename if frame is not None else ""
    return name.endswith("_test.py") or name.endswith(os.path.join("testing", "test_case.py"))


def _shared_mkdtemp(suffix=None, prefix=None, dir=None):
    if TMP is None or dir is not None or _state["nodeid"] is None or not _called_by_test():
        return _real_mkdtemp(suffix, prefix, dir)
    _state["tmp_count"] += 1
    key = hashlib.sha1(_state["nodeid"].encode()).hexdigest()[:12]
    path = os.path.join(TMP, f"{prefix or 'tmp'}{key}_{_state['tmp_count']}{suffix or ''}")
    os.makedirs(path, exist_ok=True)  # every rank makes the same one
    _state.setdefault("tmpdirs", []).append(path)
    return path


def _shared_rmtree(path, *args, **kwargs):
    if TMP is not None and os.path.abspath(str(path)).startswith(os.path.abspath(TMP)):
        return None  # another rank may still read it; run.py removes KS_TMP at the end
    return _real_rmtree(path, *args, **kwargs)


tempfile.mkdtemp = _shared_mkdtemp
shutil.rmtree = _shared_rmtree


# ---------------------------------------------------------------- the redirection

def _short(exc):
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:400] if text else ''}"


def _patch():
    import keras

    for name in ("fit", "evaluate", "predict"):
        original = getattr(keras.Model, name)
        signature = inspect.signature(original)

        def wrapper(self, *args, _name=name, _original=original, _signature=signature,
                    **kwargs):
            outer = _state["depth"] == 0
            if outer:
                _state["calls"][_name] += 1
            if MODE != "hf" or not outer:
                _state["depth"] += 1  # Keras' fit calls self.evaluate: not a call of the test
                try:
                    return _original(self, *args, **kwargs)
                finally:
                    _state["depth"] -= 1
            bound = _signature.bind(self, *args, **kwargs)  # a TypeError as Keras raises it
            arguments = dict(bound.arguments)
            arguments.pop("self")
            arguments.update(arguments.pop("kwargs", {}))
            if arguments.get("batch_size") is None:  # Keras' None: 32 for arrays
                arguments.pop("batch_size", None)
            _state["depth"] += 1
            try:
                return getattr(hf, _name)(self, partitions=P, replicas=R, timeout=HF_TIMEOUT,
                                          **arguments)
            except Exception as exc:
                _state["hf_errors"].append(f"hf.{_name}: {_short(exc)}")
                raise
            finally:
                _state["depth"] -= 1

        functools.update_wrapper(wrapper, original)
        setattr(keras.Model, name, wrapper)


class _NoJax(types.ModuleType):
    """Stand-in for jax (not installed) while trainer_test.py is imported: it imports jax at
    the top and uses it only in tests for the JAX backend, which are skipped here. Not left in
    sys.modules, so Keras' own `try: import jax` keeps finding no jax."""

    def __getattr__(self, name):
        raise AttributeError(f"jax is not installed (stand-in from ks_plugin): jax.{name}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    stub = isinstance(collector, pytest.Module) and "jax" not in sys.modules
    if stub:
        sys.modules["jax"] = _NoJax("jax")
    try:
        yield
    finally:
        if stub:
            sys.modules.pop("jax", None)


def _seed_test_data():
    """Keras' test_utils.get_test_data(random_seed=None) reseeds numpy from the OS: other data
    on every rank. Give it KS_SEED instead (what a user does: the same data everywhere)."""
    from keras.src.testing import test_utils

    original = test_utils.get_test_data

    @functools.wraps(original)
    def get_test_data(*args, random_seed=None, **kwargs):
        return original(*args, random_seed=SEED if random_seed is None else random_seed,
                        **kwargs)

    test_utils.get_test_data = get_test_data


def pytest_configure(config):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    _patch()
    _seed_test_data()


# ---------------------------------------------------------------- records

def pytest_runtest_logstart(nodeid, location):
    _state.update(nodeid=nodeid, calls=collections.Counter(), hf_errors=[], exc=None,
                  phase_outcomes={}, tmp_count=0, t0=time.time())
    _state.pop("traceback", None)
    _state["tmpdirs"] = []
    _write({"event": "start", "nodeid": nodeid})
    # The same random data on every rank: many tests draw theirs from an unseeded
    # np.random, and hyparflow (rightly) refuses ranks that give it different data.
    # Seeded alike in every configuration, plain Keras included.
    import keras
    keras.utils.set_random_seed(SEED)
    _barrier()



@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and not call.excinfo.errisinstance(pytest.skip.Exception) \
            and _state["exc"] is None and report.failed:
        value = call.excinfo.value
        text = str(value).strip()
        _state["exc"] = {"phase": call.when, "type": call.excinfo.typename,
                         "message": re.sub(r"\s+", " ", text)[:1500]}


def pytest_runtest_logreport(report):
    _state["phase_outcomes"][report.when] = report.outcome
    if report.failed and "traceback" not in _state:
        # a launch that dies loses pytest's report
        _state["traceback"] = report.longreprtext[-4000:]


def pytest_runtest_logfinish(nodeid, location):
    phases = _state["phase_outcomes"]
    if "failed" in phases.values():
        outcome = "failed"
    elif phases.get("call") == "passed":
        outcome = "passed"
    elif "skipped" in phases.values():
        outcome = "skipped"
    else:
        outcome = "failed"
    _write({"event": "end", "nodeid": nodeid, "outcome": outcome,
            "calls": dict(_state["calls"]), "hf_errors": _state["hf_errors"],
            "exc": _state["exc"], "traceback": _state.pop("traceback", None),
            "tmpdirs": _state.get("tmpdirs", []),
            "seconds": round(time.time() - _state["t0"], 2)})
    # A rank that failed the test waits less: the test has failed whatever the others do.
    _barrier(20 if outcome == "failed" else None)
    _state["nodeid"] = None
