"""metrics.csv's rows (results.RoundRows): the file a round writes is the file a full render
writes, a resumed run reads back exactly the rows it saved (also from the list of dicts earlier
versions saved), and a round's cost does not grow with the rounds before it."""

from __future__ import annotations

import csv
import io
import math
import random

import pytest
import torch

from fl_lightning.results import ResultsCallback, RoundRows, _csv_text


@pytest.fixture
def rendered_lines(monkeypatch) -> list[int]:
    """[how many CSV lines (header or row) csv.DictWriter has rendered since the test began]."""
    rendered = [0]
    writerow = csv.DictWriter.writerow

    def counted(self, rowdict):
        rendered[0] += 1
        return writerow(self, rowdict)

    monkeypatch.setattr(csv.DictWriter, "writerow", counted)
    return rendered


def _rows_of_a_long_run():
    """Rows as a run makes them: sorted metric keys, a NaN loss, -inf, cells logged every 5th round,
    a column first logged at round 100, and two replays (a resumed run's rounds after its
    checkpoint are trained again and replace the rows that were there)."""
    rng = random.Random(0)
    r = 0
    for step in range(1, 260):
        r = r + 1 if step not in (50, 120) else max(1, r - rng.randint(1, 9))
        row = {"global/test_acc": rng.random(), "global/test_loss": math.nan if r % 7 == 0 else rng.random()}
        if r % 5 == 0:
            row["analysis/class_acc/3"] = rng.random()
        if r >= 100:
            row["late/metric"] = float(r)
        if r % 11 == 0:
            row["perf/odd"] = -math.inf
        yield {"round": r, **dict(sorted(row.items()))}


def test_metrics_csv_is_the_full_render_of_the_rows_after_every_round():
    table, kept = RoundRows(), []
    for row in _rows_of_a_long_run():
        kept = [x for x in kept if x["round"] < row["round"]] + [row]
        table.put(row)
        columns = ["round", *sorted({k for x in kept for k in x} - {"round"})]
        assert table.csv_text() == _csv_text(columns, kept)
    assert [repr(x) for x in table.rows] == [repr(x) for x in kept]  # repr: NaN != NaN
    assert [x["round"] for x in table.rows] == list(range(1, len(kept) + 1))
    parsed = list(csv.DictReader(io.StringIO(table.csv_text())))
    assert parsed[6]["global/test_loss"] == "nan" and parsed[0]["analysis/class_acc/3"] == ""


def test_a_resumed_run_reads_back_the_rows_it_saved_through_torch_save():
    table = RoundRows(list(_rows_of_a_long_run()))
    buffer = io.BytesIO()
    torch.save(ResultsCallback("unused").state_dict() | table.state(), buffer)
    buffer.seek(0)
    results = ResultsCallback("unused")
    results.load_state_dict(torch.load(buffer, weights_only=True))  # plain types and tensors only
    back = results.rows
    # same keys in the same order (summary.json's `last` is written in row order), same floats
    assert [repr(list(x.items())) for x in back] == [repr(list(x.items())) for x in table.rows]
    assert all(type(x["round"]) is int for x in back)
    assert results.table.csv_text() == table.csv_text()


def test_a_checkpoint_of_the_earlier_format_still_resumes():
    rows = list(RoundRows(list(_rows_of_a_long_run())).rows)
    results = ResultsCallback("unused")
    results.load_state_dict({"rows": rows, "wall_time_s": 3.0})
    assert [repr(x) for x in results.rows] == [repr(x) for x in rows]
    assert results.wall_time() >= 3.0


def test_a_round_renders_its_own_line_and_its_checkpoint_share_stays_per_row(rendered_lines):
    """At round 400 of a 30-column run, rendering every row again cost 22 ms a round, and pickling
    rows as dicts into each round checkpoint 14 ms more: both grew with the round number."""
    table, columns, rounds = RoundRows(), [f"analysis/metric_{i}" for i in range(30)], 1000
    for r in range(1, rounds + 1):
        table.put({"round": r, **{c: r + i / 7 for i, c in enumerate(columns)}})
        table.csv_text()
    assert rendered_lines[0] == 2 * rounds  # the round's line and the header, each round (not 500,500 lines)
    buffer = io.BytesIO()
    torch.save(table.state(), buffer)
    assert len(buffer.getvalue()) < rounds * 31 * 8 * 1.2  # a float64 and a flag per cell, not a dict


def test_the_results_callback_writes_each_round_in_time_that_does_not_grow_with_the_rounds(tmp_path,
                                                                                          rendered_lines):
    """Through the callback, as a run drives it: 300 rounds of 30 metrics. The file after the last
    round is every round's row, and the rounds rendered 2 CSV lines each (their own and the header;
    before, every round rendered every earlier row again: 45,451 lines here)."""
    from types import SimpleNamespace

    from fl_lightning.federation import FederatedCallback, RoundReport

    federation, results, rounds = FederatedCallback(), ResultsCallback(tmp_path), 300
    trainer = SimpleNamespace(callbacks=[federation, results], is_global_zero=True, loggers=[], sanity_checking=False,
                              max_epochs=rounds, callback_metrics={}, should_stop=False)
    module = SimpleNamespace(accuracy_key="global/test_acc")
    for r in range(1, rounds + 1):
        trainer.callback_metrics = {"global/test_acc": torch.tensor(r / rounds),
                                    **{f"analysis/metric_{i}": torch.tensor(r + i / 7) for i in range(29)}}
        federation.round_report = RoundReport(round=r, completed=True)
        results.on_train_epoch_end(trainer, module)
    rendered = rendered_lines[0]
    written = list(csv.DictReader(io.StringIO((tmp_path / "metrics.csv").read_text())))
    assert [int(row["round"]) for row in written] == list(range(1, rounds + 1))
    assert float(written[-1]["analysis/metric_7"]) == torch.tensor(rounds + 1.0).item()
    assert rendered <= 2 * rounds + 1  # and clients.csv's header
