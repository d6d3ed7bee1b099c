"""Pictures of the analyses as uint8 RGB arrays (what W&B images need) and PNG files.

matplotlib with the non-interactive Agg canvas: no display, no global pyplot state shared with a
user's own figures (figures are built from `Figure` directly, never through `pyplot`).
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fl_lightning.atomic import atomic_write_bytes


def _to_array(fig: Figure) -> np.ndarray:
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    return _pixels(canvas)


def _pixels(canvas: FigureCanvasAgg) -> np.ndarray:
    """What `canvas` holds now, as an RGB array of its own (the canvas draws on)."""
    return np.asarray(canvas.buffer_rgba())[..., :3].astype(np.uint8).copy()


def contour_image(*args, **kwargs) -> np.ndarray:
    """`contour_figure` as an RGB array."""
    return _to_array(contour_figure(*args, **kwargs))


def contour_figure(alphas: Sequence[float], betas: Sequence[float], values: Sequence[Sequence[float]],
                   title: str, xlabel: str = "direction 1", ylabel: str = "direction 2",
                   levels: int = 20, quantity: str = "loss", clip: bool = True, best: str = "min") -> Figure:
    """Filled contour of values[i][j] at (alphas[i], betas[j]), the colorbar labelled `quantity`,
    the model itself (0, 0) a red +, the grid's best point (`best`: "min" for a loss, "max" for an
    accuracy) a white star, drawn over the frame when it lies on the grid's edge. With `clip`, a
    surface whose edge climbs far above its basin (a loss of 52 around a basin of 2) gets levels up
    to its 75th percentile, so the basin keeps its contours; higher values share the top colour."""
    z = np.asarray(values, dtype=np.float64).T  # rows = betas (y), columns = alphas (x)
    fig = Figure(figsize=(5.2, 4), dpi=80, layout="constrained")
    ax = fig.add_subplot()
    finite = z[np.isfinite(z)]
    if finite.size and finite.max() > finite.min():
        low, top = finite.min(), finite.max()
        clipped = clip and top - low > 3 * (np.percentile(finite, 75) - low) > 0
        if clipped:
            top = np.percentile(finite, 75)
        bounds = np.linspace(low, top, levels + 1)
        cs = ax.contourf(alphas, betas, z, levels=bounds, cmap="viridis", extend="max" if clipped else "neither")
        ax.contour(alphas, betas, z, levels=bounds, colors="k", linewidths=0.3)
        bar = fig.colorbar(cs, ax=ax, format="{x:.3g}")
        bar.set_label(quantity + (f" (levels clipped at {top:.3g}; max {finite.max():.3g})" if clipped else ""))
        pick = np.where(np.isfinite(z), z if best == "min" else -z, np.inf)
        i, j = np.unravel_index(np.argmin(pick), z.shape)
        name = "minimum" if best == "min" else "maximum"
        ax.plot([alphas[j]], [betas[i]], marker="*", color="w", markeredgecolor="k", markersize=14,
                linestyle="none", clip_on=False, zorder=5, label=f"{name} {z[i, j]:.3g}")
    else:
        ax.imshow(z, origin="lower", extent=(alphas[0], alphas[-1], betas[0], betas[-1]), aspect="auto")
    center = z[len(betas) // 2, len(alphas) // 2] if len(alphas) % 2 and len(betas) % 2 else None
    ax.plot([0], [0], marker="+", color="r", markersize=12, markeredgewidth=2, linestyle="none", zorder=6,
            label="the model" + (f" {center:.3g}" if center is not None and np.isfinite(center) else ""))
    ax.legend(loc="upper right", fontsize=7, framealpha=0.85)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    return fig


MAX_HEATMAP_INCHES = 16.0  # at 80 dpi: 1,280 pixels
MAX_NAMED_ROWS = 60  # a heatmap with more rows does not name them (the axis numbers them)


def heatmap_image(*args, **kwargs) -> np.ndarray:
    """`heatmap_figure` as an RGB array."""
    return _to_array(heatmap_figure(*args, **kwargs))


def heatmap_figure(matrix: np.ndarray, title: str, xlabel: str, ylabel: str, annotate: bool | None = None,
                   fmt: str = "{:.0f}", quantity: str = "", row_labels: Sequence | None = None,
                   log_scale: bool | None = None, limits: tuple[float, float] | None = None) -> Figure:
    """A rows x columns heatmap (clients x classes): the colorbar labelled `quantity`, rows named
    `row_labels` (the real client ids), numbers written in the cells when small. The colour scale
    is logarithmic (symlog, zero included) when one cell dominates (`log_scale` None: the largest
    value is over 20 times the median of the non-zero ones), so a 210 does not black out the rest.
    `limits` fixes a linear scale's ends (an accuracy's 0 and 1, so that the colours of two
    pictures mean the same), instead of the matrix's own minimum and maximum."""
    from matplotlib.colors import SymLogNorm

    m = np.asarray(matrix, dtype=np.float64)
    rows, cols = m.shape
    # A row per client up to MAX_HEATMAP_INCHES; beyond that (1,000 clients would make a picture
    # 17,700 pixels tall and cost a quarter of a GiB to draw) rows share pixels, averaged by
    # matplotlib's antialiasing; the exact numbers are in the JSON file and the W&B table.
    height = min(max(3.0, 0.22 * rows + 1.5), MAX_HEATMAP_INCHES)
    fig = Figure(figsize=(max(4.0, 0.45 * cols + 2), height), dpi=80, layout="constrained")
    ax = fig.add_subplot()
    positive = m[np.isfinite(m) & (m > 0)]
    if limits is not None and log_scale:
        raise ValueError("heatmap limits are for a linear colour scale")
    if log_scale is None:
        log_scale = limits is None and positive.size > 0 and positive.max() > 20 * np.median(positive)
    norm = SymLogNorm(linthresh=max(float(positive.min()), 1e-12), vmin=0.0, vmax=float(positive.max())) \
        if log_scale else None
    vmin, vmax = limits if limits is not None else (None, None)
    im = ax.imshow(np.ma.masked_invalid(m), aspect="auto", cmap="magma", norm=norm, vmin=vmin, vmax=vmax,
                   interpolation="nearest" if height > 0.22 * rows else "antialiased")
    fig.colorbar(im, ax=ax).set_label(quantity + (" (log scale)" if log_scale else ""))
    _row_ticks(ax, row_labels)
    if annotate if annotate is not None else rows * cols <= 400:
        middle = np.nanmean([np.nanmin(m), np.nanmax(m)]) if np.isfinite(m).any() else 0.0
        for i in range(rows):
            for j in range(cols):
                if np.isfinite(m[i, j]):
                    bright = (norm(m[i, j]) if norm is not None else (m[i, j] > middle)) > (0.5 if norm else 0)
                    # inside its cell, so the layout engine need not measure it (a fifth of the draw)
                    ax.text(j, i, fmt.format(m[i, j]), ha="center", va="center", fontsize=6,
                            color="k" if bright else "w", in_layout=False)
    if cols <= 30:
        ax.set_xticks(range(cols))  # every class, not every other one
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    return fig


