"""Tensor parallelism: sharding plans (:mod:`.sharding`), the sharded NumPy forward that is their oracle
(:mod:`.reference`), the NCCL binding (:mod:`.nccl`) and the split GPU model over NCCL or, for tests on
one device, a local reducer (:mod:`.gpu`, imported on demand: it needs the GPU runtime)."""

from realizar.parallel.sharding import ShardingPlan, TensorSplit, check_world_size, make_plan

__all__ = ["ShardingPlan", "TensorSplit", "check_tensor_parallel", "check_world_size", "make_plan", "visible_gpu_count"]


def visible_gpu_count() -> int:
    """CUDA devices this process can see (``CUDA_VISIBLE_DEVICES`` applies); 0 without a driver or GPU."""
    from realizar.cuda import driver

    if driver.unavailable_reason() is not None:
        return 0
    return int(driver.call("cuDeviceGetCount"))


def check_tensor_parallel(loaded, world_size: int, device: str = "auto") -> ShardingPlan:
    """The sharding plan of ``loaded`` (a :class:`~realizar.models.loaded.LoadedModel`) over
    ``world_size`` GPUs, after checking what tensor parallelism needs here, in this order: a GPU device,
    a model that splits over ``world_size`` (heads, GQA groups, FFN, whole quantized blocks), and
    ``world_size`` visible GPUs. Raises :class:`~realizar.errors.TensorParallelError` (one line) when
    one is missing."""
    from realizar.errors import ShapeError, TensorParallelError

    n = world_size
    if device not in ("auto", "cuda"):
        raise TensorParallelError(f"tensor parallelism over {n} GPUs runs on GPUs, not on device {device!r}")
    try:
        plan = make_plan(loaded.config, loaded.tensors, n)
    except ShapeError as e:
        raise TensorParallelError(f"tensor parallelism over {n} GPUs: {e}") from e
    count = visible_gpu_count()
    if count < n:
        raise TensorParallelError(
            f"tensor parallelism over {n} GPUs needs {n} visible GPUs; this machine has {count}"
        )
    return plan
