"""A CPU variant of matmul_gelu_softmax with a search space, for the distributed-tuning tests.

``knobs`` computes the reference forward whatever its configuration ``k`` (eight of them);
its build takes AUTOFUSE_TEST_BUILD_S seconds (default 0.5), as a kernel's compile would, so
that processes tuning one study at once overlap.
"""

import os
import time

import autofuse
from autofuse.core.variant import EagerVariant


class Knobs(EagerVariant):
    name = "knobs"
    problem = "matmul_gelu_softmax"
    kind = "simplified"
    description = "the reference forward behind a knob k in 0..7 that changes nothing"
    supports_autograd = False

    @classmethod
    def configs(cls, shape, device):
        return [{"k": k} for k in range(8)]

    def build(self, device):
        time.sleep(float(os.environ.get("AUTOFUSE_TEST_BUILD_S", "0.5")))


@autofuse.hookimpl
def autofuse_register_variants():
    return [Knobs]
