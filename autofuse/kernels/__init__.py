"""What the compiled variants share: building CUDA sources, their hosts, the Triton kernels.

``build`` (nvcc into a cache keyed by source, flags and arch), ``cuda_variant`` (ctypes hosts of
``csrc/*.cu`` kernels), ``gemm_space`` (valid configurations of the templated GEMM),
``autograd`` (the fused variants' backward), ``triton/`` (the tensor-core main loop and launch).
"""
