"""SkipReduce for JAX: a gradient all-reduce that skips part of the ring.

Collectives (call inside ``jax.shard_map``): :func:`ring_psum`,
:func:`skip_psum`, :func:`skip_pmean` (and :func:`skip_pmean_and_left_out`,
for error feedback), :func:`contribution_mask`.
Optax: :func:`skip_reduce` (AdamW on it: :func:`skip_adamw`). Training
loops: :func:`make_train_step` and friends; your own step: :func:`data_parallel` (flax NNX:
``skipreduce_jax.nnx``); inside your own ``jax.jit`` step, in place of
``jax.value_and_grad``: :func:`value_and_grad` (with :func:`mean_count`).
Multi-process: :func:`initialize`,
``python -m skipreduce_jax.launch``.
Cost model: ``python -m skipreduce_jax.cost``. Checkpoints:
``skipreduce_jax.checkpoint`` (``save``/``restore``; needs orbax-checkpoint).
"""

from skipreduce_jax._optax.adamw import skip_adamw as skip_adamw
from skipreduce_jax._optax.gate import FeedbackGateState as FeedbackGateState
from skipreduce_jax._optax.guards import assert_replicated as assert_replicated
from skipreduce_jax._optax.guards import check_replicated as check_replicated
from skipreduce_jax._optax.guards import leaf_agreement as leaf_agreement
from skipreduce_jax._optax.multisteps import MultiSteps as MultiSteps
from skipreduce_jax._optax.norms import BatchNormWarning as BatchNormWarning
from skipreduce_jax._optax.stats import CommStats as CommStats
from skipreduce_jax._optax.stats import comm_stats as comm_stats
from skipreduce_jax._optax.transform import NothingSkippedWarning as NothingSkippedWarning
from skipreduce_jax._optax.transform import SkipConfig as SkipConfig
from skipreduce_jax._optax.transform import SkipReduceState as SkipReduceState
from skipreduce_jax._optax.transform import skip_reduce as skip_reduce
from skipreduce_jax._ring.buckets import DEFAULT_BUCKET_BYTES as DEFAULT_BUCKET_BYTES
from skipreduce_jax._ring.collectives import contribution_mask as contribution_mask
from skipreduce_jax._ring.collectives import ring_psum as ring_psum
from skipreduce_jax._ring.collectives import scatter_contribution_mask as scatter_contribution_mask
from skipreduce_jax._ring.collectives import skip_pmean as skip_pmean
from skipreduce_jax._ring.collectives import skip_pmean_and_left_out as skip_pmean_and_left_out
from skipreduce_jax._ring.collectives import skip_psum as skip_psum
from skipreduce_jax._ring.collectives import skip_psum_scatter as skip_psum_scatter
from skipreduce_jax._ring.config import CollectiveOptions as CollectiveOptions
from skipreduce_jax._ring.config import RingOptions as RingOptions
from skipreduce_jax._ring.config import SkipOptions as SkipOptions
from skipreduce_jax._ring.schedule import ScatterSchedule as ScatterSchedule
from skipreduce_jax._ring.schedule import SkipSchedule as SkipSchedule
from skipreduce_jax._ring.schedule import balanced_draw as balanced_draw
from skipreduce_jax._ring.schedule import make_scatter_schedule as make_scatter_schedule
from skipreduce_jax._ring.schedule import make_schedule as make_schedule
from skipreduce_jax._ring.schedule import ring_period as ring_period
from skipreduce_jax._ring.schedule import scatter_period as scatter_period
from skipreduce_jax._ring.selection import UnmatchedPatternWarning as UnmatchedPatternWarning
from skipreduce_jax._ring.selection import by_path as by_path
from skipreduce_jax._ring.selection import exclude as exclude
from skipreduce_jax._runtime.hlo import CollectiveOp as CollectiveOp
from skipreduce_jax._runtime.hlo import Traffic as Traffic
from skipreduce_jax._runtime.hlo import collective_traffic as collective_traffic
from skipreduce_jax._steps.count import mean_count as mean_count
from skipreduce_jax._steps.grad import CheckSkippedWarning as CheckSkippedWarning
from skipreduce_jax._steps.grad import value_and_grad as value_and_grad
from skipreduce_jax._steps.parallel import PerRank as PerRank
from skipreduce_jax._steps.parallel import data_parallel as data_parallel
from skipreduce_jax._steps.parallel import rank_key as rank_key
from skipreduce_jax._steps.partition import PartitionReport as PartitionReport
from skipreduce_jax._steps.training import check_settings_agree as check_settings_agree
from skipreduce_jax._steps.training import init_opt_state as init_opt_state
from skipreduce_jax._steps.training import local_grad as local_grad
from skipreduce_jax._steps.training import local_value_and_grad as local_value_and_grad
from skipreduce_jax._steps.training import make_train_step as make_train_step
from skipreduce_jax._steps.training import replicate as replicate
from skipreduce_jax._steps.training import shard_batch as shard_batch
from skipreduce_jax._steps.training import shard_params as shard_params
from skipreduce_jax._steps.training import state_specs as state_specs
from skipreduce_jax._steps.training import to_varying as to_varying
from skipreduce_jax.distributed import initialize as initialize
from skipreduce_jax.distributed import process_info as process_info

__version__ = "0.4.0"
