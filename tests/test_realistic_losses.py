"""``value_and_grad`` on realistic losses, written as for ``jax.jit``.

The losses (tests/realistic_losses.py: contrastive, RL, LM, GAN, diffusion,
flax linen models, custom VJPs, scans, sorts over the batch, ...) run inside
``jax.jit`` on an 8-device mesh with one axis "data", under Explicit and Auto
axes. At ``num_skip=0``, ``skipreduce_jax.value_and_grad`` returns
``jax.value_and_grad``'s value, every aux leaf and every gradient; with
skipping on, the gradients are still the same on every device, and differ
from the exact ones.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from realistic_losses import CASES, resolve

import skipreduce_jax as sr

pytestmark = pytest.mark.slow

KINDS = ("explicit", "auto")
RTOL, ATOL = 1e-4, 1e-5
BF16_TOL = 2e-2  # rtol and atol where the loss computes in bfloat16


@functools.cache
def _mesh(kind):
    axis = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return jax.make_mesh((8,), ("data",), axis_types=(axis,))


def _skipreduce(num_skip):
    return functools.partial(sr.value_and_grad, step=0, num_skip=num_skip, min_size=0)


class _Case:
    """A case of realistic_losses: its arguments, and its jitted step."""

    def __init__(self, name):
        self.name = name
        self.spec = c = CASES[name]
        self.args = [(role, resolve(v), spec) for role, v, spec in c["args"]]
        params = tuple(i for i, (role, _, _) in enumerate(self.args) if role == "p")
        self.argnums = params[0] if len(params) == 1 else params
        # Python values (flags, None) closed over, not passed to jax.jit.
        self.statics = {i: v for i, (role, v, _) in enumerate(self.args)
                        if c.get("static_args") and role == "c"}

    def step(self, value_and_grad):
        """``jax.jit`` of the step: ``value_and_grad(loss)`` on the args."""
        c, statics = self.spec, self.statics
        make = c.get("make_loss") or (lambda *a: c["loss"])
        keep = c.get("call_args")

        def step(*a):
            full = [statics[i] if i in statics else v for i, v in enumerate(a)]
            if keep is not None:
                full = [full[i] for i in keep]
            return value_and_grad(make(*a), argnums=self.argnums, has_aux=c["has_aux"])(
                *full, **c.get("kwargs", {}))
        return jax.jit(step)

    def unplaced(self):
        return [None if i in self.statics else v for i, (_, v, _) in enumerate(self.args)]

    def placed(self, mesh):
        """The args, the batch's placed on ``mesh`` (call under ``jax.set_mesh``)."""
        return [None if i in self.statics
                else jax.device_put(v, NamedSharding(mesh, spec)) if role == "b" else v
                for i, (role, v, spec) in enumerate(self.args)]


@functools.cache
def _case(name):
    return _Case(name)


@functools.cache
def _plain_reference(name):
    """``jax.value_and_grad``'s result, no mesh: the same for both kinds of axes."""
    case = _case(name)
    return case.step(jax.value_and_grad)(*case.unplaced())


def _reference(name, kind):
    """``jax.value_and_grad``'s result; under the mesh for losses that use it."""
    case = _case(name)
    if not case.spec.get("ref_under_mesh"):
        return _plain_reference(name)
    mesh = _mesh(kind)
    with jax.set_mesh(mesh):
        return case.step(jax.value_and_grad)(*case.placed(mesh))


@functools.cache
def _skipped(name, kind, num_skip):
    """``skipreduce_jax.value_and_grad``'s result, the batch placed over "data"."""
    case, mesh = _case(name), _mesh(kind)
    with jax.set_mesh(mesh):
        return jax.block_until_ready(case.step(_skipreduce(num_skip))(*case.placed(mesh)))


def _parts(out, has_aux):
    (value, aux), grads = out if has_aux else ((out[0], None), out[1])
    return {"value": value, "aux": aux, "grads": grads}