def _row_ticks(ax, row_labels: Sequence | None) -> None:
    """The rows named by `row_labels` (client ids), when there are few enough to read."""
    if row_labels is not None and len(row_labels) <= MAX_NAMED_ROWS:
        ax.set_yticks(range(len(row_labels)), [str(r) for r in row_labels], fontsize=6 if len(row_labels) > 20 else 8)


class HeatmapSeries:
    """One heatmap drawn again and again (the local models' class-wise accuracy every few rounds of
    a fit), the same picture `heatmap_image` draws, pixel for pixel, at a fraction of the cost
    (benchmarks/core_overhead.py times the heatmap round). Most of a new picture's
    cost is building the figure, laying it out (matplotlib's layout engine measures every tick
    label) and drawing its axes; none of that changes between rounds. So the figure is built and
    laid out once, and drawn once more without what changes (the cells, the row labels, the title,
    and the spines and tick marks drawn over the cells' edges) as a background; each later picture
    is that background with only those artists drawn on it, in the order a whole drawing draws
    them (matplotlib's blitting).

    The background is valid while the colorbar's ticks stay the same, hence a linear scale with
    fixed `limits`, while the row labels keep their width and the title its letters (its height
    depends on them): a wider label (client 100 after client 99), another number of rows or a
    title with other letters gets a new figure. A fit's titles differ only in the round's digits."""

    def __init__(self, xlabel: str, ylabel: str, quantity: str, limits: tuple[float, float]):
        self.xlabel, self.ylabel, self.quantity, self.limits = xlabel, ylabel, quantity, limits
        self._key: tuple | None = None  # what the current figure's layout was made for

    def image(self, matrix: np.ndarray, title: str, row_labels: Sequence) -> np.ndarray:
        m = np.asarray(matrix, dtype=np.float64)
        labels = [str(r) for r in row_labels]
        # the title's height is laid out too: its letters (not its digits, which are of one height) count
        key = (m.shape, max(map(len, labels), default=0), frozenset(title) - frozenset("0123456789"))
        if key != self._key:
            self._key = key
            return self._new_figure(m, title, labels)
        ax = self._axes
        ax.images[0].set_data(np.ma.masked_invalid(m))
        if self._row_labels:
            for text, label in zip(self._row_labels, labels, strict=True):
                text.set_text(label)
        ax.title.set_text(title)
        canvas = ax.figure.canvas
        canvas.restore_region(self._background)
        for artist in self._changing:
            ax.draw_artist(artist)
        return _pixels(canvas)

    def _new_figure(self, m: np.ndarray, title: str, labels: list[str]) -> np.ndarray:
        fig = heatmap_figure(m, title, self.xlabel, self.ylabel, annotate=False, quantity=self.quantity,
                             row_labels=labels, log_scale=False, limits=self.limits)
        image = _to_array(fig)  # laid out by the engine, which is then switched off
        fig.set_layout_engine("none")
        ax = fig.axes[0]
        x_ticks, y_ticks = _drawn_ticks(ax.xaxis, ax.get_xlim()), _drawn_ticks(ax.yaxis, ax.get_ylim())
        self._row_labels = [t.label1 for t in y_ticks] if len(labels) <= MAX_NAMED_ROWS else []
        # Axes.draw draws its children by zorder, ties in this order; a tick its line, then its label
        groups = [(ax.images[0].zorder, [ax.images[0]]), *((sp.zorder, [sp]) for sp in ax.spines.values()),
                  (ax.xaxis.get_zorder(), [t.tick1line for t in x_ticks]),
                  (ax.yaxis.get_zorder(), [a for t in y_ticks for a in (t.tick1line, t.label1)]),
                  (ax.title.get_zorder(), [ax.title])]
        self._changing = [a for _, artists in sorted(groups, key=lambda g: g[0]) for a in artists]
        # the background: everything else, where the changing artists are drawn transparent (not
        # hidden: hidden tick labels would move the axis label they are measured for)
        alphas = [a.get_alpha() for a in self._changing]
        for artist in self._changing:
            artist.set_alpha(0.0)
        fig.canvas.draw()
        self._background = fig.canvas.copy_from_bbox(fig.bbox)
        for artist, alpha in zip(self._changing, alphas, strict=True):
            artist.set_alpha(alpha)
        self._axes = ax
        return image


