"""The ``muon`` optimizer honours the core's optimizer contract (the conformance kit)."""

from forge_lm.testing import parametrize_with_checks


@parametrize_with_checks(components=[("optimizers", "muon")])
def test_muon_passes_the_optimizer_conformance_checks(check):
    check()
