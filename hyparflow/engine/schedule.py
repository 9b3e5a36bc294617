"""Pipeline schedules as data: actions per rank of a pipeline, validation, and an ASCII timeline."""

from collections.abc import Callable
from dataclasses import dataclass

FORWARD = "F"
BACKWARD = "B"
# The weight-gradient half of a backward split in two (zero-bubble schedules): B(i) then
# computes only the partial errors of the stage's inputs (what the stage before waits for)
# and keeps the gradients at the stage's weight ops' outputs; W(i) computes the weight
# gradients from them later, filling time the stage would otherwise wait.
WEIGHT = "W"
# F(i) and B(i) of a stage that waits for no partial errors (the last), run as one
# compiled function: what `lower` makes of a forward followed at once by its backward.
FUSED = "FB"
KINDS = (FUSED, FORWARD, BACKWARD, WEIGHT)  # the order `Action.parse` tries them in


@dataclass(frozen=True, order=True)
class Action:
    """One unit of a schedule: stage `stage` runs `kind` (F, B, FB: both as one
    function, or W: the weight gradients of a split backward) on micro-batch `i`.

    Printed as ``"1F0"``: stage 1, forward, micro-batch 0; ``"1FB0"``: fused; ``"0W2"``:
    stage 0's weight gradients of micro-batch 2.
    """

    stage: int
    kind: str
    i: int

    def __str__(self):
        return f"{self.stage}{self.kind}{self.i}"

    @classmethod
    def parse(cls, text):
        """``Action.parse("1F0") == Action(1, "F", 0)``."""
        for kind in KINDS:
            if kind in text:
                stage, i = text.split(kind)
                if stage.isdigit() and i.isdigit():
                    return cls(int(stage), kind, int(i))
                break
        raise ValueError(f"{text!r} is not an action like '1F0', '0B3', '1FB2' or '0W1'")

    def parts(self):
        """The forward and backward this action runs: itself, or a fused action's two."""
        if self.kind == FUSED:
            return (Action(self.stage, FORWARD, self.i), Action(self.stage, BACKWARD, self.i))
        return (self,)


def gpipe(P, m):
    """GPipe: every stage runs all m forwards, then all m backwards.

    The last stage is the exception: its backward of micro-batch i needs nothing
    but its own forward of i, so it runs right after it (F0 B0 F1 B1 …), a pair
    that `lower` makes one fused action, which keeps no activations. Every other
    stage keeps all m micro-batches' activations.

    Returns:
        {stage: [Action, ...]} for stages 0..P-1.
    """
    _check(P, m)
    out = {s: [Action(s, FORWARD, i) for i in range(m)] + [Action(s, BACKWARD, i) for i in range(m)]
           for s in range(P - 1)}
    out[P - 1] = [Action(P - 1, kind, i) for i in range(m) for kind in (FORWARD, BACKWARD)]
    return out


def one_f_one_b(P, m):
    """1F1B (PipeDream-Flush): warm up with P − 1 − s forwards, then alternate.

    Stage s runs min(P − 1 − s, m) forwards, then one forward and one backward in
    turn, then the remaining backwards. It has GPipe's bubble but keeps at most
    P − s micro-batches' activations alive on stage s instead of m.

    Returns:
        {stage: [Action, ...]} for stages 0..P-1.
    """
    _check(P, m)
    out = {}
    for s in range(P):
        warmup = min(P - 1 - s, m)
        acts = [Action(s, FORWARD, i) for i in range(warmup)]
        for k in range(m - warmup):
            acts += [Action(s, FORWARD, warmup + k), Action(s, BACKWARD, k)]
        acts += [Action(s, BACKWARD, i) for i in range(m - warmup, m)]
        out[s] = acts
    return out


