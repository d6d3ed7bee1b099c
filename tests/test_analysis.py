"""The analyses against closed forms: Hessian-vector products and Lanczos eigenvalues against the
exact Hessian of a tiny model, the Hutchinson trace within its standard error, surfaces (centre,
filter norms, a quadratic model's closed form), divergence statistics and partition counts by
hand, and training that is bit for bit the same with every analysis on."""

import errno
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fl_test_utils import fit, fixed_parts_module, toy_data
from torch import nn

from fl_lightning.analysis.callback import AnalysisCallback
from fl_lightning.analysis.divergence import classwise_accuracy, divergence_stats, partition_counts, update_gram
from fl_lightning.analysis.hessian import hessian_spectrum, hutchinson_trace
from fl_lightning.analysis.objective import SubsetObjective, flatten, unflatten
from fl_lightning.analysis.surface import filter_normalized_direction, surface_2d
from fl_lightning.data.partition import split_train_test
from fl_lightning.methods import SCAFFOLD, FedAvg, FedORGP, FedSOL
from fl_lightning.models import FLModel, register_model


def tiny_problem(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4))  # 84 parameters
    x, y = torch.randn(64, 5), torch.randint(0, 4, (64,))
    return model, x, y


def exact_hessian(objective: SubsetObjective) -> torch.Tensor:
    """d^2 L / dw^2 in float64 by autograd's dense Hessian of the flattened weights."""
    like = {k: v.double() for k, v in objective.params.items()}
    module = objective.module.double()
    x = torch.cat([c[0] for c in objective.chunks]).double()
    y = torch.cat([c[1] for c in objective.chunks])
    double = SubsetObjective(module, x, y)
    hessian = torch.autograd.functional.hessian(
        lambda w: double._chunk_loss(unflatten(w, like), x, y), flatten(like))
    module.float()
    return hessian


@pytest.mark.parametrize("mode", ["graph", "forward", "double"])
def test_hvp_equals_exact_hessian_times_v(mode):
    model, x, y = tiny_problem()
    objective = SubsetObjective(model, x, y, chunk_size=20, hvp_mode=mode)  # 4 chunks, summed
    hessian = exact_hessian(objective)
    v = torch.randn(objective.dim, generator=torch.Generator().manual_seed(1))
    hv = objective.hvp_flat(v)
    torch.testing.assert_close(hv.double(), hessian @ v.double(), atol=1e-6, rtol=1e-4)
    assert objective.hvp_mode == mode and objective.num_hvps == 1
    with torch.inference_mode():  # `fl-lightning analyze` runs inside Lightning's validation
        inside = SubsetObjective(model, x, y, chunk_size=20, hvp_mode=mode).hvp_flat(v.clone())
    torch.testing.assert_close(inside.double(), hessian @ v.double(), atol=1e-6, rtol=1e-4)


def test_lanczos_top5_and_minimum_equal_eigvalsh():
    model, x, y = tiny_problem()
    objective = SubsetObjective(model, x, y)
    exact = torch.linalg.eigvalsh(exact_hessian(objective))  # ascending
    spectrum = hessian_spectrum(objective, k=5, max_iter=60, tol=1e-7, layerwise=False)
    top = torch.tensor(spectrum.top, dtype=torch.float64)
    assert exact[0] < -1e-2  # a real negative eigenvalue to find
    assert ((top - exact.flip(0)[:5]).abs() / exact.flip(0)[:5].abs()).max() < 1e-4
    assert abs(spectrum.minimum - float(exact[0])) / abs(float(exact[0])) < 1e-4
    assert spectrum.lanczos_hvps < objective.dim  # found without spanning the whole space
    # the top eigenvectors are eigenvectors: H v = lambda v
    for value, vector in zip(spectrum.top[:2], spectrum.top_vectors[:2], strict=True):
        hv = objective.hvp_flat(flatten(vector))
        torch.testing.assert_close(hv, value * flatten(vector), atol=2e-5, rtol=1e-3)


