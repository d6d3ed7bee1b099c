"""Every method's final state after a tiny 2-round run equals the stored one (every tensor's sum
and 8 of its values, to rtol 1e-6, the last-bit differences of another CPU's matrix products; see
tests/method_digests.py for how the values were made): a change to the core that moves any
method's numbers fails here. One torch thread, as conftest sets."""

import json
from pathlib import Path

import pytest
from method_digests import digest, method_names

DIGESTS = json.loads((Path(__file__).parent / "data" / "method_digests.json").read_text())


def test_every_method_has_stored_values():
    assert set(method_names()) == set(DIGESTS)


@pytest.mark.parametrize("name", sorted(DIGESTS))
def test_a_methods_two_rounds_reproduce_the_stored_values(name):
    got, expected = digest(name), DIGESTS[name]
    assert got.keys() == expected.keys()
    for key, values in expected.items():
        assert got[key] == pytest.approx(values, rel=1e-6, abs=1e-9), key
