"""The exact min–max contiguous split of a model's calls into stages, cut costs included."""

import numpy as np


def tieable(layer):
    """Whether a layer called at several places may have its calls on several stages: its
    weights are all trainable (each stage holds them, their gradients summed over those
    stages: `hyparflow.engine.tied`); state it updates in its calls (a BatchNormalization's
    statistics, a Dropout's seed) would move on each stage apart."""
    return not layer.non_trainable_weights


def allowed_starts(graph, tie=False):
    """Which calls may start a stage: not inside the span of a layer called at several places
    (with `tie`, only of one that is not `tieable`), nor between a tensor of strings and a
    call that reads it (only numbers cross a cut), nor between a tensor given a mask at run
    time that the graph does not record (`LayerGraph.masked_at_run`) and a call reading it.

    Returns:
        A boolean array of length ``len(graph) + 1``; entry ``c`` says whether a
        stage may start at call ``c`` (entries 0 and n are True).
    """
    ok = np.ones(len(graph) + 1, bool)
    for indices in graph.layer_calls().values():
        if tie and tieable(graph.calls[indices[0]].layer):
            continue
        ok[min(indices) + 1:max(indices) + 1] = False
    for k in strings(graph) + list(graph.masked_at_run):
        ok[graph.producer[k] + 1:max(graph.consumers.get(k, [0])) + 1] = False
    ok[0] = ok[-1] = True
    return ok


def cuts_for(graph, partitions):
    """The allowed stage starts for `partitions` stages: a shared layer's calls kept together
    where enough cuts remain, else each tieable one's weights tied across its stages."""
    allowed = allowed_starts(graph)
    if partitions > int(allowed[1:-1].sum()) + 1:
        allowed = allowed_starts(graph, tie=True)
    return allowed


def strings(graph):
    """The keys of the tensors of strings the model's calls make (its inputs not included:
    every stage reads those from the data)."""
    return [k for k, t in graph.tensors.items()
            if graph.producer[k] is not None and str(t.dtype) == "string"]


class _Boundary:
    """For each end ``b``, what the tensors crossing ``a`` and ``b`` cost, for every ``a < b``."""

    def __init__(self, graph, weights):
        n = len(graph)
        keys = [k for k, w in weights.items() if w > 0 and graph.producer[k] is not None]
        outputs = set(graph.outputs)
        self.n = n
        self.p = np.array([graph.producer[k] for k in keys], int)
        self.w = np.array([weights[k] for k in keys], float)
        last = [max(graph.consumers.get(k, [-1]) + ([n - 1] if k in outputs else [])) for k in keys]
        self.last = np.array(last, int)
        # The latest consumer before the current end, per tensor (-1: none yet).
        self.latest = np.full(len(keys), -1, int)
        self.consumed_by = {}
        for j, k in enumerate(keys):
            for c in graph.consumers.get(k, []):
                self.consumed_by.setdefault(c, []).append(j)
            if k in outputs:  # the last stage receives every model output
                self.consumed_by.setdefault(n - 1, []).append(j)

    def ending_at(self, b):
        """Received + sent cost of stage ``[a, b)`` for every ``a`` in ``0 .. b-1``."""
        n, p, w = self.n, self.p, self.w
        for j in self.consumed_by.get(b - 1, []):
            self.latest[j] = b - 1
        # Received: produced before a, consumed in [a, b): a in (p, latest].
        sel = self.latest > p
        diff = (np.bincount(p[sel] + 1, w[sel], minlength=n + 2)
                - np.bincount(self.latest[sel] + 1, w[sel], minlength=n + 2))
        received = np.cumsum(diff)[:b]
        # Sent: produced in [a, b), needed at or after b: a ≤ p < b ≤ last.
        sel = (p < b) & (self.last >= b)
        hist = np.bincount(p[sel], w[sel], minlength=n)
        sent = np.cumsum(hist[::-1])[::-1][:b]
        return received + sent


def _prefixes(costs, parts):
    """Per stage, the prefix sums of its fixed per-call costs: `Costs.calls`, or
    `Costs.last` on the last stage when given."""
    calls = np.concatenate([[0.0], np.cumsum(costs.calls)])
    last = calls if costs.last is None else np.concatenate([[0.0], np.cumsum(costs.last)])
    return [last if s == parts - 1 else calls for s in range(parts)]


