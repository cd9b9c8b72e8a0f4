"""Other gradient compressions, as drop-in replacements for ``skip_reduce``.

Top-k sparsification with error memory and PowerSGD (the SkipReduce paper's
baselines), and the bytes each device sends per step with them (``*_comm_bytes``).
"""

from skipreduce_jax.contrib._common import full_comm_bytes as full_comm_bytes
from skipreduce_jax.contrib._powersgd import PowerSGDState as PowerSGDState
from skipreduce_jax.contrib._powersgd import powersgd_comm_bytes as powersgd_comm_bytes
from skipreduce_jax.contrib._powersgd import powersgd_reduce as powersgd_reduce
from skipreduce_jax.contrib._top_k import TopKState as TopKState
from skipreduce_jax.contrib._top_k import topk_comm_bytes as topk_comm_bytes
from skipreduce_jax.contrib._top_k import topk_reduce as topk_reduce
