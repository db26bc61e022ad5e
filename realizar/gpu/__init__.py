"""The GPU layer: host code that launches the catalog's kernels on a device.

    dispatch.py    Dispatcher: kernel memo, launch configuration from kernel hints, argument cache,
                   operand/integer checks, device allocations, the one call to ``cuda.launch``
    weights.py     GpuWeight: GGUF weights on the device, rows or tile-major
    policy/        launch tables as data (GEMV, GEMM, dequant, sampling)
    gemv.py gemm.py dequant.py   GEMV / gate-up GEMV / columns, f16 GEMM and gemm_q, dequantization
    norms.py rope.py elementwise.py embedding.py argmax.py sampling.py   one op family each
    ops.py         LayerOps: every op family on one dispatcher
    decoder.py     the layer program and the head, once (DecoderWeights, Activations, Decoder)
    linear.py      the Linear seam: the kernel by row count
    attention.py   the Attention seam: decode rows and prefill chunks over the paged cache
    paged_kv.py    PagedKVCache: the KV cache of every inference path
    batch.py       GpuBatchBackend: the one GPU inference path (batches; a single sequence is its batch of one)
    prefill.py     Prefill: a prompt chunk through the program
    model.py       GpuModel: a single sequence, the Generator API, one CUDA graph per token
    executor.py               CudaExecutor: NumPy-in/NumPy-out kernel experiments over the paged cache

Dependencies point down: model -> batch -> decoder -> linear/attention/ops -> dispatch -> realizar.cuda;
ptx_gen supplies kernels.
"""
