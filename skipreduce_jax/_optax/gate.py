"""The rule of ``skip_reduce(error_feedback="auto")``: when to feed back.

Error feedback (each rank adds what skipping left out to its next step)
closed the validation gap of a run that over-fits with SGD, and cost runs
under AdamW and runs at the edge of stability. The gate feeds back while
both of these hold, each an exponential mean over about the last
``1 / MEMORY`` steps:

- **The optimizer is linear in the gradients** (SGD, with or without
  momentum): each step is a combination of the last step and the gradient,
  ``p_(t+1) - p_t = a (p_t - p_(t-1)) + b g_t``, on every element. The
  least-squares fit over a fixed sample of elements leaves a share of the
  step's new part unexplained: 0 for SGD, most of it for AdamW, which
  divides each element by its own scale. Held below ``NONLINEAR``.
- **Steps rarely overshoot**: the next gradient points along the last step,
  ``<g_(t+1), p_(t+1) - p_t> > 0`` (the gradient-restart test), as at the
  edge of stability. Its share is held below ``OVERSHOOT``.

And once it has opened, it shuts for good (the residual dropped) when
the steps grow: the sampled step's norm, an exponential mean over about
3 steps, beyond ``GROWTH`` times its mean while shut. On a transformer
that rarely overshot, feeding back made the steps grow 2x within 12 steps
of opening and diverge within 20; where it helped, they stayed under
1.7x.

Both start at 1, shut: the first opening comes after about 45 steps
(``0.95 ** 45 < NONLINEAR``). Both tests read the same fixed sample of
``SAMPLE`` elements per leaf, the overshoot's dot product weighted back
to the leaves' sizes: the state holds that sample of the last params, the
last step and the last gradient, never a copy of the params, and a step
touches no other element. The ranks agree through one scalar ``pmin`` a
step. The measurements: ``docs/records/convergence.md``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from skipreduce_jax._types import PyTree

MEMORY = 0.05
OVERSHOOT = 0.5
NONLINEAR = 0.1
SAMPLE = 256
GROWTH = 2.0
RECENT = 0.3  # the recent step norm's weight per step


class FeedbackGateState(NamedTuple):
    """State of ``skip_reduce(error_feedback="auto")``.

    Attributes:
      skip: the :class:`SkipReduceState`; its ``residual`` is zero while the
        gate is shut.
      previous: float32[leaves, SAMPLE], the sampled elements of the last
        step's params.
      overshooting: float32, the mean share of overshooting steps (starts
        at 1).
      nonlinear: float32, the mean unexplained share of a step (starts at 1).
      last_step, last_grad: float32[leaves, SAMPLE], the sampled elements
        of the last step and of the gradient delivered last.
      calm: float32, the sampled step's norm, a mean over the steps taken
        shut (0 before the first).
      recent: float32, the same over about the last 3 steps.
      tripped: bool, True once the steps grew while it fed back: shut for good.
    """

    skip: PyTree
    previous: PyTree
    overshooting: jax.Array
    nonlinear: jax.Array
    last_step: jax.Array
    last_grad: jax.Array
    calm: jax.Array
    recent: jax.Array
    tripped: jax.Array


def _sample(leaves: list[jax.Array]) -> jax.Array:
    """``SAMPLE`` evenly spaced elements of each leaf (zeros where it is shorter)."""
    rows = []
    for x in leaves:
        flat = x.reshape(-1).astype(jnp.float32)
        picked = flat[::max(1, flat.size // SAMPLE)][:SAMPLE]
        rows.append(jnp.pad(picked, (0, SAMPLE - picked.size)))
    return jnp.stack(rows) if rows else jnp.zeros((0, SAMPLE), jnp.float32)


def _weights(leaves: list[jax.Array]) -> jax.Array:
    """Per leaf, its size over the count :func:`_sample` takes of it."""
    sizes = [x.size for x in leaves]
    taken = [min(SAMPLE, -(-s // max(1, s // SAMPLE))) for s in sizes]
    return jnp.asarray([s / t if t else 0.0 for s, t in zip(sizes, taken)],
                       jnp.float32).reshape(-1, 1)


def init(skip: Any, params: Any) -> FeedbackGateState:
    leaves = jax.tree_util.tree_leaves(params)
    empty = _sample([jnp.zeros(0)] * len(leaves))
    zero = jnp.zeros((), jnp.float32)
    return FeedbackGateState(skip, _sample(leaves),
                             jnp.ones((), jnp.float32), jnp.ones((), jnp.float32),
                             empty, empty, zero, zero, jnp.zeros((), jnp.bool_))


def is_open(state: FeedbackGateState, axes: tuple[str, ...]) -> jax.Array:
    """Whether this step feeds back: the same bool on every rank."""
    return lax.pmin(_rule(state).astype(jnp.int32), axes) > 0


def _rule(state: FeedbackGateState) -> jax.Array:
    return (state.overshooting < OVERSHOOT) & (state.nonlinear < NONLINEAR) & ~state.tripped


def unexplained(step: jax.Array, last_step: jax.Array, grad: jax.Array) -> jax.Array:
    """The share of ``step``'s part beside ``last_step`` that ``grad`` does not explain.

    0 when ``step = a last_step + b grad``; 1 when it is orthogonal to both.
    """
    def beside(x):  # x without its component along last_step
        return x - last_step * jnp.vdot(x, last_step) / jnp.maximum(
            jnp.vdot(last_step, last_step), 1e-30)

    u, v = beside(step), beside(grad)
    uu, vv, uv = jnp.vdot(u, u), jnp.vdot(v, v), jnp.vdot(u, v)
    share = 1 - uv * uv / jnp.maximum(uu * vv, 1e-30)
    return jnp.where((uu > 0) & (vv > 0), jnp.clip(share, 0.0, 1.0), 1.0)


def advance(state: FeedbackGateState, skip: Any, delivered: Any, params: Any
            ) -> FeedbackGateState:
    """The next state, after this step delivered ``delivered`` at ``params``."""
    grads = jax.tree_util.tree_leaves(delivered)
    now = _sample(jax.tree_util.tree_leaves(params))
    step = now - state.previous  # taken from last_grad, after last_step
    grad = _sample(grads)
    # <g, p_(t+1) - p_t> over every element, estimated from the sample.
    overshot = jnp.sum(_weights(grads) * grad * step) > 0
    count = state.skip.count  # steps before this one

    def mean(old, new, since, weight=MEMORY):  # the test needs `since` steps taken
        return jnp.where(count >= since, (1 - weight) * old + weight * new, old)

    def norm_mean(old, new, weight):  # from the first step taken, which sets it
        return jnp.where(old > 0, mean(old, new, 1, weight), jnp.where(count >= 1, new, old))

    fed = _rule(state)  # this step fed back (the ranks agree: their states are equal)
    norm = jnp.linalg.norm(step)
    calm = jnp.where(fed, state.calm, norm_mean(state.calm, norm, MEMORY))
    recent = norm_mean(state.recent, norm, RECENT)
    return FeedbackGateState(
        skip, now,
        mean(state.overshooting, overshot.astype(jnp.float32), 1),
        mean(state.nonlinear, unexplained(step, state.last_step, state.last_grad), 2),
        step, grad, calm, recent,
        state.tripped | (fed & (calm > 0) & (recent > GROWTH * calm)))
