"""ptx_gen: a pure-Python PTX emitter and a catalog of kernels generated per shape."""

from ptx_gen.builder import KernelBuilder, Module, Reg, Var
from ptx_gen.catalog import PtxKernel, emit, kernel, names, spec
from ptx_gen.target import SUPPORTED_TARGETS, Target

__all__ = ["KernelBuilder", "Module", "Reg", "Var", "PtxKernel", "emit", "kernel", "names", "spec",
           "SUPPORTED_TARGETS", "Target"]
