"""Multi-rank tier: a BatchNormalization ResNet trained hybrid (P=2, R=2) on the digits data set
reaches the test accuracy of single-process Keras within one percentage point."""

import re

from mpi.launch import launch


def test_hybrid_batchnorm_resnet_matches_keras_test_accuracy():
    # examples/digits.py at P=2, R=2 (two micro-batches of 16 per replica, so BatchNormalization
    # sees batch statistics of 16 samples where Keras sees 64) against model.fit from the same
    # initial weights, data and batch size; 30-50 s on 2 cores.
    code, out, err, _ = launch(4, "digits_accuracy.py", "--partitions", 2, "--replicas", 2,
                               "--epochs", 10, "--batch-size", 64, "--seed", 0, timeout=180)
    assert code == 0, f"exit {code}\n{out}\n{err[-5000:]}"
    assert "TEST ACCURACY" in out and "P=2 R=2" in out, out
    found = re.search(r"DIGITS P=2 R=2 seed=0 hyparflow=([\d.]+) keras=([\d.]+)", out)
    assert found, out
    ours, theirs = float(found[1]), float(found[2])
    assert ours > 0.9 and theirs > 0.9, out
    assert abs(ours - theirs) <= 0.01, out
