"""The optax layer: ``skip_reduce`` and what composes with it.

``transform`` (the reduction core), ``gate`` (``error_feedback="auto"``),
``norms`` and ``radial`` (BatchNorm), ``adamw``, ``multisteps``,
``per_rank`` (per-rank state), ``stats`` (``comm_stats``) and ``guards``
(replica checks). Imports the ring layer.
"""
