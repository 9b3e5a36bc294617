"""Per-call costs and the exact min–max contiguous split of the calls into stages."""

import bisect
import itertools

METHODS = ("params", "layers")


def costs(graph, method="params"):
    """Cost of each call in `graph`, in topological order.

    Args:
        graph: a `LayerGraph`.
        method: ``"params"`` — parameters of the called layer, counted on its first
            call only, plus one so that parameter-free layers (activations,
            additions) still spread over stages; ``"layers"`` — one per call.

    Returns:
        A list of non-negative integers, one per call.
    """
    if method == "layers":
        return [1] * len(graph)
    if method == "params":
        seen = set()
        out = []
        for call in graph.calls:
            layer = call.layer
            params = 0
            if id(layer) not in seen:
                seen.add(id(layer))
                params = sum(int(_size(w)) for w in getattr(layer, "weights", []))
            out.append(params + 1)
        return out
    raise ValueError(
        f"balance={method!r} is not a balance method; use one of {', '.join(map(repr, METHODS))}, "
        "a list of layer counts per stage, or a list of layer names that start stages 1..P-1."
    )


def _size(weight):
    n = 1
    for d in weight.shape:
        n *= int(d)
    return n


def _parts_within(prefix, limit, parts):
    """Greedy cut points into exactly `parts` non-empty pieces each costing ≤ limit, or None."""
    n = len(prefix) - 1
    cuts = []
    start = 0
    for k in range(parts - 1):
        # Furthest end with cost ≤ limit, leaving one call for each later part.
        end = bisect.bisect_right(prefix, prefix[start] + limit, lo=start + 1) - 1
        end = min(end, n - (parts - 1 - k))
        if end <= start:
            return None
        cuts.append(end)
        start = end
    if prefix[n] - prefix[start] > limit:
        return None
    return cuts


def min_max_split(costs_, parts):
    """Split `costs_` into `parts` contiguous non-empty pieces minimising the largest sum.

    Exact for integer costs: binary search on the largest sum, each probe a greedy
    fill. Among optimal splits it returns the one whose earlier pieces are fullest.

    Returns:
        The sizes of the pieces (each ≥ 1, summing to ``len(costs_)``).

    Example:
        >>> min_max_split([1, 2, 3, 4, 5], 2)
        [3, 2]
    """
    n = len(costs_)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} calls into {parts} non-empty stages")
    prefix = list(itertools.accumulate(costs_, initial=0))
    lo, hi = max(costs_), prefix[-1]
    while lo < hi:
        mid = (lo + hi) // 2
        if _parts_within(prefix, mid, parts) is None:
            lo = mid + 1
        else:
            hi = mid
    cuts = _parts_within(prefix, lo, parts)
    bounds = [0] + cuts + [n]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def brute_force_split(costs_, parts):
    """The smallest achievable largest piece, by trying every split (for tests)."""
    n = len(costs_)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0,) + cuts + (n,)
        worst = max(sum(costs_[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best
