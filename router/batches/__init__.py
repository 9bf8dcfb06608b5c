"""Batches (``/v1/batches``), the router's side: the batch rows, their
OpenAI-shaped objects, and the validation of an input file's lines before
any line runs. The control worker runs the lines (workflows/jobs_batch.py);
this package never waits on Temporal."""

LAYER = "gateway"  # this package's layer in the dependency rule: tests/test_layers.py
