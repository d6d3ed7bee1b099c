"""`Tally` (every evaluation's counts) counts exactly what torchmetrics' metric objects count, NaN
policy included; `Evaluation` (the global model's, which Lightning's loops run) computes from
those counts the values torchmetrics computed, to the bit."""

import math

import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy

from fl_lightning.evaluation import EvalResult, Evaluation, Tally, _eval_result, evaluate


class Torchmetrics:
    """The reference: torchmetrics' micro and per-class accuracy objects and a float64 sum of the
    per-sample cross-entropies (what the global evaluation logged through them before)."""

    def __init__(self, num_classes: int, per_class: bool):
        self.accuracy = MulticlassAccuracy(num_classes=num_classes, average="micro", validate_args=False)
        self.per_class = MulticlassAccuracy(num_classes=num_classes, average="none",
                                            validate_args=False) if per_class else None
        self.loss_total, self.samples = torch.tensor(0.0, dtype=torch.float64), 0

    def update(self, scores, y):
        scores = scores.float()
        self.accuracy.update(scores, y)
        if self.per_class is not None:
            self.per_class.update(scores, y)
        self.loss_total += F.cross_entropy(scores, y, reduction="sum").double()
        self.samples += len(y)

    def result(self) -> EvalResult:
        per_class = None if self.per_class is None else (self.per_class.tp, self.per_class.tp + self.per_class.fn)
        return _eval_result(int(self.accuracy.tp.sum()), int((self.accuracy.tp + self.accuracy.fn).sum()),
                            float(self.loss_total), per_class)


def _both(batches, num_classes=4, per_class=True):
    tally, metrics = Tally(num_classes, per_class), Torchmetrics(num_classes, per_class)
    for scores, y in batches:
        tally.update(scores, y)
        metrics.update(scores, y)
    return tally.result(), metrics.result()


def test_the_global_evaluation_computes_torchmetrics_values_to_the_bit():
    """Lightning logged torchmetrics' computed values: a float32 accuracy and a float64 mean loss.
    `Evaluation.compute` gives the same tensors from its counts, and starts again after reset."""
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(n, 7, generator=g), torch.randint(0, 7, (n,), generator=g)) for n in (500, 333, 1)]
    evaluation, reference = Evaluation(7), Torchmetrics(7, per_class=False)
    for scores, y in batches:
        evaluation.update(scores, y)
        reference.update(scores, y)
    acc, loss = evaluation.compute()
    assert acc.dtype == torch.float32 and loss.dtype == torch.float64
    assert torch.equal(acc, reference.accuracy.compute()) and 0 < float(acc) < 1
    assert torch.equal(loss, reference.loss_total / reference.samples)
    evaluation.reset()
    evaluation.update(*batches[2])
    acc, loss = evaluation.compute()
    one = batches[2]
    assert float(acc) == float((one[0].argmax(1) == one[1]).float().mean())
    assert float(loss) == float(F.cross_entropy(one[0], one[1]).double())
    evaluation.reset()
    assert all(math.isnan(float(v)) for v in evaluation.compute())  # no samples: NaN, not 0


def _same(a, b):
    assert (a.correct, a.samples) == (b.correct, b.samples)
    assert a.accuracy == b.accuracy or (math.isnan(a.accuracy) and math.isnan(b.accuracy))
    assert a.loss == b.loss or (math.isnan(a.loss) and math.isnan(b.loss))
    if a.class_accuracy is not None or b.class_accuracy is not None:
        assert torch.equal(a.class_accuracy.isnan(), b.class_accuracy.isnan())
        known = ~a.class_accuracy.isnan()
        assert torch.equal(a.class_accuracy[known], b.class_accuracy[known])


def test_a_hand_counted_case():
    # class 3 never occurs; rows 0, 2 and 3 are right, row 1 is wrong
    scores = torch.tensor([[5.0, 0, 0, 0], [0, 0, 5, 0], [0, 0, 5, 0], [9, 0, 0, 0]])
    y = torch.tensor([0, 1, 2, 0])
    tally, metrics = _both([(scores, y)])
    assert (tally.correct, tally.samples, tally.accuracy) == (3, 4, 0.75)
    assert tally.loss == float(F.cross_entropy(scores, y, reduction="sum").double()) / 4
    assert tally.class_accuracy[:3].tolist() == [1.0, 0.0, 1.0] and math.isnan(tally.class_accuracy[3])
    _same(tally, metrics)


def test_several_batches_nan_and_inf_scores_count_as_in_torchmetrics():
    g = torch.Generator().manual_seed(0)
    batches = []
    for n in (7, 1, 13):
        scores, y = torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)
        batches.append((scores, y))
    batches[1][0][0, 2] = math.nan  # argmax of a NaN row, and a NaN loss that must not be dropped
    batches[2][0][3, 1] = math.inf
    tally, metrics = _both(batches)
    assert math.isnan(tally.loss)
    _same(tally, metrics)
    tally, metrics = _both(batches[2:])  # inf score, finite data otherwise
    _same(tally, metrics)
    # an empty batch first (the first batch's counts are taken as they are, not added to zeros)
    empty = (torch.zeros(0, 4, dtype=torch.float64), torch.zeros(0, dtype=torch.long))
    counted = Tally(4, per_class=True)
    for scores, y in [empty, *batches[2:], empty]:
        counted.update(scores, y)
    tally = counted.result()
    _same(tally, metrics)  # torchmetrics' of batches[2:] alone (it refuses empty batches)
    assert (tally.correct, tally.samples) == (int((batches[2][0].argmax(1) == batches[2][1]).sum()), 13)