def test_layerwise_lambda_1_is_the_top_eigenvalue_of_the_layer_block():
    model, x, y = tiny_problem()
    objective = SubsetObjective(model, x, y)
    hessian = exact_hessian(objective)
    spectrum = hessian_spectrum(objective, k=2, max_iter=60, tol=1e-7, layerwise=True, layer_iter=60)
    start = 0
    for layer in ("0", "2"):
        size = sum(p.numel() for n, p in model.named_parameters() if n.startswith(layer + "."))
        block = hessian[start : start + size, start : start + size]
        start += size
        assert spectrum.layer_top[layer] == pytest.approx(float(torch.linalg.eigvalsh(block)[-1]), rel=1e-4)


def test_hutchinson_within_its_stated_tolerance():
    """z^T H z with Rademacher z has variance 2 sum_{i != j} H_ij^2; 200 seeded probes must land
    within 4 standard deviations of the exact trace, and the reported stderr must estimate it."""
    model, x, y = tiny_problem()
    objective = SubsetObjective(model, x, y)
    hessian = exact_hessian(objective)
    off = hessian - torch.diag(hessian.diagonal())
    probes = 200
    sigma = math.sqrt(2 * float((off**2).sum()) / probes)
    estimate, stderr = hutchinson_trace(objective.hvp_flat, objective.dim, probes, torch.Generator().manual_seed(0))
    assert abs(estimate - float(hessian.trace())) < 4 * sigma
    assert 0.5 * sigma < stderr < 2 * sigma


def test_surface_centre_is_the_models_loss_on_the_subset():
    model, x, y = tiny_problem()
    model.train()
    objective = SubsetObjective(model, x, y, chunk_size=30)
    d = filter_normalized_direction(objective.params, torch.Generator().manual_seed(0))
    e = filter_normalized_direction(objective.params, torch.Generator().manual_seed(1))
    surf = surface_2d(objective, d, e, radius=0.5, points=5)
    with torch.no_grad():
        logits = model(x)
    assert surf.loss[2][2] == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-6)
    assert surf.acc[2][2] == pytest.approx(float((logits.argmax(1) == y).float().mean()))
    assert surf.loss[0][0] != pytest.approx(surf.loss[2][2])  # the corners are elsewhere
    assert model.training  # the module's own mode is restored


def test_filter_normalized_direction_has_the_weights_filter_norms():
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 4 * 4, 5))
    weights = {n: p.detach() for n, p in conv.named_parameters()}
    d = filter_normalized_direction(weights, torch.Generator().manual_seed(0))
    for name, w in weights.items():
        if w.dim() == 1:  # biases and BatchNorm are not perturbed (Li et al. 2018)
            assert torch.equal(d[name], torch.zeros_like(w))
            continue
        torch.testing.assert_close(d[name].reshape(len(w), -1).norm(dim=1), w.reshape(len(w), -1).norm(dim=1))
        assert not torch.allclose(d[name], w)


class _LinearScores(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x):
        return x @ self.w


def test_hessian_surface_of_a_quadratic_is_its_closed_form_around_the_minimum():
    """Least squares L(w) = sum (x w - t)^2 / N is quadratic; at its minimum w*, along the top-2
    unit eigenvectors, L(w* + a v1 + b v2) = L* + (lambda_1 a^2 + lambda_2 b^2) / 2, which is
    symmetric in a and in b. (One output column: with several, every eigenvalue of
    2 X^T X / N repeats once per column, and single-vector Lanczos reports a repeated value once.)"""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 2, (50,), generator=g)
    target = y.double()[:, None]
    w_star = torch.linalg.lstsq(x, target).solution
    model = _LinearScores(w_star.clone())
    objective = SubsetObjective(model, x, y, loss_fn=lambda s, t: ((s[:, 0] - t.double()) ** 2).sum())
    spectrum = hessian_spectrum(objective, k=2, max_iter=12, tol=1e-10, layerwise=False)
    surf = surface_2d(objective, *spectrum.top_vectors[:2], radius=1.0, points=5)
    centre = surf.loss[2][2]
    l1, l2 = spectrum.top
    for i, a in enumerate(surf.alphas):
        for j, b in enumerate(surf.betas):
            assert surf.loss[i][j] == pytest.approx(centre + 0.5 * (l1 * a * a + l2 * b * b), rel=1e-9, abs=1e-12)
            assert surf.loss[i][j] == pytest.approx(surf.loss[4 - i][j], rel=1e-9)
            assert surf.loss[i][j] == pytest.approx(surf.loss[i][4 - j], rel=1e-9)
    exact = torch.linalg.eigvalsh(2 * x.T @ x / 50)
    assert [l1, l2] == pytest.approx(exact.flip(0)[:2].tolist(), rel=1e-9)


