"""The entry points that compute gradients.

``grad`` (``value_and_grad``), ``partition`` (the loss run on the data
axis's pieces), ``micro`` (micro-batches), and the per-rank steps:
``parallel`` (``data_parallel``), ``training``, ``count`` and ``replay``.
Imports the optax and ring layers.
"""
