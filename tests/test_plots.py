"""The pictures' scales: a loss surface whose edge climbs far above its basin gets clipped levels
(the basin keeps its colours), and a heatmap where one cell dominates gets a log colour scale (the
other cells stay distinguishable)."""

import numpy as np
import pytest

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


def test_the_surfaces_mark_their_best_point_even_on_the_edge_and_the_model():
    """The loss surface marks its minimum, the accuracy surface its maximum (it used to mark the
    accuracy's minimum), both drawn over the frame when the point lies on the grid's edge (a marker
    clipped by the axes showed as half a star), and the model itself is in the legend."""
    grid = np.linspace(-1, 1, 5)
    acc = np.full((5, 5), 0.5)
    acc[2, 0] = 0.9  # the best accuracy on the edge (alpha 0, beta -1)
    acc[4, 4] = 0.1
    fig = plots.contour_figure(grid, grid, acc, "t", quantity="accuracy", clip=False, best="max")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["maximum 0.9", "the model 0.5"]
    star = next(line for line in ax.get_lines() if line.get_marker() == "*")
    assert (star.get_xdata()[0], star.get_ydata()[0]) == (0.0, -1.0) and not star.get_clip_on()
    loss = plots.contour_figure(grid, grid, 1 - acc, "t", quantity="loss")
    assert [t.get_text() for t in loss.axes[0].get_legend().get_texts()][0] == "minimum 0.1"


def test_the_sharpness_history_draws_each_quantity_on_its_own_axes():
    """lambda_1 and lambda_1/lambda_k used to share one panel with twin y-axes, where two analysis
    rounds always drew the two lines exactly on top of each other."""
    fig = plots.spectrum_history_figure([2, 4], [5.4, 6.0], [2.6, 2.8], 5, "FedSOL, mnist5k: sharpness over rounds")
    axes = [ax for ax in fig.axes if ax.get_lines()]
    assert len(axes) == 2
    assert [ax.get_ylabel() for ax in axes] == ["λ1 (sharpness)", "λ1 / λ5"]
    assert [list(ax.get_lines()[0].get_ydata()) for ax in axes] == [[5.4, 6.0], [2.6, 2.8]]
    assert axes[1].get_xlabel() == "round" and axes[0].get_title() == "FedSOL, mnist5k: sharpness over rounds"


@pytest.mark.parametrize("rounds", [[5], [5, 10, 15, 20]])
def test_the_sharpness_history_ticks_whole_rounds(rounds):
    """After the first analysis round the history has one point, and its round axis was ticked
    4.8, 4.9, 5.0, ... (5.04, 5.10 after a first fix): rounds are whole numbers."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = plots.spectrum_history_figure(rounds, [5.2] * len(rounds), [2.6] * len(rounds), 5, "t")
    FigureCanvasAgg(fig).draw()
    lower = fig.axes[1]
    low, high = lower.get_xlim()
    ticks = [t for t in lower.get_xticks() if low <= t <= high]
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks)
    assert low < min(rounds) and max(rounds) < high


def test_a_pictures_title_names_the_setting_not_the_directory(tmp_path):
    """The setting is the one the run's config files name (the W&B group `<setting>/<method>`); it
    was the run directory's parent, so `--trainer.default_root_dir runs/exp1` titled pictures "runs"."""
    from types import SimpleNamespace

    from fl_lightning.analysis.callback import _what
    from fl_lightning.loggers import FLWandbLogger

    module = type("FedSOL", (), {})()
    data = SimpleNamespace(hparams={"dataset": "digits", "partition": "dirichlet"})
    logger = FLWandbLogger(offline=True, save_dir=str(tmp_path), group="fedsol_cifar10/fedsol")
    trainer = SimpleNamespace(lightning_module=module, loggers=[logger], datamodule=data,
                              default_root_dir=str(tmp_path / "runs" / "exp1"))
    assert _what(trainer, 7) == "FedSOL, fedsol_cifar10, round 7"
    trainer.loggers = []  # no W&B logger: the data it trains on
    assert _what(trainer, None) == "FedSOL, digits dirichlet"


def test_heatmap_rows_are_the_real_client_ids_and_the_colorbar_names_its_quantity():
    counts = np.tile(np.arange(10.0), (3, 1))
    counts[1, 4] = 210.0
    fig = plots.heatmap_figure(counts, "t", "class", "client id", quantity="training samples", row_labels=[7, 12, 40])
    ax, bar = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["7", "12", "40"]  # not 0, 1, 2
    assert bar.get_ylabel() == "training samples (log scale)"  # 210 against a median of 5
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(c) for c in range(10)]  # every class
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("class", "client id")