def _numpy(a):
    if jax.dtypes.issubdtype(getattr(a, "dtype", np.float32), jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return np.asarray(a)


def _differences(got, want, tol):
    """One line per leaf where ``got`` is not ``want``: its path and max difference."""
    rtol, atol = (BF16_TOL, BF16_TOL) if tol == "bf16" else (RTOL, ATOL)
    bad = []
    for part in want:
        got_tree, want_tree = jax.tree.structure(got[part]), jax.tree.structure(want[part])
        if got_tree != want_tree:
            bad.append(f"{part}: tree structure {got_tree}, want {want_tree}")
            continue
        for (path, g), (_, w) in zip(jax.tree_util.tree_flatten_with_path(got[part])[0],
                                     jax.tree_util.tree_flatten_with_path(want[part])[0]):
            leaf = part + jax.tree_util.keystr(path)
            g, w = _numpy(g), _numpy(w)
            if g.shape != w.shape:
                bad.append(f"{leaf}: shape {g.shape}, want {w.shape}")
                continue
            if g.dtype != w.dtype:
                bad.append(f"{leaf}: dtype {g.dtype}, want {w.dtype}")
            if jnp.issubdtype(w.dtype, jnp.inexact):
                g64, w64 = g.astype(np.float64), w.astype(np.float64)
                same_nans = np.array_equal(np.isnan(g64), np.isnan(w64))
                diff = np.abs(np.nan_to_num(g64 - w64, nan=0.0, posinf=0.0, neginf=0.0))
                if not same_nans or not np.allclose(g64, w64, rtol=rtol, atol=atol,
                                                    equal_nan=True):
                    largest = np.nanmax(np.abs(w64)) if w64.size else 0.0
                    bad.append(f"{leaf}: max abs diff {diff.max():.3g} (largest |want| "
                               f"{largest:.3g})" + ("" if same_nans else ", NaNs differ"))
            elif not np.array_equal(g, w):
                bad.append(f"{leaf}: {int(np.sum(g != w))} of {g.size} values differ")
    return bad


CASE_IDS = [pytest.param(name, kind, id=f"{name}-{kind}")
            for name, c in CASES.items() for kind in c.get("meshes", KINDS)]


@pytest.mark.parametrize("name, kind", CASE_IDS)
def test_num_skip_0_equals_jax_value_and_grad(name, kind):
    has_aux = CASES[name]["has_aux"]
    got = _parts(_skipped(name, kind, 0), has_aux)
    want = _parts(_reference(name, kind), has_aux)
    bad = _differences(got, want, CASES[name].get("tol"))
    assert not bad, f"{name} ({kind} axes) differs from jax.value_and_grad: " + "; ".join(bad)


# Varied losses: aux trees, a scan, two params trees, flax batch stats, a
# similarity over the batch's rows, a key, an LLM block, params second, a
# convolution, a mixture of experts.
SKIPPING = [("label_smoothing", "explicit"), ("masked_lm_take_along", "auto"),
            ("rnn_scan_time", "explicit"), ("gan_two_models", "auto"),
            ("linen_batchnorm_mutable", "explicit"), ("clip_contrastive_rows", "auto"),
            ("ppo_clip_advnorm", "explicit"), ("dropout_bernoulli_key", "auto"),
            ("llm_rmsnorm_rope_swiglu", "explicit"), ("argnums1_tuple_batch_first", "auto"),
            ("cnn_conv_groupnorm_uint8", "explicit"), ("moe_load_balance", "auto")]


@pytest.mark.parametrize("name, kind", [pytest.param(n, k, id=f"{n}-{k}") for n, k in SKIPPING])
def test_skipping_keeps_the_grads_replicated(name, kind):
    mesh = _mesh(kind)
    _, exact = _skipped(name, kind, 0)
    _, grads = _skipped(name, kind, 4)
    sr.assert_replicated(grads, mesh)
    diffs = [float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(e, np.float64))))
             for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(exact))]
    assert max(diffs) > 1e-6, f"{name}: the grads at num_skip=4 are the exact ones"