@pytest.mark.parametrize("mode", ["graph", "forward", "double"])
def test_spectrum_and_surfaces_keep_every_tensor_on_the_models_device(mode):
    """On a GPU the Lanczos Ritz vectors were formed from CPU eigenvectors times the device's
    Krylov basis: "Expected all tensors to be on the same device". No GPU here: the model and the
    subset are on a simulated "cuda" (tests/simulated_device.py), which raises as CUDA does."""
    from simulated_device import SimulatedDevice

    from fl_lightning.analysis.surface import slice_1d

    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 4))
    x, y = torch.randn(32, 5, generator=torch.Generator().manual_seed(0)), torch.arange(32) % 4
    with SimulatedDevice("cuda") as device:
        with pytest.raises(RuntimeError, match="same device"):  # it does see a mix-up
            torch.ones(3) + torch.ones(3, device="cuda")
        device.place(*model.parameters(), *model.buffers())
        objective = SubsetObjective(model, x.to("cuda"), y.to("cuda"), hvp_mode=mode)
        spectrum = hessian_spectrum(objective, k=2, max_iter=10, trace_probes=2, layerwise=True, layer_iter=5)
        assert {device.device_of(t) for v in spectrum.top_vectors for t in v.values()} == {"cuda"}
        random = filter_normalized_direction(objective.params, torch.Generator().manual_seed(1))
        assert {device.device_of(t) for t in random.values()} == {"cuda"}
        surface_2d(objective, *spectrum.top_vectors[:2], points=3)
        surface_2d(objective, random, random, points=3, kind="random")
        slice_1d(objective, random, points=3)
    reference = hessian_spectrum(SubsetObjective(model, x, y, hvp_mode=mode), k=2, max_iter=10, trace_probes=2,
                                 layerwise=True, layer_iter=5)
    assert spectrum.top == reference.top  # the same numbers: only the bookkeeping differs


def test_divergence_statistics_by_hand():
    g = {"w": torch.zeros(2), "b": torch.zeros(1)}
    uploads = [{"w": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0]), "buf": torch.ones(1)},
               {"w": torch.tensor([0.0, 1.0]), "b": torch.tensor([0.0]), "buf": torch.ones(1)},
               {"w": torch.tensor([-3.0, 0.0]), "b": torch.tensor([-4.0]), "buf": torch.ones(1)}]
    stats = divergence_stats(update_gram(uploads, g))
    assert stats["client_global_dist_mean"] == pytest.approx((5 + 1 + 5) / 3)
    assert stats["client_global_dist_max"] == 5 and stats["client_global_dist_min"] == 1
    pairs = [math.sqrt(9 + 1 + 16), 10.0, math.sqrt(9 + 1 + 16)]
    assert stats["client_pair_dist_mean"] == pytest.approx(sum(pairs) / 3)
    assert stats["update_cosine_mean"] == pytest.approx((0 + -1 + 0) / 3)
    assert update_gram([{"protos": torch.ones(3)}], g) is None


