"""Model.fit's loop on each rank: epochs, steps, validation and callbacks (`loop`, `callbacks`),
checkpoints into one Keras file and the replicas' state (`checkpoint`), preemption: a
signalled job checkpoints and stops at the same step on every rank (`preemption`), and an
elastic job's backups and smaller P × R (`elastic`)."""
