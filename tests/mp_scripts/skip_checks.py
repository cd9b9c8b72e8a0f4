"""SkipReduce across processes: contributor bits, training, hierarchical mode.

Run with ``python -m skipreduce_jax.launch -n P -d D skip_checks.py P D``.
Every check asserts inside (an uncaught exception ends the job with exit
status 1), and each process prints one ``RESULT key=value ...`` line with
digests of what it computed, which the test compares across processes and
with the same computation done in one process:

1. ``bits``: ``skip_psum`` and ``contribution_mask`` over a 1-D ``data``
   mesh of all N = P * D devices, where global device d holds 2**d, for
   every k in [0, N - 1], static and random: each element has exactly N - k
   bits, the sum is the same on every device of every process, and the mask
   names exactly this device's bit.
2. ``params``: a few optax steps with ``skip_reduce`` (50%) and Adam via
   ``replicate`` / ``init_opt_state`` / ``make_train_step`` / ``shard_batch``
   (each process passes only its own rows), then ``assert_replicated`` of the
   params and the optimizer state.
3. With D > 1, ``hier_bits`` / ``traffic``: hierarchical SkipReduce on a
   ``("host", "local")`` mesh whose rows are the processes: whole hosts are
   summed or dropped, P - k hosts per element, the result is the same on
   every device of every process, and the outer axis sends what the
   SkipReduce formula says (read from the compiled HLO).
"""

import math
import os
import sys
import time

from skipreduce_jax.distributed import initialize, process_info

expected_procs, expected_local = int(sys.argv[1]), int(sys.argv[2])
initialize()

import _mp_common as common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import skipreduce_jax as sr  # noqa: E402

start = time.monotonic()
info = process_info()
n = jax.device_count()
assert info.process_count == expected_procs, info
assert info.local_device_count == expected_local, info
assert n == expected_procs * expected_local, n
me = info.process_index
result = {"index": me, "pid": os.getpid()}


def same_on_every_process(local: np.ndarray, what: str) -> None:
    """Asserts that every process holds the same ``local`` array."""
    everyone = multihost_utils.process_allgather(local)
    for p in range(info.process_count):
        np.testing.assert_array_equal(everyone[p], local,
                                      err_msg=f"{what}: process {p} differs")


def own_rows(batch, mesh, axes):
    """Places a global batch, passing ``shard_batch`` only this process's rows.

    The devices of this process must hold one contiguous block of rows
    (checked); afterwards every local shard is checked against the batch.
    """
    size = common.ROWS_PER_DEVICE
    flat = list(mesh.devices.flat)    # the order of shard_batch's row blocks
    blocks = sorted(flat.index(d) for d in jax.local_devices())
    lo, hi = blocks[0], blocks[-1] + 1
    assert blocks == list(range(lo, hi)), blocks
    sharded = sr.shard_batch(tuple(a[lo * size:hi * size] for a in batch),
                             mesh, axes)
    for whole, arr in zip(batch, sharded):
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data),
                                          whole[shard.index])
    return sharded


def train_and_check(mesh, axes, tx) -> tuple[str, list[float]]:
    """Trains, checks that replicas agree everywhere; returns a params digest."""
    params, opt_state, losses = common.train(
        mesh, axes, tx, lambda t: own_rows(common.global_batch(t, n), mesh, axes))
    # Params and the whole state (Adam moments, SkipReduce's step count and
    # key; no error feedback, so nothing per rank) are replicated.
    sr.assert_replicated((params, opt_state), mesh)
    local = common.local_copy(params)     # also: all local copies equal
    for leaf in jax.tree_util.tree_leaves(local):
        same_on_every_process(leaf, "params")
    assert losses[-1] < losses[0], losses
    return common.digest(local), losses


# ---------------------------------------------------------------------------
# 1. Contributor bits over one data axis of all devices.

mesh = jax.make_mesh((n,), ("data",))
values = common.bit_values(n)
x = jax.make_array_from_callback(values.shape, NamedSharding(mesh, P("data")),
                                 lambda idx: values[idx])