def test_update_gram_over_column_blocks_is_every_inner_product_exactly():
    """The Gram matrix is summed a block of GRAM_COLUMNS parameters at a time: a tensor two blocks
    and five parameters long (a block boundary inside it, a short last block), a 0-d tensor, an
    empty one and a 2-d one of one block must give every <w_i - w_g, w_j - w_g> exactly (integer
    updates on large weights: every float64 product and sum is exact, so the reference is integer
    arithmetic)."""
    from fl_lightning.analysis.divergence import GRAM_COLUMNS

    size = 2 * GRAM_COLUMNS + 5
    rng = np.random.default_rng(0)
    base = rng.integers(-1000, 1000, size)
    deltas = rng.integers(-7, 8, (3, size))
    deltas[:, -5:] = [[1, 2, 3, 4, 5], [0, 0, 0, 0, 9], [-1, -1, -1, -1, -1]]  # the short last block counts
    m = torch.arange(6.0).view(2, 3) * 100  # a 2-d tensor of one block (stacked whole, not sliced)
    g = {"w": torch.tensor(base, dtype=torch.float32), "s": torch.tensor(10.0), "e": torch.zeros(0), "m": m}
    uploads = [{"w": torch.tensor(base + d, dtype=torch.float32), "s": torch.tensor(10.0 + i), "e": torch.zeros(0),
                "m": m + i * torch.tensor([[1.0, 2, 3], [4, 5, 6]])} for i, d in enumerate(deltas)]
    expected = deltas @ deltas.T + (1 + 91) * np.outer(np.arange(3), np.arange(3))
    gram = update_gram(uploads, g)
    assert gram.dtype == torch.float64 and gram.device.type == "cpu"
    assert gram.tolist() == expected.tolist()


def test_classwise_accuracy_by_hand():
    scores = torch.tensor([[1.0, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1]])
    y = torch.tensor([0, 0, 1, 2])
    acc = classwise_accuracy(scores, y, 4)
    assert acc[:3].tolist() == [0.5, 0.0, 1.0] and math.isnan(acc[3])


def test_partition_heatmap_counts_equal_the_partition(tmp_path):
    x, y = toy_data(n=40, num_classes=4)
    parts = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13, 14], list(range(15, 40))]
    dm = fixed_parts_module(x, y, parts, num_classes=4)
    counts = partition_counts(dm.train_set.labels, dm.client_parts, 4)
    expected = np.zeros((3, 4), dtype=np.int64)
    for client, idx in enumerate(parts):
        for i in idx:
            expected[client, int(y[i])] += 1
    assert (counts == expected).all()
    method = FedAvg(model="mlp", data_spec=dm.spec)
    fit(method, dm, rounds=1, callbacks=[AnalysisCallback()], default_root_dir=str(tmp_path))
    saved = json.loads((tmp_path / "analysis" / "partition.json").read_text())
    assert saved["counts"] == expected.tolist()
    assert (tmp_path / "analysis" / "partition.png").stat().st_size > 0


