"""`Tally` (an evaluation a process makes for itself) counts exactly what `Evaluation` (the
torchmetrics one Lightning logs and syncs) counts, NaN policy included."""

import math

import torch
import torch.nn.functional as F

from fl_lightning.evaluation import Evaluation, Tally, evaluate


def _both(batches, num_classes=4, per_class=True):
    tally, metrics = Tally(num_classes, per_class), Evaluation(num_classes, per_class)
    for scores, y in batches:
        tally.update(scores, y)
        metrics.update(scores, y)
    return tally.result(), metrics.result()


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
