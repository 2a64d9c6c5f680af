"""The PNG of a bench run: empirical CDFs of TTFT, TPOT and end-to-end latency (successful requests).

matplotlib is imported lazily, with the non-interactive Agg backend, so it is only needed when a
plot is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from splitserve.bench.client import RequestResult


def latency_series(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Per metric, the sorted latencies in ms of the successful requests."""
    ok = [r for r in results if r.ok]
    series = {
        "TTFT": [r.ttft_s for r in ok if r.ttft_s is not None],
        "TPOT": [r.tpot_s for r in ok if r.tpot_s is not None],
        "E2E": [r.e2e_s for r in ok],
    }
    return {k: sorted(v * 1000.0 for v in vs) for k, vs in series.items()}


def plot_cdfs(results: Sequence[RequestResult], path: str | Path, title: str = "") -> Path:
    """Write the three latency CDFs side by side to `path` (PNG); return the path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("the latency plot needs matplotlib: pip install matplotlib") from e
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (name, values) in zip(axes, latency_series(results).items()):
        draw_cdf(ax, name, values)
    return save(fig, path, title)


def draw_cdf(ax, name: str, values_ms: Sequence[float]) -> None:
    """One latency's empirical CDF on `ax` from its sorted values in ms ("no samples" if none)."""
    if values_ms:
        ax.step(values_ms, [(i + 1) / len(values_ms) for i in range(len(values_ms))], where="post")
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    ax.set(title=f"{name} CDF", xlabel=f"{name} (ms)", ylabel="fraction of requests", ylim=(0, 1.02))
    ax.grid(alpha=0.3)


def save(fig, path: str | Path, title: str = "") -> Path:
    """Title, lay out and write `fig` as a PNG, then free it."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
