"""Launch policy as data: the launch-shape records and the per-device tables the GPU op families pick them from.

    shapes.py     GemvConfig, MmaConfig, GemmConfig, GemmQConfig: the records the tables hold
    gemv.py       the SIMT and tensor-core GEMV tables and thresholds (read by realizar.gpu.gemv)
    gemm.py       the f16 GEMM's tiles and the quantized GEMM's thresholds (read by realizar.gpu.gemm)
    dequant.py    the f16 dequantization's CTA widths (read by realizar.gpu.dequant)
    sampling.py   the argmax and per-row sampling launch constants (read by realizar.gpu.argmax / sampling)

No code here chooses anything: the dispatch code beside each op's host calls reads these tables. No
measurements either: the figures behind each pick, and the sweeps they come from, are in
docs/performance.md and docs/results/.
"""
