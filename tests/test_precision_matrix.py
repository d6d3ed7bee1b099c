"""Every precision through every kind of local step (issue 21's matrix), on CPU: two tiny rounds of
one method per family in 32-true, 64-true, bf16-mixed and bf16-true give finite results, with the
parameters in the precision's dtype (a float32 tensor inside a float64 run was a crash or a silent
loss of precision: the analyses' subsets, model-heterogeneous client models, FedGen's noise and
heads, FedORGP's prototypes, and the local models' evaluation after every client, on by default).
The analyses and personalised evaluation (fine-tuned copies, Ditto's personal models) run in every
precision too."""

import math

import pytest
from precision_matrix import DTYPE, FAMILIES, PRECISIONS, two_rounds


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_runs_in_a_precision(family, precision):
    result = two_rounds(family, precision)
    assert result["finite"], result
    assert result["acc"] is not None and math.isfinite(result["acc"]) and 0.0 <= result["acc"] <= 1.0
    assert result["dtypes"] == {str(DTYPE[precision])}, result["dtypes"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("family", ["FedAvg", "Ditto", "FedORGP"])
def test_the_analyses_run_in_a_precision(family, precision):
    result = two_rounds(family, precision, analyses=True)
    assert result["finite"] and math.isfinite(result["acc"])
