"""Tensor maps for ``cp.async.bulk.tensor`` (sm_90): the 128 bytes a kernel takes by value (a ``tmap`` parameter).

On a GPU the driver encodes them (``cuTensorMapEncodeTiled``); on the emulated device the emulator's own encoding
(:mod:`ptx_gen.emulator.tensormap`) stands in, with the same checks of the forms the kernels use. Encoding reads
nothing on the device and allocates nothing, so it may run while a stream is captured.
"""

from __future__ import annotations

import struct

from ptx_gen.emulator import tensormap as emulated
from realizar.errors import ShapeError

__all__ = ["f16_tiles_2d"]


def f16_tiles_2d(device, ptr: int, cols: int, rows: int, row_stride: int, box_cols: int, box_rows: int) -> bytes:
    """The map of ``rows`` rows of ``cols`` f16 values at device address ``ptr`` (``row_stride`` bytes apart),
    copied as boxes of ``box_rows`` x ``box_cols`` (128-byte box rows: ``box_cols`` = 64) that land with the
    128-byte swizzle; values outside the tensor land as zeros."""
    spec = emulated.TensorMap2d(int(ptr), int(cols), int(rows), int(row_stride), int(box_cols), int(box_rows), 2, 128)
    try:
        emulated.check(spec)
    except ValueError as exc:
        raise ShapeError(str(exc)) from None
    if getattr(device, "emulated", False):
        return emulated.encode(spec)
    from cuda.bindings import driver as drv

    from realizar.cuda.driver import call

    u32, u64 = drv.cuuint32_t, drv.cuuint64_t
    tmap = call("cuTensorMapEncodeTiled", drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, int(ptr),
                [u64(cols), u64(rows)], [u64(row_stride)], [u32(box_cols), u32(box_rows)], [u32(1), u32(1)],
                drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    return struct.pack("<16Q", *(int(v) for v in tmap.opaque))
