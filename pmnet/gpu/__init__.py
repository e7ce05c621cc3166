"""A trial's GPU footprint (issue 47): `footprint` predicts it (the peak bytes of a trial on
its card, measured on CPU), `cap` caps it (the trial's allocator at its share of the card).
Both sit below training, which caps each trial; the check that verifies them on a card runs
training, so it sits above it, in `pmnet.gpu_check` (`make gpu-check`; issue 51).

This package's `__init__` imports nothing.
"""
