"""Conformance kit: checks that a component or a plugin distribution honours Forge's contracts.

In the spirit of scikit-learn's ``parametrize_with_checks``; plugin authors run it in their
own tests::

    from forge_lm.testing import parametrize_with_checks

    @parametrize_with_checks(
        components=[("losses", "my_loss", {"reference": my_reference_loss})],
        distributions=["my-forge-plugin"],
    )
    def test_conformance(check):
        check()

Per category, what is checked (and the keyword aids a component may need):

- optimizers: every trainable parameter is in exactly one group; the loss of a tiny problem
  falls within 40 steps (run at ``lr = 1e-2`` unless the options give one); a state-dict round
  trip (plain data, ``weights_only`` loadable) resumes bit for bit.
- schedulers: the documented linear warmup ``(s + 1) / W``; rates within ``[0, base]``; a
  state-dict round trip resumes the same schedule.
- losses: finite value and gradients; positions labelled ``IGNORE_INDEX`` have no effect; the
  value is a token mean (what gradient accumulation relies on); equality with an independent
  ``reference(logits, labels)`` that the author supplies.
- datasets: sample form; reproducibility; a state round trip restores the exact next sample;
  data-parallel ranks get distinct samples. Aid: ``context=DataContext(...)``.
- metrics backends: writes only inside the run directory; what was logged is recorded, read
  back by ``read_back(run_dir, output)`` that the author supplies.
- tokenizers: ids within the vocabulary; ``decode(encode(text)) == text`` (``lossless=False``
  turns this off).
- feed-forward layers: shape-preserving, finite, gradients reach the input and every parameter.
- every category: the options survive a round trip through a config table.
- distributions: entry points in the ``forge_lm`` group; plugin modules import no heavy
  dependency; the declared plugin API range admits this core; the plugin loads with status ok.

Routers and model transforms have no behavioural checks yet: their contracts are defined by
the features that use them.
"""

from forge_lm.testing._kit import Check, check_component, component_checks, parametrize_with_checks
from forge_lm.testing._packaging import distribution_checks
from forge_lm.testing._tiny import TINY_MODEL

__all__ = [
    "TINY_MODEL",
    "Check",
    "check_component",
    "component_checks",
    "distribution_checks",
    "parametrize_with_checks",
]
