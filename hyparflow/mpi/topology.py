"""Rank ↔ (replica, stage), and the communicators of a pipeline and of a stage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing mpi4py.MPI initialises MPI
    from mpi4py import MPI


@dataclass(frozen=True)
class Topology:
    """Where one rank sits in a grid of `replicas` pipelines of `partitions` stages.

    Ranks are laid out pipeline by pipeline: rank = replica * partitions + stage,
    so consecutive stages of a pipeline are neighbouring ranks (and, with the usual
    block placement of ranks on nodes, on the same node).

    Example:
        >>> t = Topology(partitions=2, replicas=2, rank=3)
        >>> t.replica, t.stage
        (1, 1)
        >>> t.rank_of(replica=0, stage=1)
        1
    """

    partitions: int
    replicas: int
    rank: int = 0
    chunks: int = 1  # stages each rank holds (the interleaved schedule): P × chunks in all

    def __post_init__(self) -> None:
        for name in ("partitions", "replicas", "chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a whole number ≥ 1.")
        if not 0 <= self.rank < self.size:
            raise ValueError(
                f"rank={self.rank} is outside 0..{self.size - 1} for "
                f"partitions={self.partitions} × replicas={self.replicas}."
            )

    @property
    def size(self) -> int:
        """Ranks in the whole job: partitions × replicas."""
        return self.partitions * self.replicas

    @property
    def replica(self) -> int:
        return self.rank // self.partitions

    @property
    def stage(self) -> int:
        """This rank's place in its pipeline, 0..P-1: the stage it holds (with several
        chunks, the first of them)."""
        return self.rank % self.partitions

    @property
    def stages(self) -> tuple[int, ...]:
        """The stages this rank holds: its place, then every P-th one after it (chunks)."""
        return tuple(self.stage + c * self.partitions for c in range(self.chunks))

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.partitions - 1

    @property
    def logging_rank(self) -> int:
        """The rank that prints: replica 0's last stage, which computes the loss."""
        return self.rank_of(0, self.partitions - 1)

    def rank_of(self, replica: int, stage: int) -> int:
        """World rank holding `stage` of `replica`."""
        return replica * self.partitions + stage % self.partitions

    def where(self, rank: int | None = None) -> str:
        """'rank 3 (replica 1, stage 1)' for messages."""
        rank = self.rank if rank is None else rank
        place = rank % self.partitions
        held = f"stage {place}" if self.chunks == 1 else "stages " + ", ".join(
            str(place + c * self.partitions) for c in range(self.chunks))
        return f"rank {rank} (replica {rank // self.partitions}, {held})"

    def grid(self) -> str:
        """ASCII table of ranks: one row per replica, one column per stage."""
        head = "replica \\ stage | " + " ".join(f"{s:>4}" for s in range(self.partitions))
        rows = [head, "-" * len(head)]
        for r in range(self.replicas):
            cells = " ".join(f"{self.rank_of(r, s):>4}" for s in range(self.partitions))
            rows.append(f"{r:>15} | {cells}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return (f"Topology(partitions={self.partitions}, replicas={self.replicas}): "
                f"{self.where()}")

    def communicators(self, comm: MPI.Intracomm) -> tuple[MPI.Intracomm, MPI.Intracomm]:
        """Split `comm` into this rank's pipeline and stage communicators.

        Returns:
            (pipeline, stage_group): `pipeline` holds the P ranks of this replica,
            ranked by stage; `stage_group` holds the R ranks holding this stage,
            ranked by replica.
        """
        from hyparflow.mpi import comm as comm_

        pipeline = comm_.split(comm, self.replica, self.stage)
        stage_group = comm_.split(comm, self.stage, self.replica)
        return pipeline, stage_group