def interleaved(P, m, v=2):
    """Interleaved 1F1B (Megatron-LM's): each of the P ranks holds v chunks of the model.

    The model is cut into V = v·P stages; rank p holds stages p, p + P, …,
    p + (v − 1)·P (its chunks 0 … v − 1), so a micro-batch goes round the ranks v
    times. Each rank runs its forwards in groups of P micro-batches, chunk by chunk
    (micro-batches 0 … P − 1 through chunk 0, then through chunk 1, …, then the next
    group), and its backwards in the same order with the chunks reversed. Rank p
    warms up with 2(P − 1 − p) + (v − 1)·P forwards, then alternates one forward and
    one backward, then runs the remaining backwards.

    A chunk is 1/v of a stage's work, so the bubble is (P − 1)/(v·m) of the step
    instead of 1F1B's (P − 1)/m, for v times the messages. When P does not divide m
    the schedule is that of the next multiple of P with the missing micro-batches' actions
    left out (a schedule of whole groups runs; leaving out every action of some
    micro-batches cannot make one wait forever). The last stage (V − 1, on rank P − 1) runs each
    backward right after its forward (fused by `lower`).

    Returns:
        {rank: [Action, ...]} for ranks 0..P-1; each action names its stage (0..V-1).

    Raises:
        ValueError: v is not a whole number ≥ 1.
    """
    _check(P, m)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"chunks={v!r}: give a whole number ≥ 1 of model chunks per rank.")
    if v == 1:
        return one_f_one_b(P, m)
    groups = [range(g, g + P) for g in range(0, m, P)]  # the last one padded
    forwards = [(c, i) for group in groups for c in range(v) for i in group]
    backwards = [(c, i) for group in groups for c in reversed(range(v)) for i in group]
    out = {}
    for p in range(P):
        warmup = min(2 * (P - 1 - p) + (v - 1) * P, len(forwards))
        acts = [Action(c * P + p, FORWARD, i) for c, i in forwards[:warmup]]
        for (cf, f), (cb, b) in zip(forwards[warmup:], backwards):
            acts += [Action(cf * P + p, FORWARD, f), Action(cb * P + p, BACKWARD, b)]
        acts += [Action(c * P + p, BACKWARD, i)
                 for c, i in backwards[len(forwards) - warmup:]]
        out[p] = [a for a in acts if a.i < m]
    return out


