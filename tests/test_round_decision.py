"""`decide`, the round's decision, as a pure function: no Trainer, every branch and its precedence."""

import math

import pytest

from fl_lightning.outcome import Outcome
from fl_lightning.round_decision import Collapse, Decision, Policy, RoundFacts, decide

STOP, SKIP = Policy("stop", "mark", 5), Policy("skip_client", "mark", 5)


def facts(**kw) -> RoundFacts:
    return RoundFacts(**{"round": 3, "max_rounds": 10, "method": "FedAvg", "clients": 4, **kw})


def test_a_healthy_round_goes_on_and_its_evaluation_too():
    assert decide(facts(), STOP) == Decision()
    after_step = decide(facts(server_step_finite=True, test_loss=0.5), STOP)
    assert not after_step.stops and after_step.round_completed and after_step.marks == ()


def test_a_nonfinite_upload_stops_at_the_first_such_client_under_stop():
    decision = decide(facts(nonfinite_clients=(2, 7)), STOP)
    assert decision.outcome is Outcome.DIVERGED and not decision.round_completed and decision.skipped == ()
    assert decision.reason == ("diverged: non-finite weights at round 3/10, client 2, method FedAvg; lower the lr "
                               "or set --federation.on_divergence skip_client")


def test_skip_client_leaves_the_clients_out_and_stops_only_when_all_are():
    some = decide(facts(nonfinite_clients=(1, 3)), SKIP)
    assert not some.stops and some.skipped == (1, 3)
    every = decide(facts(nonfinite_clients=(0, 1, 2, 3)), SKIP)
    assert every.outcome is Outcome.DIVERGED and every.skipped == (0, 1, 2, 3)
    assert every.reason == "diverged: every client's upload was non-finite at round 3/10, method FedAvg"


def test_a_nonfinite_server_step_stops_under_either_policy():
    for policy in (STOP, SKIP):
        decision = decide(facts(server_step_finite=False), policy)
        assert decision.outcome is Outcome.DIVERGED and not decision.round_completed
        assert decision.reason == "diverged: non-finite global model after the server step at round 3/10, method FedAvg"


def test_another_process_reason_is_named_and_an_upload_reason_comes_first():
    elsewhere = decide(facts(refused_elsewhere=True), STOP)
    assert elsewhere.reason == "diverged at round 3/10, method FedAvg on another process"
    assert "client 5" in decide(facts(refused_elsewhere=True, nonfinite_clients=(5,)), STOP).reason


@pytest.mark.parametrize("loss", [math.nan, math.inf])
def test_a_nonfinite_test_loss_stops_after_the_round_or_marks(loss):
    stop = decide(facts(server_step_finite=True, test_loss=loss, test_loss_finite=False), STOP)
    assert stop.outcome is Outcome.DIVERGED and stop.round_completed
    assert stop.reason.startswith(f"diverged: the global model's test loss is {loss} (its weights are finite)")
    mark = decide(facts(server_step_finite=True, test_loss=loss, test_loss_finite=False), SKIP)
    assert not mark.stops and [o for o, _ in mark.marks] == [Outcome.DIVERGED]
    assert mark.marks[0][1].endswith("training continues (--federation.on_divergence stop ends such runs)")


def test_a_collapse_marks_or_stops_and_keeps_an_earlier_mark():
    collapsed = facts(server_step_finite=True, test_loss=0.1, collapse=Collapse(chance=0.1, best=0.8))
    mark = decide(collapsed, STOP)
    assert not mark.stops and mark.marks[0][0] is Outcome.FAILED
    assert mark.marks[0][1].startswith("failed: test accuracy has been at chance level (<= 0.100 + 0.01, the majority "
                                       "class's share) for 5 rounds after reaching 0.800, at round 3/10")
    stop = decide(collapsed, Policy("skip_client", "stop", 5))
    assert stop.outcome is Outcome.FAILED and stop.round_completed
    assert stop.reason.endswith("; lower the lr or set --federation.on_collapse mark")
    both = decide(facts(server_step_finite=True, test_loss=math.nan, test_loss_finite=False,
                        collapse=Collapse(0.1, 0.8)), Policy("skip_client", "stop", 5))
    assert both.outcome is Outcome.FAILED and [o for o, _ in both.marks] == [Outcome.DIVERGED]