sums, masks = common.bit_sums(mesh, x)
cases = common.bit_cases(n)
want_bits = np.array([n - k for k, _ in cases])[:, None]
first = None
for s_shard, m_shard in zip(sums.addressable_shards, masks.addressable_shards):
    r = s_shard.index[0].indices(n)[0]        # global device position
    assert m_shard.index[0].indices(n)[0] == r
    got = np.asarray(s_shard.data)[0].astype(np.int64)   # [cases, size]
    mask = np.asarray(m_shard.data)[0]
    assert np.all(common.popcount(got) == want_bits), r
    np.testing.assert_array_equal((got >> r) & 1, mask.astype(np.int64),
                                  err_msg=f"mask of device {r}")
    if first is None:
        first = got
    np.testing.assert_array_equal(got, first, err_msg=f"device {r}")
same_on_every_process(first, "skip_psum result")
result["bits"] = common.digest(first)

# ---------------------------------------------------------------------------
# 2. Training with skip_reduce: params stay bit-identical everywhere.

result["params"], losses = train_and_check(mesh, "data", common.make_tx())
result["losses"] = ",".join(map(repr, losses))

# ---------------------------------------------------------------------------
# 3. Hierarchical SkipReduce: outer axis = processes, inner = their devices.

hosts, local = info.process_count, info.local_device_count
if local > 1:
    axes = ("host", "local")
    ordered = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.array(ordered).reshape(hosts, local)
    for h in range(hosts):
        assert {d.process_index for d in grid[h]} == {h}, grid
    hmesh = Mesh(grid, axes)
    hvalues = values.reshape(hosts, local, -1)   # device (h, l): 2**(h L + l)
    hx = jax.make_array_from_callback(
        hvalues.shape, NamedSharding(hmesh, P(*axes)), lambda idx: hvalues[idx])
    hsums, hmasks = common.hier_sums(hmesh, hx)
    hcases = common.bit_cases(hosts)
    group = (1 << local) - 1
    hfirst = None
    for s_shard, m_shard in zip(hsums.addressable_shards,
                                hmasks.addressable_shards):
        h = s_shard.index[0].indices(hosts)[0]
        assert h == me, (h, me)                     # this process's row
        got = np.asarray(s_shard.data)[0, 0].astype(np.int64)  # [cases, size]
        mask = np.asarray(m_shard.data)[0, 0]
        per_host = np.stack([(got >> (g * local)) & group for g in range(hosts)])
        assert np.all((per_host == 0) | (per_host == group))  # whole hosts
        for i, (k, _) in enumerate(hcases):
            assert np.all((per_host[:, i] == group).sum(0) == hosts - k), k
            assert np.all(common.popcount(got[i]) == (hosts - k) * local), k
        np.testing.assert_array_equal(mask, per_host[h] == group)
        if hfirst is None:
            hfirst = got
        np.testing.assert_array_equal(got, hfirst)
    same_on_every_process(hfirst, "hierarchical skip_psum result")
    result["hier_bits"] = common.digest(hfirst)

    size = 4096
    spec = jax.ShapeDtypeStruct((hosts, local, size), jnp.float32,
                                sharding=NamedSharding(hmesh, P(*axes)))
    traffic_report = []
    for k in range(hosts):
        f = jax.shard_map(
            lambda v, k=k: sr.skip_psum(v, "host", key=jax.random.key(0),
                                        num_skip=k, inner_axis="local",
                                        chunks_per_rank=4),
            mesh=hmesh, in_specs=P(*axes), out_specs=P())
        traffic = sr.collective_traffic(
            jax.jit(f).lower(spec).compile().as_text())
        # The outer all-gather assembles the 1/L shard, the inner one the
        # whole buffer: with hosts == local only the shape tells them apart.
        outer = traffic.bytes_per_device("collective-permute") + sum(
            op.bytes_per_device for op in traffic.ops
            if op.kind == "all-gather" and op.group_size == hosts
            and math.prod(op.shape) == size // local)
        shard_bytes = size * 4 / local
        want = (2 * (hosts - 1) - k) / hosts * shard_bytes
        assert abs(outer - want) < 1e-6 * shard_bytes, (k, outer, want, traffic)
        # Inner: a reduce-scatter of the buffer and an all-gather back to it
        # (the outer ring sends with collective-permutes only).
        inner = {op.kind for op in traffic.ops if op.group_size == local and (
            op.kind == "reduce-scatter" or (op.kind == "all-gather" and
                                            math.prod(op.shape) == size))}
        assert inner == {"reduce-scatter", "all-gather"}, traffic
        assert traffic.count("all-reduce") == 0, traffic
        traffic_report.append(f"{k}:{outer:g}")
    result["traffic"] = ",".join(traffic_report)

result["seconds"] = f"{time.monotonic() - start:.1f}"
print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()), flush=True)