def test_a_heatmap_series_draws_each_round_as_a_new_figure_would_and_builds_few(monkeypatch):
    """The class-wise heatmap of a fit reuses one figure and its layout. Each of its pictures must be
    the one a new figure draws, pixel for pixel, as the rounds change the numbers (NaN cells: a
    class absent from the test subset), the client ids, the number of rows, the ids' width and the
    title; a figure is built again only when the layout would change (a wider id, another row
    count, a title of other letters)."""
    built = []
    figure = plots.heatmap_figure
    monkeypatch.setattr(plots, "heatmap_figure", lambda *a, **k: built.append(1) or figure(*a, **k))
    rng = np.random.default_rng(0)
    series = plots.HeatmapSeries("class", "client id", "accuracy", limits=(0.0, 1.0))
    fit = "FedAvg, mnist5k, round {}: local models' class-wise accuracy"
    # (rows, lowest and highest client id, title): ids of one digit, then of two, then fewer rows,
    # then three digits, then a title without tall letters (a lower title: the layout measured it)
    rounds = [(10, 0, 10, fit), (10, 0, 10, fit), (10, 10, 60, fit), (10, 10, 60, fit), (10, 10, 60, fit),
              (7, 10, 60, fit), (10, 100, 160, fit), (10, 100, 160, "mean accuracy")]
    for r, (rows, low, high, title) in enumerate(rounds, start=1):
        acc = rng.random((rows, 10)) * 0.5 + 0.25 * (r % 2)  # never the whole 0..1 range
        acc[1, 3] = np.nan
        clients = sorted(rng.choice(np.arange(low, high), rows, replace=False))
        title = title.format(5 * r)
        got = series.image(acc, title, clients)
        expected = figure(acc, title, "class", "client id", annotate=False, quantity="accuracy",
                          row_labels=clients, log_scale=False, limits=(0.0, 1.0))
        np.testing.assert_array_equal(got, plots._to_array(expected), err_msg=f"round {r}")
        assert expected.axes[0].images[0].get_clim() == (0.0, 1.0)  # the colours of two rounds compare
    assert len(built) == 5  # rounds 1, 3 (two-digit ids), 6 (7 rows), 7 (three-digit ids), 8; the rest reuse
    # more than 60 rows are not named (the axis numbers them): still the new figure's picture
    for r in range(2):
        acc = rng.random((70, 10))
        got = series.image(acc, fit.format(r), range(100, 170))
        expected = figure(acc, fit.format(r), "class", "client id", annotate=False, quantity="accuracy",
                          row_labels=range(100, 170), log_scale=False, limits=(0.0, 1.0))
        np.testing.assert_array_equal(got, plots._to_array(expected), err_msg=f"70 rows, drawing {r + 1}")


def test_heatmap_limits_are_for_a_linear_scale():
    with pytest.raises(ValueError, match="linear"):
        plots.heatmap_figure(np.ones((2, 2)), "t", "class", "client", log_scale=True, limits=(0.0, 1.0))


def test_slices_have_axis_labels_and_name_their_directions():
    curves = {"top-1 Hessian eigenvector": [3, 2, 3], "top-2 Hessian eigenvector": [2, 2, 4]}
    fig = plots.curve_figure([-1, 0, 1], curves,
                             "FedSOL, mnist5k, round 4: loss along each direction", "step along the direction",
                             "training-subset loss")
    ax = fig.axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("step along the direction", "training-subset loss")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["top-1 Hessian eigenvector",
                                                                    "top-2 Hessian eigenvector"]


# ---------------------------------------------------------------------------------------------
# Pictures shared by the runs of a sweep (plots.shared_image)

PARTITION = np.arange(30.0).reshape(6, 5)


def shared_partition(matrix=PARTITION, title="partition"):
    return plots.shared_image(plots.heatmap_image, matrix, title, "class", "client id",
                              quantity="training samples", row_labels=range(len(matrix)))


@pytest.fixture
def drawings(monkeypatch):
    """How many heatmaps were drawn."""
    drawn = []
    figure = plots.heatmap_figure
    monkeypatch.setattr(plots, "heatmap_figure", lambda *a, **k: drawn.append(1) or figure(*a, **k))
    return drawn


def test_a_shared_picture_is_drawn_once_and_read_back_the_same(tmp_path, monkeypatch, drawings):
    monkeypatch.delenv(plots.SHARED_PICTURES_ENV, raising=False)
    fresh = shared_partition()  # no folder named: drawn, nothing written
    assert len(drawings) == 1
    monkeypatch.setenv(plots.SHARED_PICTURES_ENV, str(tmp_path / "pictures"))
    first = shared_partition()
    assert len(drawings) == 2 and len(list((tmp_path / "pictures").glob("*.png"))) == 1
    again = shared_partition()
    assert len(drawings) == 2  # read, not drawn
    assert again.dtype == np.uint8 and np.array_equal(again, fresh) and np.array_equal(first, fresh)
    # a cell or a title of difference is another picture
    other = PARTITION.copy()
    other[2, 3] += 1
    assert not np.array_equal(shared_partition(other), fresh)
    shared_partition(title="another title")
    assert len(drawings) == 4 and len(list((tmp_path / "pictures").glob("*.png"))) == 3


def test_a_damaged_swapped_or_foreign_shared_picture_is_drawn_again(tmp_path, monkeypatch, drawings):
    monkeypatch.setenv(plots.SHARED_PICTURES_ENV, str(tmp_path))
    right = shared_partition()
    (path,) = tmp_path.glob("*.png")
    other = PARTITION[::-1].copy()
    shared_partition(other)
    other_path = next(p for p in tmp_path.glob("*.png") if p != path)

    path.write_bytes(path.read_bytes()[:500])  # cut short by a full disk or a kill
    before = len(drawings)
    assert np.array_equal(shared_partition(), right) and len(drawings) == before + 1
    assert np.array_equal(shared_partition(), right) and len(drawings) == before + 1  # repaired

    path.write_bytes(other_path.read_bytes())  # another picture under this one's name
    assert np.array_equal(shared_partition(), right) and len(drawings) == before + 2

    plots.save_png(right, path)  # the right pixels, but not written by shared_image: not trusted
    assert np.array_equal(shared_partition(), right) and len(drawings) == before + 3
    assert np.array_equal(shared_partition(), right) and len(drawings) == before + 3

    blocked = tmp_path / "a_file"
    blocked.write_text("")
    monkeypatch.setenv(plots.SHARED_PICTURES_ENV, str(blocked / "pictures"))  # cannot be written
    assert np.array_equal(shared_partition(), right)
