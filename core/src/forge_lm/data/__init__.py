"""Training data: the built-in datasets, the sampler they share, and the batch loader.

Every built-in text dataset packs documents into windows of ``seq_len + 1`` tokens
(:mod:`forge_lm.data.packing`) and visits them through one deterministic sampler
(:mod:`forge_lm.data.sampler`), so shuffling, data-parallel sharding and exact resumption
work the same way for all of them. The one exception is ``hf_text`` with ``streaming = true``,
which never holds the corpus: it reads windows in file order through a shuffle buffer
(:mod:`forge_lm.data.streaming`), resuming exactly all the same. Nothing here is imported by ``import forge_lm.data``
alone: each module loads its own (possibly heavy) dependencies.
"""
