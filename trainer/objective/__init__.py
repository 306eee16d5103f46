"""The objective wing: the loss and the update schedule. `grpo.py` holds group advantages and the one pure
loss function (GRPO and its variants), `offpolicy.py` the importance weights and masks that correct for the
sampling engine, `microbatch.py` the split of a batch into micro-batches whose gradients add up to the whole
batch's, and `update.py` one optimizer update per step (π_old on a round's first pass, mu passes per round).
"""