class _DiskFillsMidWrite:
    """Every file opened for writing under `root` (whose name `fails` accepts) takes half of the
    first block written to it, then the disk is full (ENOSPC), as a disk filling up mid-write;
    patched into builtins.open and io.open, which PIL, Path.write_text and atomic.py all use."""

    def __init__(self, monkeypatch, root, fails=lambda name: True):
        import builtins
        import io

        real_open = builtins.open

        def faulty_open(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            path = Path(file) if isinstance(file, (str, Path)) else None
            if path is None or not any(m in mode for m in "wax+") or root not in path.parents or not fails(path.name):
                return f
            real_write = f.write

            def write(data):
                real_write(data[: len(data) // 2])
                f.flush()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

            f.write = write
            return f

        monkeypatch.setattr(builtins, "open", faulty_open)
        monkeypatch.setattr(io, "open", faulty_open)


def _left_in(folder: Path) -> dict[str, bytes | None]:
    """What a folder holds: each file's bytes (None for a folder)."""
    if not folder.exists():
        return {}
    return {p.name: None if p.is_dir() else p.read_bytes() for p in sorted(folder.iterdir())}


def test_an_analysis_write_the_disk_refuses_leaves_no_half_file_and_no_temporary(tmp_path, monkeypatch):
    """analysis.json, partition.json and every PNG were written in place (write_text, PIL's save):
    a full disk, or a kill, mid-write left half a file that a reader (report, the user) took as the
    round's analysis. Now they are written as the checkpoints are (atomic.py): the old file or
    none, and no temporary holding the space."""
    from types import SimpleNamespace

    from fl_lightning.analysis import plots

    image = np.zeros((40, 60, 3), dtype=np.uint8)
    trainer = SimpleNamespace(is_global_zero=True, default_root_dir=str(tmp_path))
    round_files = {"spectrum": {"top": [2.0, 1.0]}, "spectrum.png": image, "classwise_local.png": image}
    callback = AnalysisCallback()
    plots.save_png(image + 255, tmp_path / "analysis" / "spectrum_history.png")  # an earlier round's picture
    earlier = (tmp_path / "analysis" / "spectrum_history.png").read_bytes()
    with monkeypatch.context() as patch:
        _DiskFillsMidWrite(patch, tmp_path)
        with pytest.raises(OSError, match="No space left on device"):
            callback.write_files(trainer, 3, {"lambda_1": 2.0}, round_files)
        with pytest.raises(OSError, match="No space left on device"):
            plots.save_png(image, tmp_path / "analysis" / "spectrum_history.png")
    assert _left_in(tmp_path / "analysis" / "round_003") == {}
    assert _left_in(tmp_path / "analysis") == {"round_003": None, "spectrum_history.png": earlier}
    # the JSON written, the disk full at the first picture: the JSON is whole, the picture absent
    with monkeypatch.context() as patch:
        _DiskFillsMidWrite(patch, tmp_path, fails=lambda name: name.endswith(".png"))
        with pytest.raises(OSError, match="No space left on device"):
            callback.write_files(trainer, 3, {"lambda_1": 2.0}, round_files)
    left = _left_in(tmp_path / "analysis" / "round_003")
    assert sorted(left) == ["analysis.json"] and json.loads(left["analysis.json"])["spectrum"] == {"top": [2.0, 1.0]}
    # the partition, at fit start
    x, y = toy_data(n=40, num_classes=4)
    dm = fixed_parts_module(x, y, [list(range(0, 20)), list(range(20, 40))], num_classes=4)
    run_dir = tmp_path / "fit"
    with monkeypatch.context() as patch:
        _DiskFillsMidWrite(patch, run_dir)
        with pytest.raises(OSError, match="No space left on device"):
            fit(FedAvg(model="mlp", data_spec=dm.spec), dm, rounds=1, callbacks=[AnalysisCallback()],
                default_root_dir=str(run_dir))
    assert _left_in(run_dir / "analysis") == {}


def test_a_partition_picture_the_disk_refuses_stops_the_fit(tmp_path, monkeypatch):
    """The partition picture is written in the background while round 1 runs: a failure to write
    it must still stop the fit (by the end of round 1), not pass unnoticed, and leave no half file."""
    x, y = toy_data(n=40, num_classes=4)
    dm = fixed_parts_module(x, y, [list(range(0, 20)), list(range(20, 40))], num_classes=4)
    with monkeypatch.context() as patch:
        _DiskFillsMidWrite(patch, tmp_path, fails=lambda name: name.endswith(".png"))
        with pytest.raises(OSError, match="No space left on device"):
            fit(FedAvg(model="mlp", data_spec=dm.spec), dm, rounds=2, callbacks=[AnalysisCallback()],
                default_root_dir=str(tmp_path))
    assert sorted(_left_in(tmp_path / "analysis")) == ["partition.json"]  # no picture, no temporary


def test_partition_heatmap_of_1000_clients_is_a_bounded_picture():
    """A row per client would draw 1,000 clients 17,700 pixels tall (a quarter of a GiB while it is
    drawn): the picture stops growing at 16 inches; a few clients keep a row each."""
    from fl_lightning.analysis import plots

    counts = np.random.default_rng(0).integers(0, 50, size=(1000, 10))
    tall = plots.heatmap_image(counts, "t", "class", "client")
    assert tall.dtype == np.uint8 and tall.shape[0] <= plots.MAX_HEATMAP_INCHES * 80
    few = plots.heatmap_image(counts[:20], "t", "class", "client")
    assert few.shape[0] == round((0.22 * 20 + 1.5) * 80)


class _DropoutBN(FLModel):
    """An MLP with BatchNorm and dropout: training depends on BN's running statistics, on the
    module's train/eval mode and on the global RNG (dropout masks), which an analysis must not touch."""

    def __init__(self, spec):
        super().__init__()
        d = spec.in_channels * spec.image_size**2
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(d, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Dropout(0.3))
        self.head = nn.Linear(12, spec.num_classes)
        self.feature_dim = 12

    def features(self, x):
        return self.body(x)


register_model("test_dropout_bn", lambda spec, **kw: _DropoutBN(spec))


@pytest.mark.parametrize("method_cls", [FedAvg, FedSOL, SCAFFOLD])  # SCAFFOLD uploads more than the model
def test_analysis_on_or_off_trains_the_same_model_bit_for_bit(tmp_path, method_cls):
    x, y = toy_data(n=60, num_classes=3)
    parts = [list(range(0, 20)), list(range(20, 40)), list(range(40, 60))]
    results = []
    for on in (False, True):
        torch.manual_seed(0)
        dm = fixed_parts_module(x, y, parts, num_classes=3, batch_size=10, local_epochs=2)
        method = method_cls(model="test_dropout_bn", data_spec=dm.spec)
        callbacks = [AnalysisCallback(every_n_rounds=1, samples=30, top_k=3, max_hvps=6, trace_probes=2,
                                      layer_hvps=3, surface=kind, surface_points=3, slices=True,
                                      heatmap_every_n_rounds=1)
                     for kind in ("hessian", "random")] if on else []
        fit(method, dm, rounds=2, callbacks=callbacks, eval_local_models=True, default_root_dir=str(tmp_path / str(on)))
        results.append({k: v.clone() for k, v in method.model.state_dict().items()})
        if on:
            assert (tmp_path / "True" / "analysis" / "round_002" / "analysis.json").exists()
    for key, value in results[0].items():
        assert torch.equal(value, results[1][key]), key


def test_model_heterogeneous_method_analyses_client_models_and_says_which(tmp_path, caplog):
    x, y = toy_data(n=60, num_classes=3)
    parts = [list(range(0, 20)), list(range(20, 40)), list(range(40, 60))]
    torch.manual_seed(0)
    dm = fixed_parts_module(x, y, parts, num_classes=3, batch_size=10, client_test_fraction=0.25)
    dm.client_parts, dm.client_test_parts = split_train_test(dm.client_parts, 0.25, 0)  # own test splits
    method = FedORGP(model="mlp,mlp", feature_dim=8, data_spec=dm.spec)
    analysis = AnalysisCallback(every_n_rounds=1, samples=30, top_k=2, max_hvps=6, trace_probes=0,
                                layerwise=False, surface_points=3, max_client_models=2)
    with caplog.at_level("INFO"):
        fit(method, dm, rounds=1, callbacks=[analysis], default_root_dir=str(tmp_path))
    assert "has no global model: analysing the models of client_0, client_1" in caplog.text
    result = json.loads((tmp_path / "analysis" / "round_001" / "analysis.json").read_text())
    assert result["client_0/spectrum"]["lambda_1"] > 0 and result["client_1/spectrum"]["lambda_1"] > 0
    assert (tmp_path / "analysis" / "round_001" / "client_1_surface_loss.png").exists()