def _drawn_ticks(axis, limits: tuple[float, float]) -> list:
    """The major ticks a drawing of `axis` draws: those inside its view (a locator also places one
    past each end)."""
    low, high = sorted(limits)
    return [t for t in axis.get_major_ticks() if low <= t.get_loc() <= high]


def curve_image(*args, **kwargs) -> np.ndarray:
    """`curve_figure` as an RGB array."""
    return _to_array(curve_figure(*args, **kwargs))


def curve_figure(x: Sequence[float], ys: dict[str, Sequence[float]], title: str, xlabel: str,
                 ylabel: str = "") -> Figure:
    """One line per entry of `ys` against `x` (slices.png: the loss along each direction)."""
    fig = Figure(figsize=(5, 3.5), dpi=80, layout="constrained")
    ax = fig.add_subplot()
    for label, y in ys.items():
        ax.plot(x, y, marker=".", label=label)
    ax.legend()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    return fig


def spectrum_image(top: Sequence[float], layers: dict[str, float], title: str) -> np.ndarray:
    """The Hessian's top-k eigenvalues, and lambda_1 of each layer's block, as bar charts."""
    fig = Figure(figsize=(8, 3.8), dpi=80, layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[1, max(1.0, len(layers) / 4)])
    left.bar([f"λ{i + 1}" for i in range(len(top))], top, color="tab:blue")
    left.set(title="top eigenvalues", ylabel="eigenvalue")
    if layers:
        right.bar(list(layers), list(layers.values()), color="tab:orange")
        right.tick_params(axis="x", labelrotation=30 if len(layers) > 3 else 0, labelsize=8)
    right.set(title="λ1 of each layer's Hessian block", xlabel="layer", ylabel="eigenvalue")
    fig.suptitle(title)
    return _to_array(fig)


