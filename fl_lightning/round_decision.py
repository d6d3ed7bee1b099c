"""What a round's facts decide: go on, leave clients out, mark the run, or stop it.

The round callback (`federation.FederatedCallback`) gathers what a round showed into `RoundFacts`
(every process's, agreed between processes), asks `decide` and applies the `Decision`, as
Lightning's EarlyStopping separates its check from its stop. `decide` is a pure function of the
facts and the policy: it needs no Trainer, and every process that holds the same facts takes the
same decision. It is asked twice a round: after the clients' uploads and the server step (a stop
then abandons the round), and after the new global model's evaluation (the round is then complete).
The checks, in the order they take precedence:

1. an upload with NaN/inf: `on_divergence: stop` stops the run at the first such client;
   `skip_client` leaves those clients out, and stops only when every client's upload was one;
2. another process found a reason to stop (it says which in its own line);
3. a non-finite global model after the server step (no client to leave out: always a stop);
4. a non-finite global test loss with finite weights: a stop, or under `skip_client` a mark;
5. a collapse to chance accuracy (the papers' "Failed"): a mark, or under `on_collapse: stop` a stop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fl_lightning.outcome import Outcome


@dataclass(frozen=True)
class Policy:
    """The federation's options that decide (see `FederatedCallback`)."""

    on_divergence: Literal["stop", "skip_client"] = "stop"
    on_collapse: Literal["mark", "stop"] = "mark"
    collapse_rounds: int = 5


@dataclass(frozen=True)
class Collapse:
    """A collapse confirmed this round: the chance accuracy (the majority class's share of the
    test set) and the best accuracy the run had reached before."""

    chance: float
    best: float


@dataclass(frozen=True)
class RoundFacts:
    """What a round showed, as every process agrees on it.

    `server_step_finite` is None before the server step was taken, `test_loss` None before the
    global model was evaluated (or when its evaluation has no loss)."""

    round: int  # 1-based
    max_rounds: int
    method: str
    clients: int = 0  # the round's clients (every process's, or this process's with batch parallelism)
    nonfinite_clients: tuple[int, ...] = ()  # of those, the ones whose upload held NaN/inf, in order
    refused_elsewhere: bool = False
    server_step_finite: bool | None = None
    test_loss: float | None = None
    test_loss_finite: bool = True
    collapse: Collapse | None = None

    def where(self, client: int | None = None) -> str:
        who = "" if client is None else f", client {client}"
        return f"round {self.round}/{self.max_rounds}{who}, method {self.method}"


@dataclass(frozen=True)
class Decision:
    """`outcome` is RUNNING unless the run stops after this round; `reason` is then its `error:`
    line and `round_completed` tells whether the round's server step was applied (a stop before
    it abandons the round). `skipped`: clients whose uploads are left out; `marks`: what was seen
    without stopping, (outcome, message), which decides the outcome of a run that runs to its end."""

    outcome: Outcome = Outcome.RUNNING
    reason: str = ""
    round_completed: bool = False
    skipped: tuple[int, ...] = ()
    marks: tuple[tuple[Outcome, str], ...] = ()

    @property
    def stops(self) -> bool:
        return self.outcome is not Outcome.RUNNING


def decide(facts: RoundFacts, policy: Policy) -> Decision:
    """The round's decision (see the module's docstring for the checks and their order)."""
    skipped = facts.nonfinite_clients if policy.on_divergence == "skip_client" else ()
    stop = _stop_before_evaluation(facts, policy)
    if stop:
        return Decision(Outcome.DIVERGED, stop, skipped=skipped)
    completed = facts.server_step_finite is True
    where = facts.where()
    marks: list[tuple[Outcome, str]] = []
    if facts.test_loss is not None and not facts.test_loss_finite:
        # finite weights can still give a NaN/inf test loss (an overflowing logit, a cosine of a
        # zero feature): the model is as unusable as one with NaN weights, so the same policy holds
        if policy.on_divergence == "stop":
            return Decision(Outcome.DIVERGED, f"diverged: the global model's test loss is {facts.test_loss} (its "
                                              f"weights are finite) at {where}; lower the lr or set "
                                              f"--federation.on_divergence skip_client", completed, skipped)
        marks.append((Outcome.DIVERGED, f"non-finite global test loss ({facts.test_loss}) at {where}; training "
                                        f"continues (--federation.on_divergence stop ends such runs)"))
    if facts.collapse is not None:
        message = (f"failed: test accuracy has been at chance level (<= {facts.collapse.chance:.3f} + 0.01, the "
                   f"majority class's share) for {policy.collapse_rounds} rounds after reaching "
                   f"{facts.collapse.best:.3f}, at {where}")
        if policy.on_collapse == "stop":
            return Decision(Outcome.FAILED, message + "; lower the lr or set --federation.on_collapse mark",
                            completed, skipped, tuple(marks))
        marks.append((Outcome.FAILED, message + "; training continues (--federation.on_collapse stop ends such "
                                                "runs)"))
    return Decision(round_completed=completed, skipped=skipped, marks=tuple(marks))


def _stop_before_evaluation(facts: RoundFacts, policy: Policy) -> str:
    """The `error:` line of a round that cannot reach its evaluation ("" when it can)."""
    if facts.nonfinite_clients and policy.on_divergence == "stop":
        return (f"diverged: non-finite weights at {facts.where(min(facts.nonfinite_clients))}; lower the lr or set "
                f"--federation.on_divergence skip_client")
    if facts.clients and len(facts.nonfinite_clients) == facts.clients:
        return f"diverged: every client's upload was non-finite at {facts.where()}"
    if facts.refused_elsewhere:
        return f"diverged at {facts.where()} on another process"
    if facts.server_step_finite is False:
        # finite uploads can still give NaN/inf (a server step size, a control variate, overflow);
        # no client to leave out then, so the run stops either way
        return f"diverged: non-finite global model after the server step at {facts.where()}"
    return ""
