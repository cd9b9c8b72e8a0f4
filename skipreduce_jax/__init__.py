"""SkipReduce for JAX: a gradient all-reduce that skips part of the ring."""

from skipreduce_jax._buckets import DEFAULT_BUCKET_BYTES as DEFAULT_BUCKET_BYTES
from skipreduce_jax._collectives import contribution_mask as contribution_mask
from skipreduce_jax._collectives import ring_psum as ring_psum
from skipreduce_jax._collectives import skip_pmean as skip_pmean
from skipreduce_jax._collectives import skip_psum as skip_psum
from skipreduce_jax._hlo import CollectiveOp as CollectiveOp
from skipreduce_jax._hlo import Traffic as Traffic
from skipreduce_jax._hlo import collective_traffic as collective_traffic
from skipreduce_jax._schedule import SkipSchedule as SkipSchedule
from skipreduce_jax._schedule import make_schedule as make_schedule

__version__ = "0.1.0"
