"""The GPU layer: host code that launches the catalog's kernels on a device.

    dispatch.py    Dispatcher: kernel memo, launch configuration from kernel hints, argument cache,
                   operand/integer checks, device allocations, the one call to ``cuda.launch``
    weights.py     GpuWeight: GGUF weights on the device, rows or tile-major
    gemv.py        GEMV / gate-up GEMV / GEMM launches with their policy (gemv_config, mma_config,
                   the weight layout choice)
    norms.py rope.py elementwise.py embedding.py argmax.py   one op family each
    ops.py         LayerOps: every op family on one dispatcher
    kv_cache.py    KVCache: the KV cache layout, its appends and the attention reads
    executor.py    CudaExecutor: NumPy-in/NumPy-out attention experiments over a KVCache
    model.py       GpuModel: the decoder, one CUDA graph per token (captured or built manually)

Dependencies point down: model -> ops/kv_cache -> dispatch -> realizar.cuda; ptx_gen supplies kernels.
"""
