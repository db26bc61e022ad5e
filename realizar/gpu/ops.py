"""LayerOps: every transformer-layer op family on one device, sharing one dispatcher.

    ops = LayerOps()                                   # per device: kernel memo + argument cache
    w = ops.upload(tensor)                              # a QuantTensor's raw blocks, uploaded once, laid
                                                        # out for the GEMV that will read them
    ops.gemv(w, x_buf, y_buf, residual=h_buf)           # y = W x + h  (y may be h: in place)
    ops.rmsnorm(h_buf, norm_w_buf, y_buf, eps=1e-5)
    ops.rope(q_buf, k_buf, inv_freq_buf, pos_buf, n_q=32, n_kv=8, head_dim=128)
    ops.argmax(logits_buf, out_u32_buf)

Every call validates its arguments (sizes, dtypes, 16-byte alignment) before the GPU is touched and
raises :class:`~realizar.errors.ShapeError` saying what was expected. Buffers are
:class:`~realizar.cuda.GpuBuffer` s or ``(GpuBuffer, element offset)`` pairs. Launch shapes depend
only on the model's dimensions, kernel arguments are packed once per distinct call and reused, and
nothing synchronises or allocates per call, so a decode step made of these calls can be captured into
a CUDA graph and replayed; positions and token ids that change per step are read from device buffers.
"""

from __future__ import annotations

from realizar.gpu.argmax import ArgmaxOps
from realizar.gpu.dequant import DequantOps
from realizar.gpu.elementwise import ElementwiseOps
from realizar.gpu.embedding import EmbeddingOps
from realizar.gpu.gemm import GemmConfig, GemmOps, gemm_config
from realizar.gpu.gemm_wg import GemmWgOps
from realizar.gpu.moe import MoeOps
from realizar.gpu.gemm_x8 import GemmX8Ops
from realizar.gpu.gemv import GemvConfig, GemvOps, MmaConfig, gemv_config, mma_config
from realizar.gpu.norms import NormOps
from realizar.gpu.rope import RopeOps, inv_freq_table
from realizar.gpu.sampling import SampleOps
from realizar.gpu.weights import GpuWeight

__all__ = ["GemmConfig", "GemvConfig", "GpuWeight", "LayerOps", "MmaConfig", "gemv_config", "inv_freq_table", "gemm_config", "mma_config"]


class LayerOps(GemvOps, GemmOps, GemmX8Ops, GemmWgOps, MoeOps, DequantOps, NormOps, RopeOps, ElementwiseOps, EmbeddingOps, ArgmaxOps, SampleOps):
    """Launches the layer kernels on one device (kernels loaded once, arguments packed once)."""
