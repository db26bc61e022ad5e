"""A CPU emulator of the PTX that ``ptx_gen`` emits, so kernels can be run and checked without a GPU.

It runs every thread of a launch as a lane of NumPy arrays (SIMT with per-thread program counters;
the threads at the lowest program counter step together, which reconverges structured branches; threads
whose ``mbarrier.try_wait`` fails step again once some mbarrier phase completes, so warp-specialized
producers and consumers take turns, and a launch where every live thread waits is reported as a deadlock).
Hopper's ``wgmma`` runs when issued (:mod:`ptx_gen.emulator.wgmma`).
It checks what compute-sanitizer would on a GPU, at the level of the emulated semantics:

* memcheck: every global access must lie inside one allocation and be aligned to its size; every
  shared access inside the block's shared memory;
* barriers: a ``bar.sync`` must be reached by every live thread of the block at the same instruction (a
  named ``bar.sync id, count`` by ``count`` threads at once);
  a full-mask ``shfl.sync`` by all 32 lanes of the warp;
* racecheck: between two barriers, a shared byte written by one thread and read or written by
  another is a hazard (reported with the instruction);
* reads of registers never written.

Floating point follows IEEE f32 (fma rounded once via float64, ``ex2.approx`` as float32 exp2), so
results match a GPU to a few ulps, not bit for bit. Only the instruction forms our kernels use are
implemented (the table in :mod:`ptx_gen.emulator.instructions`); anything else raises
``EmulatorError`` naming it.

    mem = Memory()
    a = mem.alloc_array(np.arange(8, dtype=np.float32))
    run(ptx, grid=(1,), block=(32,), params={"x": a, "n": 8}, memory=mem)

:func:`run_example` runs a catalog kernel on random inputs built by :mod:`ptx_gen.emulator.examples`.
"""

from ptx_gen.emulator.machine import run
from ptx_gen.emulator.memory import EmulatorError, Memory

__all__ = ["EmulatorError", "Memory", "run", "run_example"]


def run_example(name: str, shape: dict | None = None, target: str = "sm_90", seed: int = 0):
    """Run catalog kernel ``name`` on random inputs (see :mod:`ptx_gen.emulator.examples`)."""
    from ptx_gen.emulator.examples import run_example as _run

    return _run(name, shape or {}, target=target, seed=seed)
