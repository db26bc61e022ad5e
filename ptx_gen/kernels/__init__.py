"""Kernel generators; each module registers its kernels in :mod:`ptx_gen.catalog`."""
