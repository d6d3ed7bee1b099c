"""Pictures of the analyses as uint8 RGB arrays (what W&B images need) and PNG files.

matplotlib with the non-interactive Agg canvas: no display, no global pyplot state shared with a
user's own figures (figures are built from `Figure` directly, never through `pyplot`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _to_array(fig: Figure) -> np.ndarray:
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].astype(np.uint8).copy()


def contour_image(alphas: Sequence[float], betas: Sequence[float], values: Sequence[Sequence[float]],
                  title: str, xlabel: str = "direction 1", ylabel: str = "direction 2",
                  levels: int = 20) -> np.ndarray:
    """Filled contour of values[i][j] at (alphas[i], betas[j])."""
    z = np.asarray(values, dtype=np.float64).T  # rows = betas (y), columns = alphas (x)
    fig = Figure(figsize=(5, 4), dpi=80, layout="constrained")
    ax = fig.add_subplot()
    finite = z[np.isfinite(z)]
    if finite.size and finite.max() > finite.min():
        cs = ax.contourf(alphas, betas, z, levels=levels, cmap="viridis")
        ax.contour(alphas, betas, z, levels=levels, colors="k", linewidths=0.3)
        fig.colorbar(cs, ax=ax)
    else:
        ax.imshow(z, origin="lower", extent=(alphas[0], alphas[-1], betas[0], betas[-1]), aspect="auto")
    ax.plot([0], [0], "r+")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    return _to_array(fig)


MAX_HEATMAP_INCHES = 16.0  # at 80 dpi: 1,280 pixels


def heatmap_image(matrix: np.ndarray, title: str, xlabel: str, ylabel: str, annotate: bool | None = None,
                  fmt: str = "{:.0f}") -> np.ndarray:
    """A rows x columns heatmap (clients x classes); numbers written in the cells when small."""
    m = np.asarray(matrix, dtype=np.float64)
    rows, cols = m.shape
    # A row per client up to MAX_HEATMAP_INCHES; beyond that (1,000 clients would make a picture
    # 17,700 pixels tall and cost a quarter of a GiB to draw) rows share pixels, averaged by
    # matplotlib's antialiasing; the exact numbers are in the JSON file and the W&B table.
    height = min(max(3.0, 0.22 * rows + 1.5), MAX_HEATMAP_INCHES)
    fig = Figure(figsize=(max(4.0, 0.45 * cols + 2), height), dpi=80, layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(np.ma.masked_invalid(m), aspect="auto", cmap="magma",
                   interpolation="nearest" if height > 0.22 * rows else "antialiased")
    fig.colorbar(im, ax=ax)
    if annotate if annotate is not None else rows * cols <= 400:
        middle = np.nanmean([np.nanmin(m), np.nanmax(m)]) if np.isfinite(m).any() else 0.0
        for i in range(rows):
            for j in range(cols):
                if np.isfinite(m[i, j]):
                    ax.text(j, i, fmt.format(m[i, j]), ha="center", va="center", fontsize=6,
                            color="k" if m[i, j] > middle else "w")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    return _to_array(fig)


def curve_image(x: Sequence[float], ys: dict[str, Sequence[float]], title: str, xlabel: str) -> np.ndarray:
    fig = Figure(figsize=(5, 3.5), dpi=80, layout="constrained")
    ax = fig.add_subplot()
    for label, y in ys.items():
        ax.plot(x, y, marker=".", label=label)
    ax.legend()
    ax.set(title=title, xlabel=xlabel)
    return _to_array(fig)


def save_png(image: np.ndarray, path: Path) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path)
