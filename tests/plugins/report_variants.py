"""A correct matmul_gelu_softmax variant with a searched parameter, loaded through AUTOFUSE_PLUGINS,
so a CPU tune has a real search history (several configurations, differing times) to report."""

import torch
import torch.nn.functional as F

import autofuse
from autofuse.core.variant import Variant


class RowBlocks(Variant):
    name = "row_blocks"
    problem = "matmul_gelu_softmax"
    kind = "simplified"
    description = "the simplified computation, `rows` rows at a time"

    @classmethod
    def configs(cls, shape, device):
        return [{"rows": r} for r in (4, 1, 2, 8) if r <= max(1, shape["batch_size"])]

    def forward(self, model, x):
        lin, rows = model.linear, self.params["rows"]
        parts = [F.softmax(F.gelu(torch.addmm(lin.bias, x[i:i + rows], lin.weight.t())), dim=1)
                 for i in range(0, x.shape[0], rows)]
        return torch.cat(parts) if parts else x.new_empty(0, lin.out_features)


@autofuse.hookimpl
def autofuse_register_variants():
    return [RowBlocks]
