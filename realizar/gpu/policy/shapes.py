"""The launch-shape records the policy tables hold and the dispatchers pass to the kernel catalog."""

from __future__ import annotations

from dataclasses import dataclass

from ptx_gen.kernels.gemm.gemm_mma import check_tiling, smem_bytes
from realizar.errors import ShapeError

__all__ = ["GemmConfig", "GemmQConfig", "GemvConfig", "MmaConfig", "WgConfig", "X8Config"]


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape of the SIMT GEMV (:mod:`ptx_gen.kernels.gemv`)."""

    rows: int  # output rows per warp (weight rows per warp for the fused gate/up GEMV)
    warps: int  # warps per CTA
    ksplit: int = 1  # warps sharing a row group, each summing one K slice (divides warps)


@dataclass(frozen=True)
class MmaConfig:
    """Launch shape of the tensor-core GEMV (:mod:`ptx_gen.kernels.gemv_mma`)."""

    mtiles: int  # warps along the rows of a CTA
    kparts: int  # warps sharing those rows, each one part of K
    stages: int  # cp.async ring depth per warp (units of 256 values)
    tiles: int = 1  # 16-row MMA tiles per warp
    bulk: bool = False  # sm_90: fill the ring with bulk copies (cp.async.bulk + mbarrier)
    solo: bool = False  # shared memory raised so that one CTA holds an SM (see gemv_mma.SOLO_SMEM)
    late: bool = False  # the next kernel's launch triggered near the end (after the warps' last copies)
    l2pre: int = 0  # tile-major, sm_90: each warp's next units past its ring asked of the L2 before the grid wait
    ahead: int = 0  # ring stages requested before the grid wait (0: all), the others right after x's first loads


@dataclass(frozen=True)
class GemmConfig:
    """A CTA tile ``bm x bn`` (tokens x weight rows) on ``warps_m x warps_n`` warps, ``stages`` K tiles
    of 64 in flight."""

    bm: int = 128
    bn: int = 128
    warps_m: int = 2
    warps_n: int = 2
    stages: int = 3

    def __post_init__(self) -> None:
        try:
            check_tiling(self.bm, self.bn, self.warps_m, self.warps_n, self.stages)
        except ValueError as exc:
            raise ShapeError(f"GemmConfig: {exc}") from None

    @property
    def smem(self) -> int:
        return smem_bytes(self.bm, self.bn, self.stages)

    def ctas(self, m: int, n: int) -> int:
        return -(-m // self.bm) * -(-n // self.bn)


@dataclass(frozen=True)
class GemmQConfig:
    """Launch shape of :mod:`ptx_gen.kernels.gemm_q`: ``mt`` tokens per launch (8..128), ``warps`` row strips
    (16 weight rows each) per CTA, ``kparts`` warps per strip splitting K, ``stages`` chunks in flight."""

    mt: int
    warps: int = 4
    kparts: int = 1
    stages: int = 4


@dataclass(frozen=True)
class X8Config:
    """Launch shape of the int8 batch GEMM (:mod:`ptx_gen.kernels.gemm.gemm_x8`): ``wn`` x ``wm`` warps, each
    a 32-row weight tile and ``tn`` tiles of 8 tokens, a ring of ``stages`` units of 256 values."""

    wn: int
    wm: int
    tn: int
    stages: int

    @property
    def tokens(self) -> int:
        return 8 * self.wm * self.tn


@dataclass(frozen=True)
class WgConfig:
    """Launch shape of the warpgroup-MMA GEMM (:mod:`ptx_gen.kernels.gemm.gemm_wg`): ``mt`` tokens per CTA,
    ``rgroups`` 64-row warpgroups side by side, ``kparts`` warpgroups splitting K, ``stages`` weight chunks
    of 256 values in each warp's ring, ``unroll`` 32-value blocks decoded per MMA group."""

    mt: int
    rgroups: int = 1
    kparts: int = 1
    stages: int = 2
    unroll: int = 2


@dataclass(frozen=True)
class WsConfig:
    """Launch shape of the warp-specialized GEMM (:mod:`ptx_gen.kernels.gemm.gemm_ws`): ``mt`` tokens per CTA,
    ``rgroups`` consumer warpgroups of 64 rows (as many producer warpgroups; one for two on 256-token tiles), ``stages``
    64-k stages in the A / B ring, ``wstages`` weight chunks of 256 values in each of a producer warp's rings, ``xtma``:
    the tokens' X by a tensor map (one bulk copy a stage) instead of the consumers' 16-byte copies, ``f16dec``: Q4_K
    weights decoded in f16x2 arithmetic, ``kparts``: CTAs splitting K (grid z, summed through a workspace), ``psplit``:
    producer warpgroups a strip, each filling every ``psplit``-th stage, ``pfence``: stages a producer fences and
    announces together, ``xcast``: CTAs of a cluster (along the weight rows) sharing each token tile's X by multicast;
    ``ablate`` (diagnostic launches, never the policy's): the parts of the work left out (gemm_ws's ``ABLATIONS``);
    ``streamk``: the tiles' chunks of K shared out evenly over at most an SM's worth of CTAs (a tile split between two
    summed through a workspace)."""

    mt: int
    rgroups: int = 1
    stages: int = 4
    wstages: int = 2
    xtma: bool = False
    f16dec: bool = False
    kparts: int = 1
    psplit: int = 1
    pfence: int = 1
    xcast: int = 1
    ablate: str = ""
    streamk: bool = False
