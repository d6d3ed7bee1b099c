"""How many "plain" steps a client's momentum steps are worth (SCAFFOLD's K, FedNova's a_i)."""

from __future__ import annotations


def effective_steps(steps: int, momentum: float) -> float:
    """Total weight heavy-ball SGD gives its gradients over `steps` steps from a zero buffer:
    sum_k sum_{j<=K-k} m^j = (K - m(1 - m^K)/(1 - m)) / (1 - m); K when m = 0. The displacement
    of K momentum steps is lr * this * (average gradient), so it is what normalises a client's
    update into "one step's worth" of gradient (FedNova's a_i, SCAFFOLD's K in the official code).
    """
    if momentum == 0:
        return float(steps)
    m = float(momentum)
    return (steps - m * (1 - m**steps) / (1 - m)) / (1 - m)
