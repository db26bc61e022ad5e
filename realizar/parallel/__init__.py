"""Tensor parallelism: sharding plans (:mod:`.sharding`), the sharded NumPy forward that is their oracle
(:mod:`.reference`) and the NCCL binding (:mod:`.nccl`). The multi-GPU model is not built yet."""

from realizar.parallel.sharding import ShardingPlan, TensorSplit, check_world_size, make_plan

__all__ = ["ShardingPlan", "TensorSplit", "check_world_size", "make_plan"]