def test_the_overall_count_without_classes_is_torchmetrics_count_ties_nan_and_inf_included():
    # without per-class counts Tally counts argmax == label itself; torchmetrics' metric objects
    # (and its per-class counting) must agree on ties (first maximum), NaN rows and inf scores
    g = torch.Generator().manual_seed(3)
    batches = []
    for n in (9, 4, 16):
        scores = torch.randint(0, 3, (n, 5), generator=g).float()  # many ties
        batches.append((scores, torch.randint(0, 5, (n,), generator=g)))
    batches[0][0][2] = math.nan
    batches[0][0][5, 1] = math.nan  # argmax of a row with a NaN is the NaN's column: right here
    batches[0][1][5] = 1
    batches[1][0][0, 4] = math.inf
    batches[2][0][7] = -math.inf
    # ties go to the first maximum: right for label 0, wrong for label 2
    batches[2][0][8], batches[2][1][8] = torch.tensor([4.0, 1, 4, 0, 0]), 0
    batches[2][0][9], batches[2][1][9] = torch.tensor([4.0, 1, 4, 0, 0]), 2
    for part in (batches, batches[1:2]):
        overall, metrics = _both(part, num_classes=5, per_class=False)
        per_class, _ = _both(part, num_classes=5, per_class=True)
        _same(overall, metrics)
        assert (overall.correct, overall.samples) == (per_class.correct, per_class.samples)
        assert overall.correct == sum(int((s.argmax(1) == y).sum()) for s, y in part)


def test_no_samples_give_nan_not_zero():
    tally, metrics = _both([])
    assert tally.samples == 0 and math.isnan(tally.accuracy) and math.isnan(tally.loss)
    assert tally.class_accuracy.isnan().all()
    _same(tally, metrics)


def test_evaluate_a_model_in_eval_mode_and_restores_its_flags():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.9))
    x, y = torch.randn(20, 3, generator=torch.Generator().manual_seed(1)), torch.arange(20) % 4
    model.train()
    result = evaluate(model, [(x[:12], y[:12]), (x[12:], y[12:])], 4)
    with torch.no_grad():
        scores = model[0](x)  # dropout off in eval mode
    assert result.correct == int((scores.argmax(1) == y).sum())
    assert math.isclose(result.loss, float(F.cross_entropy(scores, y)), rel_tol=1e-6)
    assert model.training and model[1].training


def test_each_rounds_logged_accuracy_and_loss_are_the_global_models_on_the_test_set(tmp_path, monkeypatch):
    """Through the CLI: round 2's `global/test_acc` and `global/test_loss` in metrics.csv are, to
    the last digit, the saved global model's on the global test set (its batches, float32
    accuracy, float64 mean cross-entropy), so round 1's counts were not carried into round 2's.
    The validation DataLoader is built once for the fit (the training one every round: each
    round has its own clients)."""
    from test_cli import REPO, run

    from fl_lightning.comparison import read_metrics
    from fl_lightning.data.datamodule import FederatedDataModule
    from fl_lightning.models import build_model

    built = {"train": 0, "val": 0}
    for kind in built:
        original = getattr(FederatedDataModule, f"{kind}_dataloader")

        def counted(self, _original=original, _kind=kind):
            built[_kind] += 1
            return _original(self)

        monkeypatch.setattr(FederatedDataModule, f"{kind}_dataloader", counted)
    root = tmp_path / "run"
    tiny = ["--data.dataset", "digits", "--model.init_args.model", "mlp", "--data.num_clients", "10",
            "--data.min_size", "5", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
            "--analysis.divergence", "false", "--federation.eval_local_models", "false"]
    assert run(["fit", "--config", str(REPO / "configs/settings/mnist5k.yaml"), "--config",
                str(REPO / "configs/methods/fedsol/fedavg.yaml"), *tiny, "--trainer.max_epochs", "2",
                "--trainer.default_root_dir", str(root)]) == 0
    assert built == {"train": 2, "val": 1}
    monkeypatch.undo()
    state = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    data = FederatedDataModule(dataset="digits", num_clients=10, min_size=5)
    data.setup()
    model = build_model("mlp", data.spec)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
    model.eval()
    correct, samples, loss_total = 0, 0, torch.tensor(0.0, dtype=torch.float64)
    with torch.no_grad():
        for x, y in data.val_dataloader():
            scores = model(x).float()
            correct += int((scores.argmax(1) == y).sum())
            samples += len(y)
            loss_total += F.cross_entropy(scores, y, reduction="sum").double()
    rows = read_metrics(root / "metrics.csv")
    assert [r["round"] for r in rows] == [1.0, 2.0] and rows[0]["global/test_acc"] != rows[1]["global/test_acc"]
    assert rows[1]["global/test_acc"] == float(torch.tensor(correct, dtype=torch.float32) / samples)
    assert rows[1]["global/test_loss"] == float(loss_total / samples)