def spectrum_history_image(*args, **kwargs) -> np.ndarray:
    """`spectrum_history_figure` as an RGB array."""
    return _to_array(spectrum_history_figure(*args, **kwargs))


def spectrum_history_figure(rounds: Sequence[int], lambda_1: Sequence[float], ratio: Sequence[float], k: int,
                            title: str) -> Figure:
    """lambda_1 (top) and lambda_1 / lambda_k (bottom) against rounds, one panel each (on twin axes
    of one panel the two lines would lie on top of each other whenever there are two points)."""
    fig = Figure(figsize=(5.5, 4.6), dpi=80, layout="constrained")
    upper, lower = fig.subplots(2, 1, sharex=True)
    upper.plot(rounds, lambda_1, marker="o", color="tab:blue")
    upper.set(title=title, ylabel="λ1 (sharpness)")
    lower.plot(rounds, ratio, marker="s", color="tab:red")
    lower.set(xlabel="round", ylabel=f"λ1 / λ{k}")
    from matplotlib.ticker import MaxNLocator

    lower.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    if len(set(rounds)) == 1:  # one analysis so far: a span with whole rounds on both sides of it
        lower.set_xlim(rounds[0] - 1, rounds[0] + 1)
    for ax in (upper, lower):
        ax.grid(alpha=0.3)
    return fig


# A folder where runs leave the pictures they drew for other runs drawing the same one (a sweep's
# runs share their partition picture: `fl-lightning sweep --local` sets it to `.sweep/pictures/`).
SHARED_PICTURES_ENV = "FL_LIGHTNING_SHARED_PICTURES"
_PICTURE_KEY_FIELD = "fl-lightning-picture"


def shared_image(draw: Callable[..., np.ndarray], *args, **kwargs) -> np.ndarray:
    """`draw(*args, **kwargs)`, or the same picture as an earlier run drew it, read from the folder
    SHARED_PICTURES_ENV names (when it names one). The file is found by a digest of the drawing
    function, its arguments (arrays by value) and the code of this module and of matplotlib, and
    carries that digest inside: a damaged file, or one of another picture under this name, is drawn
    again and replaced. The pixels are the same either way (PNG is lossless, drawing deterministic)."""
    folder = os.environ.get(SHARED_PICTURES_ENV)
    if not folder:
        return draw(*args, **kwargs)
    key = _picture_key(draw, args, kwargs)
    path = Path(folder) / f"{key}.png"
    image = _read_picture(path, key)
    if image is None:
        image = draw(*args, **kwargs)
        try:
            save_png(image, path, text={_PICTURE_KEY_FIELD: key})
        except OSError:
            pass  # a folder that cannot be written costs the next run the drawing, nothing else
    return image


def _picture_key(draw: Callable, args: tuple, kwargs: dict) -> str:
    import matplotlib

    digest = hashlib.sha256()
    digest.update(f"{draw.__module__}.{draw.__qualname__} matplotlib {matplotlib.__version__}\n".encode())
    digest.update(Path(__file__).read_bytes())
    _digest_value(digest, (args, sorted(kwargs.items())))
    return digest.hexdigest()


def _digest_value(digest, value) -> None:
    if isinstance(value, np.ndarray):
        digest.update(f"array {value.dtype} {value.shape}\n".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__} of {len(value)}\n".encode())
        for part in value:
            _digest_value(digest, part)
    else:
        digest.update(f"{value!r}\n".encode())


def _read_picture(path: Path, key: str) -> np.ndarray | None:
    from PIL import Image

    try:
        with Image.open(path) as picture:
            if picture.text.get(_PICTURE_KEY_FIELD) != key or picture.mode != "RGB":
                return None
            return np.asarray(picture, dtype=np.uint8).copy()
    except (OSError, ValueError, SyntaxError):  # absent, truncated or not a PNG (PIL's errors)
        return None


def save_png(image: np.ndarray, path: Path, text: dict[str, str] | None = None) -> None:
    """The image as a PNG file, written atomically (encoded in memory, then atomic_write_bytes): a
    process killed or a disk filled mid-write leaves the old file or none, never half a picture.
    `text`: tEXt fields stored with it."""
    from PIL import Image, PngImagePlugin

    info = None
    if text:
        info = PngImagePlugin.PngInfo()
        for name, value in text.items():
            info.add_text(name, value)
    encoded = io.BytesIO()
    Image.fromarray(image).save(encoded, format="png", pnginfo=info)
    atomic_write_bytes(path, encoded.getvalue())
