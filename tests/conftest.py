"""Test settings: one TensorFlow thread, quiet logs, the tests folder importable."""

import os
import sys

os.environ.setdefault("HYPARFLOW_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hyparflow  # noqa: F401  (sets TensorFlow's threads before anything imports it)

# The cluster tier builds network namespaces (root only): `make test-cluster` runs it.
collect_ignore = [] if os.environ.get("HYPARFLOW_CLUSTER") else ["cluster"]
