"""The pipeline engine: schedules as data (`schedule`), a stage's compiled forward and backward
(`stage`), the executor that runs a rank's actions of each step and exchanges its messages
and gradients (`executor`; `step_graph` runs a whole step as one graph, `own_steps` a
model's own train_step), gradient buckets over replicas (`buckets`), the optimizer state
sharded over replicas (`shard`) and weights several stages hold (`tied`)."""
