"""Cutting a Keras model's layer graph into pipeline stages."""

from hyparflow.partitioner.split import Partition, Stage, partition

__all__ = ["Partition", "Stage", "partition"]
