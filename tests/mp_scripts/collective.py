"""Multi-process check: device counts, a ppermute ring shift and a psum.

Run with ``python -m skipreduce_jax.launch -n P -d D collective.py P D [IFACE]``.
Asserts inside (exit code 1 on a wrong value) and prints one ``RESULT`` line
per process for the test to parse.
"""

import sys

from skipreduce_jax.distributed import gloo_interface_in_use, initialize, process_info

expected_procs, expected_local = int(sys.argv[1]), int(sys.argv[2])
interface = sys.argv[3] if len(sys.argv) > 3 else None
initialize(gloo_interface=interface)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

info = process_info()
n = jax.device_count()
assert info.process_count == expected_procs, info
assert info.local_device_count == expected_local, info
assert n == expected_procs * expected_local, n

mesh = jax.make_mesh((n,), ("data",))
sharding = NamedSharding(mesh, P("data"))
# x[j] = j (global device position); w = process index + 1 on every local device.
x = jax.make_array_from_callback((n,), sharding, lambda idx: np.arange(n, dtype=np.int32)[idx])
w = jax.make_array_from_process_local_data(
    sharding, np.full((info.local_device_count,), info.process_index + 1, np.int32)
)


def body(x, w):
    shifted = lax.ppermute(x, "data", perm=[(i, (i + 1) % n) for i in range(n)])
    return shifted, lax.psum(w, "data")


shifted, total = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P("data"), P()))
)(x, w)

expected_total = expected_local * expected_procs * (expected_procs + 1) // 2
for shard in shifted.addressable_shards:
    j = shard.index[0].indices(n)[0]  # start of this shard
    got = int(np.asarray(shard.data)[0])
    assert got == (j - 1) % n, (j, got)
got_total = int(np.asarray(total.addressable_shards[0].data)[0])
assert got_total == expected_total, (got_total, expected_total)
local = sorted(int(np.asarray(s.data)[0]) for s in shifted.addressable_shards)
print(
    f"RESULT index={info.process_index} count={info.process_count} devices={n} "
    f"local={info.local_device_count} shifted={','.join(map(str, local))} psum={got_total} "
    f"gloo={gloo_interface_in_use()}"
)

if interface is not None:
    # The local addresses of this process's gloo TCP connections (all but the
    # coordinator's), to check that gloo bound to the interface's address.
    import os

    try:
        import psutil
    except ImportError:
        sys.exit(0)

    coordinator_port = int(os.environ["SKIPREDUCE_COORDINATOR"].rsplit(":", 1)[1])
    addresses = sorted(
        {
            c.laddr.ip
            for c in psutil.Process().net_connections(kind="tcp")
            if c.raddr and coordinator_port not in (c.laddr.port, c.raddr.port)
        }
    )
    print(f"GLOO_ADDRESSES index={info.process_index} {','.join(addresses)}")
