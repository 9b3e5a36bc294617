"""Keras as hyparflow trains it: every private Keras name behind one door (`keras_private`),
and what `model.fit` promises, rebuilt for a batch cut into pieces — the model's own losses
and metrics (`user_loss`, `batch_values`), losses that do not add up over pieces
(`reduction`), BatchNormalization over micro-batches and replicas (`batch_norm`), optimizer
steps (`optimizers`), variables and layer state merged over replicas (`variables`,
`replica_state`). Imports `mpi` only."""
