"""The pictures' scales: a loss surface whose edge climbs far above its basin gets clipped levels
(the basin keeps its colours), and a heatmap where one cell dominates gets a log colour scale (the
other cells stay distinguishable)."""

import numpy as np

from fl_lightning.analysis import plots


def distinct_colours(image: np.ndarray) -> int:
    return len(np.unique(image.reshape(-1, 3), axis=0))


def test_a_spiky_loss_surface_is_drawn_with_clipped_levels():
    grid = np.linspace(-1, 1, 11)
    basin = 2 + 0.1 * (grid[:, None] ** 2 + grid[None, :] ** 2)
    spiky = basin.copy()
    spiky[0, 0] = 52.0  # one corner far above the basin
    clipped = plots.contour_image(grid, grid, spiky, "t")
    linear = plots.contour_image(grid, grid, spiky, "t", clip=False)
    assert not np.array_equal(clipped, linear)
    # inside the basin (the middle of the plot) the clipped picture uses more colours
    h, w, _ = clipped.shape
    middle = (slice(h // 3, 2 * h // 3), slice(w // 4, w // 2))
    assert distinct_colours(clipped[middle]) > distinct_colours(linear[middle])


def test_a_dominating_cell_gets_a_log_colour_scale():
    counts = np.tile(np.arange(10.0), (50, 1))  # 0..9 per class
    counts[3, 4] = 210.0
    auto = plots.heatmap_image(counts, "t", "class", "client", annotate=False)
    linear = plots.heatmap_image(counts, "t", "class", "client", annotate=False, log_scale=False)
    assert not np.array_equal(auto, linear)
    assert distinct_colours(auto) > distinct_colours(linear)
