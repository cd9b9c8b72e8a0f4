"""75 losses written for ``jax.jit`` by someone who did not write the library.

They were written from public training code (optax's losses, flax's
examples, MaxText, RL, graph, vision and flow models) to test
``skipreduce_jax.value_and_grad`` against ``jax.value_and_grad``, and are
kept as they were written: ``tests/test_held_out_losses.py`` runs them.
"""

from held_out_losses import cases_a, cases_b, cases_c, cases_d, cases_f, cases_g, cases_h  # noqa: F401
from held_out_losses._registry import CASES

__all__ = ["CASES"]