def _scaled(boundary, b, prefix_acts):
    """The scaled cost (activations and boundary tensors) of stage [a, b) for every a < b;
    see `Costs`."""
    scaled = prefix_acts[b] - prefix_acts[:b]
    if boundary is not None:
        scaled = scaled + boundary.ending_at(b)
    return scaled


def split(costs, parts, graph=None, allowed=None):
    """Cut the calls into `parts` contiguous non-empty stages, minimising the costliest.

    Exact over every contiguous split whose stage starts are `allowed`: a
    dynamic program over (stage, end) with every stage's cost computed in full —
    its calls, and, when `costs` accounts for communication, the boundary tensors
    it receives and sends. Among the optimal splits it then picks the one with
    the smallest sum of squared stage costs (the most even), by a second
    dynamic program capped at the optimum.

    Args:
        costs: a `Costs`.
        parts: the number of stages P.
        graph: the `LayerGraph` (needed when `costs` communicates).
        allowed: booleans per call index (length n + 1): may a stage start there.

    Returns:
        (sizes, stage_costs): calls per stage and each stage's predicted cost.

    Raises:
        ValueError: no split into `parts` stages exists with the allowed starts.

    Example:
        >>> split(Costs("layers", "calls", np.array([1., 2, 3, 4, 5]), np.zeros(5), {}), 2)[0]
        [3, 2]
    """
    n = len(costs.calls)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} calls into {parts} non-empty stages")
    allowed = np.ones(n + 1, bool) if allowed is None else np.asarray(allowed, bool)
    prefix_calls = _prefixes(costs, parts)
    prefix_acts = np.concatenate([[0.0], np.cumsum(costs.activations)])
    factors = [costs.per_stage(s) for s in range(parts)]

    def sweep(combine, cap):
        """best[s][b]: combine over stages 0..s ending at b; choice[s][b]: where s starts."""
        boundary = _Boundary(graph, costs.tensors) if costs.communicates else None
        best = np.full((parts, n + 1), np.inf)
        choice = np.zeros((parts, n + 1), int)
        for b in range(1, n + 1):
            if not allowed[b]:
                if boundary is not None:
                    boundary.ending_at(b)  # keeps its per-tensor state current
                continue
            scaled = _scaled(boundary, b, prefix_acts)
            for s in range(min(parts, b)):
                c = prefix_calls[s][b] - prefix_calls[s][:b] + factors[s] * scaled
                if s == 0:
                    if c[0] <= cap:
                        best[0][b] = combine(0.0, c[0])
                    continue
                cand = np.where(c <= cap, combine(best[s - 1][:b], c), np.inf)
                a = int(np.argmin(cand))
                best[s][b], choice[s][b] = cand[a], a
        return best, choice

    best, _ = sweep(np.maximum, np.inf)
    worst = best[parts - 1][n]
    if not np.isfinite(worst):
        raise ValueError(f"no split of {n} calls into {parts} stages starts only where allowed")
    cap = worst + 1e-9 * abs(worst) + 1e-12
    _, choice = sweep(lambda before, c: before + c * c, cap)
    bounds = [n]
    for s in range(parts - 1, 0, -1):
        bounds.append(int(choice[s][bounds[-1]]))
    bounds = [0] + bounds[::-1]
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    return sizes, stage_costs(costs, graph, bounds)


def stage_costs(costs, graph, bounds):
    """The predicted cost of each stage ``[bounds[s], bounds[s+1])``."""
    boundary = _Boundary(graph, costs.tensors) if costs.communicates else None
    prefix_calls = _prefixes(costs, len(bounds) - 1)
    prefix_acts = np.concatenate([[0.0], np.cumsum(costs.activations)])
    ends = {b: s for s, b in enumerate(bounds[1:])}
    out = [0.0] * (len(bounds) - 1)
    for b in range(1, bounds[-1] + 1):
        if boundary is not None and b not in ends:
            boundary.ending_at(b)
        elif b in ends:
            s = ends[b]
            scaled = _scaled(boundary, b, prefix_acts)
            a = bounds[s]
            out[s] = float(prefix_calls[s][b] - prefix_calls[s][a]
                           + costs.per_stage(s) * scaled[a])
    return out
