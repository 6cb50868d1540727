"""Evaluation estimators over sampled completions: pass@k and avg@k.

Example:
    >>> round(pass_at_k(n=4, c=1, k=2), 4)  # 1 - C(3, 2) / C(4, 2)
    0.5
"""

from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code"): the chance that ``k`` of the samples drawn without replacement hold
    at least one correct, ``1 - C(n - c, k) / C(n, k)``; ``k <= n``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: expected 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_up_to(n: int) -> list[int]:
    """The k reported for ``n`` samples: 1, 2, 4, ... below ``n``, and ``n``."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


__all__ = ["ks_up_to", "pass_at_k"]
