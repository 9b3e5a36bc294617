"""The data path: what a rank takes from each global batch (`batches`: its replica's share, cut
into micro-batches, epoch by epoch as Model.fit's iterator hands them out), from every kind
of input (`sources`: arrays, `tfdata`, `pydata` for generators and PyDatasets) and checked
to be the same on every rank; `streams` carries a stage's inputs that are not tensors."""
