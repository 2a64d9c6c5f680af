"""Least squares for the few-coefficient step-time fits, in pure Python (no numpy, no torch in
the simulator's import path): normal equations with a small ridge, solved by elimination, and
coefficients kept >= 0 (a step never gets faster with more work)."""

from __future__ import annotations

from typing import Sequence


def nonneg_least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float], ridge: float = 1e-12
                         ) -> list[float]:
    """Coefficients x >= 0 minimising |rows·x - ys|²: unconstrained least squares, then the most
    negative coefficient fixed at 0 and the rest refitted, until none is negative."""
    if not rows or len(rows) != len(ys):
        raise ValueError("least squares needs as many targets as rows, and at least one")
    k = len(rows[0])
    free = list(range(k))
    while True:
        sol = _solve([[r[j] for j in free] for r in rows], ys, ridge)
        worst = min(range(len(free)), key=lambda i: sol[i], default=None)
        if worst is None or sol[worst] >= 0:
            out = [0.0] * k
            for j, v in zip(free, sol):
                out[j] = v
            return out
        del free[worst]


def _solve(rows: Sequence[Sequence[float]], ys: Sequence[float], ridge: float) -> list[float]:
    k = len(rows[0]) if rows else 0
    if k == 0:
        return []
    # scale columns so the ridge and the pivots mean the same for every feature
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    a = [[sum(r[i] * r[j] for r in rows) / (scale[i] * scale[j]) + (ridge if i == j else 0.0) for j in range(k)]
         for i in range(k)]
    b = [sum(r[i] * y for r, y in zip(rows, ys)) / scale[i] for i in range(k)]
    for c in range(k):  # Gauss-Jordan with partial pivoting
        p = max(range(c, k), key=lambda i: abs(a[i][c]))
        a[c], a[p], b[c], b[p] = a[p], a[c], b[p], b[c]
        if abs(a[c][c]) < 1e-300:
            continue
        for i in range(k):
            if i != c and a[i][c]:
                f = a[i][c] / a[c][c]
                a[i] = [x - f * y for x, y in zip(a[i], a[c])]
                b[i] -= f * b[c]
    return [(b[i] / a[i][i] if abs(a[i][i]) >= 1e-300 else 0.0) / scale[i] for i in range(k)]
