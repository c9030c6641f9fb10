"""Triton tensor-core GEMMs with the epilogue inside the kernel.

``gemm`` (the persistent main loop and operand splits), ``host`` (operands and grids),
``launch`` (a lean launcher for compiled kernels), ``variant`` (the ``triton`` variant base
class), ``backward`` (its gradient GEMMs).
"""
