"""A trial's GPU footprint in one place (issue 47): `footprint` predicts it (the peak bytes
of a trial on its card, measured on CPU), `cap` caps it (the trial's allocator at its share
of the card), `check` verifies it on a card (`python -m pmnet.gpu.check`, `make gpu-check`).

This package's `__init__` imports nothing, so `python -m pmnet.gpu.check` loads only torch,
Lightning and the model (no Ray, MLflow, pandas or statsmodels).
"""
