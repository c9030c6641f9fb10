"""A CUDA variant of matmul_gelu_softmax whose kernel makes an illegal memory access (loaded
through AUTOFUSE_PLUGINS by a gpu-marked test)."""

import torch

import autofuse
from autofuse.kernels.cuda_variant import CudaVariant


class IllegalAccess(CudaVariant):
    name = "illegal_access"
    problem = "matmul_gelu_softmax"
    kind = "cuda_naive"
    description = "writes through a null pointer"
    source = "csrc/illegal_access.cu"
    launchers = {"af_illegal_access": ("ptr",)}

    def forward(self, model, x):
        out = torch.empty(x.shape[0], model.linear.out_features, device=x.device)
        self.launch("af_illegal_access", out, device=x.device)
        return out


@autofuse.hookimpl
def autofuse_register_variants():
    return [IllegalAccess]
