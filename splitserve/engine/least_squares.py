"""Least squares for the few-coefficient step-time fits, in pure Python (no numpy, no torch:
the simulator imports it, and the engine's online fit runs it between steps): normal equations
with a small ridge, solved by elimination, and coefficients kept >= 0 (a step never gets
faster with more work)."""

from __future__ import annotations

from typing import Sequence


def normal_equations(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> tuple[list[list[float]], list[float]]:
    """(XᵀX, Xᵀy) of the rows X and targets y."""
    if not rows or len(rows) != len(ys):
        raise ValueError("least squares needs as many targets as rows, and at least one")
    k = len(rows[0])
    cols = list(zip(*rows))
    a = [[0.0] * k for _ in range(k)]
    for i in range(k):
        for j in range(i, k):
            a[i][j] = a[j][i] = sum(x * y for x, y in zip(cols[i], cols[j]))
    return a, [sum(x * y for x, y in zip(cols[i], ys)) for i in range(k)]


def nonneg_least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float], ridge: float = 1e-12
                         ) -> list[float]:
    """Coefficients x >= 0 minimising |rows·x - ys|²."""
    return nonneg_solve(*normal_equations(rows, ys), ridge=ridge)


def nonneg_solve(a: Sequence[Sequence[float]], b: Sequence[float], ridge: float = 1e-12) -> list[float]:
    """x >= 0 minimising |X·x - y|² given only XᵀX = a and Xᵀy = b: the unconstrained solution,
    then the most negative coefficient fixed at 0 and the rest refitted, until none is
    negative."""
    k = len(b)
    free = list(range(k))
    while True:
        sol = _solve([[a[i][j] for j in free] for i in free], [b[i] for i in free], ridge)
        worst = min(range(len(free)), key=lambda i: sol[i], default=None)
        if worst is None or sol[worst] >= 0:
            out = [0.0] * k
            for j, v in zip(free, sol):
                out[j] = v
            return out
        del free[worst]


def _solve(a: list[list[float]], b: list[float], ridge: float) -> list[float]:
    k = len(b)
    # scale by the columns' norms so the ridge and the pivots mean the same for every feature
    scale = [a[j][j] ** 0.5 or 1.0 for j in range(k)]
    a = [[a[i][j] / (scale[i] * scale[j]) + (ridge if i == j else 0.0) for j in range(k)] for i in range(k)]
    b = [b[i] / scale[i] for i in range(k)]
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
