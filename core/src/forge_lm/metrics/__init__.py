"""Built-in metrics backends, throughput accounting (MFU) and plots of a run's metrics.

The names below are the keys the training loop (forge_lm.train.loop) logs under; the
console display and ``forge plot`` look for them by these names.
"""

LOSS = "loss"  # training loss of the step
LEARNING_RATE = "lr"  # learning rate of the first parameter group
TOKENS_PER_SECOND = "tokens_per_sec"  # training tokens processed per second
MFU = "mfu"  # model FLOPs utilisation, a fraction of the devices' peak (see forge_lm.metrics.mfu)
EVAL_LOSS = "eval/loss"  # loss on the held-out split, logged at evaluation steps