def zero_bubble(P, m):
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with each backward
    split into B, the partial errors of the stage's inputs, and W, its weight gradients.

    Only B is on the path between stages, so the stage before gets its partial errors
    a W sooner, and a W waits while the stage has a B or a forward to run: with F, B
    and W alike (m ≥ P), 1F1B's bubble of (P − 1)(F + B + W) becomes (P − 1)(F + B).
    Stage s keeps at most P − s micro-batches (a micro-batch from its forward to its
    W), as 1F1B does, so the activation memory is 1F1B's.

    Built by running the pipeline on a clock with F, B and W one tick each: each
    stage runs, of what is ready, a B first, then a forward (while fewer than P − s
    are kept), then the oldest W. The last stage runs F, B, W back to back, unfused:
    its B sends the partial errors before its W runs.

    Returns:
        {stage: [Action, ...]} for stages 0..P-1.
    """
    _check(P, m)
    out = {s: [] for s in range(P)}
    done = {}  # (stage, kind, i) → the tick it ends
    nf, nb = [0] * P, [0] * P  # the next forward and backward of each stage
    pending = [[] for _ in range(P)]  # micro-batches whose B ran and W has not
    t = 0

    def ready(key):  # ended by tick t
        return done.get(key, t + 1) <= t

    while any(len(acts) < 3 * m for acts in out.values()):
        ran = []
        for s in range(P):
            b, f = nb[s], nf[s]
            if b < f and (s == P - 1 or ready((s + 1, BACKWARD, b))):
                a = Action(s, BACKWARD, b)
            elif f < m and (s == 0 or ready((s - 1, FORWARD, f))) and \
                    f - b + len(pending[s]) < P - s:
                a = Action(s, FORWARD, f)
            elif pending[s]:
                a = Action(s, WEIGHT, pending[s].pop(0))
            else:
                continue
            ran.append(a)
        for a in ran:
            out[a.stage].append(a)
            done[a.stage, a.kind, a.i] = t + 1
            if a.kind == FORWARD:
                nf[a.stage] += 1
            elif a.kind == BACKWARD:
                nb[a.stage] += 1
                pending[a.stage].append(a.i)
        t += 1
    return out


@dataclass(frozen=True)
class Traits:
    """A schedule hf.fit runs, by name, with the traits its callers ask of it.

    make: make(P, m) → {rank: [Action]}, or make(P, m, v) when `chunked`.
    title: what the docs call it ("zero-bubble").
    chunked: a rank holds several stages (`chunks`, v of them).
    split: each backward is split in B and W, which only the step graph runs.
    planned: when hf.plan prices it without being asked: "always", "step_graph" (when
        each step is one graph) or "listed" (only when `schedules` names it).
    """

    name: str
    make: Callable
    title: str  # what the docs call it
    chunked: bool = False
    split: bool = False
    planned: str = "always"

    def actions(self, P, m, v=1):
        """The actions on P ranks for m micro-batches, each rank holding `v` stages (a
        chunked schedule; the others hold one)."""
        return self.make(P, m, v) if self.chunked else self.make(P, m)

    def refuse_without_step_graph(self, step_graph, argument, fix="Pass step_graph=True"):
        """Raise, naming `argument` (how the caller gave the schedule and its step graph)
        and saying `fix`, if it splits the backward and `step_graph` is not True."""
        if self.split and step_graph is not True:
            raise ValueError(
                f"{argument}: the {self.title} schedule splits each backward in two (the "
                "partial errors first, the weight gradients later), which only the step "
                f"graph can do. {fix}, or use schedule='1f1b'.")


# Every schedule, in the planner's order of preference; a new one: a function and an entry.
SCHEDULES = {s.name: s for s in (
    Traits("1f1b", one_f_one_b, "1F1B"), Traits("gpipe", gpipe, "GPipe"),
    Traits("interleaved", interleaved, "interleaved 1F1B", chunked=True, planned="step_graph"),
    Traits("zb-h1", zero_bubble, "zero-bubble", split=True, planned="listed"))}


def build(schedule, P, m, v=1):
    """The actions of `schedule` (its `Traits`, or its name) on P ranks for m micro-batches,
    each rank holding `v` stages (only a chunked schedule takes v)."""
    return (by_name(schedule) if isinstance(schedule, str) else schedule).actions(P, m, v)


def by_name(name):
    """The `Traits` of the schedule called `name` (a key of `SCHEDULES`)."""
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"schedule={name!r} is not a schedule; use one of "
                         f"{', '.join(map(repr, SCHEDULES))}.") from None


def lower(schedule):
    """The schedule as the executor runs it: on the last stage, each F(i) followed at
    once by B(i) becomes one FUSED action.

    The last stage waits for no partial errors, so the backward of a micro-batch
    needs nothing but its own forward: run as one compiled function (as Keras' own
    train step runs), the pair keeps no activations between them and hands nothing
    through Python. A backward split in B and W (ZB-H1) stays split, so that its
    partial errors leave before its weight gradients are computed; unless the
    stage is the only one (nothing to send): then F, B, W become one FUSED action.
    Every other action is left as it is.
    """
    if not schedule:
        return dict(schedule)
    stages = [a.stage for acts in schedule.values() for a in acts]
    last = max(stages, default=max(schedule))
    out = dict(schedule)
    for rank, acts in schedule.items():
        if not any(a.stage == last for a in acts):
            continue
        lowered, k = [], 0
        split = {a.i for a in acts if a.stage == last and a.kind == WEIGHT}
        while k < len(acts):
            a = acts[k]
            if a.stage == last and a.kind == FORWARD and k + 1 < len(acts) and \
                    acts[k + 1] == Action(a.stage, BACKWARD, a.i) and \
                    (a.i not in split or last == 0 and k + 2 < len(acts) and
                     acts[k + 2] == Action(a.stage, WEIGHT, a.i)):
                lowered.append(Action(a.stage, FUSED, a.i))
                k += 3 if a.i in split else 2  # the fused backward's weight gradients too
            else:
                lowered.append(a)
                k += 1
        out[rank] = lowered
    return out


def live(schedule):
    """The most micro-batches whose forward ran and backward has not (nor its W, when the
    backward is split), per stage (a fused action's one while it runs), counted along the
    actions of the rank holding it."""
    out = {}
    for acts in schedule.values():
        alive = {}
        split = {(a.stage, a.i) for a in acts if a.kind == WEIGHT}
        for a in acts:
            if a.kind == FUSED:
                out[a.stage] = max(out.get(a.stage, 0), alive.get(a.stage, 0) + 1)
                continue
            if a.kind == BACKWARD and (a.stage, a.i) in split:
                continue  # kept until its W
            alive[a.stage] = alive.get(a.stage, 0) + (1 if a.kind == FORWARD else -1)
            out[a.stage] = max(out.get(a.stage, 0), alive[a.stage])
    return out


def kept(name, P, m, v=1, step_graph=False):
    """Per stage, the most micro-batches whose activations the stage keeps at once under the
    schedule called `name` (with `v` chunks a rank, interleaved): the one place the planner
    and the memory balance learn it from.

    What `live` counts of the schedule as the executor runs it (`lower`): a stage
    keeps a micro-batch from its forward to its backward (its W, ZB-H1); the last stage's
    fused actions keep one. GPipe: m on every other stage; 1F1B and ZB-H1: min(m, P − s)
    on stage s.
    Interleaved: one entry per stage of the v·P.
    In the step graph (`step_graph`) TensorFlow runs a rank's actions in dataflow order,
    not the schedule's: any forward may run before the first backward, so every stage but
    the last keeps all m, as under GPipe (measured: ResNet-110, P = 2, 1F1B in the step
    graph, a call's peak at m = 4, 6, 8 at GPipe's, where the executor's falls with m).
    """
    alive = live(lower(build(name, P, max(m, 1), v)))
    last = max(alive)
    return tuple(max(m, 1) if step_graph and s != last else alive[s] for s in sorted(alive))


def forward_only(P, m, v=1):
    """Forwards only (evaluation and prediction); with `v` chunks a rank, rank p runs its
    stages p, p + P, … in turn for each micro-batch."""
    _check(P, m)
    return {p: [Action(c * P + p, FORWARD, i) for i in range(m) for c in range(v)]
            for p in range(P)}


def _check(P, m):
    if P < 1 or m < 0:
        raise ValueError(f"a schedule needs P ≥ 1 stages and m ≥ 0 micro-batches, got P={P}, m={m}")


def simulate(schedule, producers=None, consumers=None, durations=None):
    """Run a schedule on a clock: each action starts when its rank is free and its
    inputs exist, and takes one tick (or `durations(action)`).

    F(i) needs F(i) on every producer stage; B(i) needs F(i) here and B(i) on every
    consumer stage (a chain by default: stage s-1 produces for s); W(i) needs B(i)
    here; a fused F(i)B(i) needs what its forward and its backward need from other
    stages.

    Args:
        schedule: {rank: [Action]} (with one stage a rank, rank p holds stage p; with
            several, stage c·P + p is rank p's chunk c).
        producers: {stage: [stages it receives boundary tensors from]}.
        consumers: {stage: [stages it sends boundary tensors to]}.
        durations: how long each action takes (None: one tick each).

    Returns:
        {Action: when it starts} (the tick, with unit durations).

    Raises:
        ValueError: the schedule cannot run (an action waits forever); the message
            shows the grid of what ran and marks the stuck actions.
    """
    V = 1 + max([a.stage for acts in schedule.values() for a in acts] + [len(schedule) - 1])
    producers = producers or {s: ([s - 1] if s else []) for s in range(V)}
    consumers = consumers or {s: ([s + 1] if s < V - 1 else []) for s in range(V)}
    _check_each_once(schedule)
    starts, ends = {}, {}  # ends: each forward and backward run (a fused action's two)
    position = dict.fromkeys(schedule, 0)
    free = dict.fromkeys(schedule, 0)
    moved = True
    while moved:
        moved = False
        for s, acts in schedule.items():
            while position[s] < len(acts):
                a = acts[position[s]]
                deps = _needs(a, producers[a.stage], consumers[a.stage])
                if not all(d in ends for d in deps):
                    break
                starts[a] = max([free[s]] + [ends[d] for d in deps])
                free[s] = starts[a] + (1 if durations is None else durations(a))
                for part in a.parts():
                    ends[part] = free[s]
                position[s] += 1
                moved = True
    stuck = [schedule[s][position[s]] for s in schedule if position[s] < len(schedule[s])]
    if stuck:
        raise ValueError("schedule cannot run: these actions wait forever: "
                         + ", ".join(map(str, stuck)) + "\n" + render(schedule, starts, stuck))
    return starts


def _needs(a, producers, consumers):
    """The runs on this and other stages that action `a` waits for."""
    needs = []
    for part in a.parts():
        if part.kind == FORWARD:
            needs += [Action(p, FORWARD, a.i) for p in producers]
        elif part.kind == WEIGHT:
            needs.append(Action(a.stage, BACKWARD, a.i))
        else:
            needs += [Action(c, BACKWARD, a.i) for c in consumers]
            if a.kind == BACKWARD:
                needs.append(Action(a.stage, FORWARD, a.i))
    return needs


def _check_each_once(schedule):
    P = len(schedule)  # stage c·P + p is rank p's chunk c
    for s, acts in schedule.items():
        seen = set()
        for a in acts:
            if a.stage % P != s:
                raise ValueError(f"action {a} is listed under rank {s}, but stage {a.stage} "
                                 f"is rank {a.stage % P}'s")
            for part in a.parts():
                if part in seen:
                    raise ValueError(f"action {part} appears twice on stage {s}")
                before = {BACKWARD: FORWARD, WEIGHT: BACKWARD}.get(part.kind)
                if before and Action(a.stage, before, a.i) not in seen:
                    raise ValueError(f"action {a} runs before {Action(a.stage, before, a.i)} "
                                     f"on stage {a.stage}")
                seen.add(part)


def render(schedule, times=None, mark=()):
    """ASCII timeline: one row per stage (or per rank, when a rank holds several), one
    column per tick.

    Example (``render(gpipe(2, 2))``)::

        stage 0 | 0F0 0F1         0B0 0B1
        stage 1 |     1F0 1F1 1B0 1B1
    """
    if times is None:
        times = simulate(schedule)
    column = {t: k for k, t in enumerate(sorted(set(times.values())))}  # any clock: in order
    times = {a: column[t] for a, t in times.items()}
    width = max([len(str(a)) for acts in schedule.values() for a in acts] + [3])
    last = max(times.values(), default=-1)
    rows = []
    label = "stage" if all(a.stage == s for s, acts in schedule.items() for a in acts) \
        else "rank"
    for s in sorted(schedule):
        cells = [" " * width] * (last + 1)
        for a in schedule[s]:
            if a in times:
                cells[times[a]] = str(a).ljust(width)
        row = f"{label} {s} | " + " ".join(cells).rstrip()
        pending = [a for a in schedule[s] if a in mark]
        if pending:
            row += f"   <-- waiting: {', '.join(map(str, pending))}"
        rows.append(row)
    return "\n".join(rows)
