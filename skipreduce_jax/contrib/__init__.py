"""Other gradient compressions, as drop-in replacements for ``skip_reduce``.

Top-k sparsification with error memory and PowerSGD: the baselines of the
SkipReduce paper. Each is the first element of an ``optax.chain``, takes each
rank's local gradients inside ``jax.shard_map`` and follows the library's
per-rank state protocol, so ``state_specs``, ``init_opt_state`` and
``make_train_step`` work with them unchanged. The ``*_comm_bytes`` functions
give the bytes each device sends per step.
"""

from skipreduce_jax.contrib._common import full_comm_bytes as full_comm_bytes
from skipreduce_jax.contrib._powersgd import PowerSGDState as PowerSGDState
from skipreduce_jax.contrib._powersgd import powersgd_comm_bytes as powersgd_comm_bytes
from skipreduce_jax.contrib._powersgd import powersgd_reduce as powersgd_reduce
from skipreduce_jax.contrib._top_k import TopKState as TopKState
from skipreduce_jax.contrib._top_k import topk_comm_bytes as topk_comm_bytes
from skipreduce_jax.contrib._top_k import topk_reduce as topk_reduce
