"""A variant right at every batch but 1, loaded through AUTOFUSE_PLUGINS: a tune's batch classes must
gate it at batch 1 and keep it from serving there (tests/test_batch_classes.py).

It ranks below eager (``complexity`` -1), so wherever it passes the gate it wins the choice.
"""

import torch.nn.functional as F

import autofuse
from autofuse.core.variant import Variant


class WrongAtBatchOne(Variant):
    name = "wrong_at_batch_one"
    problem = "matmul_gelu_softmax"
    kind = "eager"
    complexity = -1
    description = "matmul_gelu_softmax, 1% off where the batch is 1 (a GEMV path gone wrong)"

    def forward(self, model, x):
        out = F.softmax(F.gelu(model.linear(x)), dim=1)
        return out * 1.01 if x.shape[0] == 1 else out


@autofuse.hookimpl
def autofuse_register_variants():
    return [WrongAtBatchOne]
