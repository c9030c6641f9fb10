"""A variant that prints on every call, to stdout and straight to file descriptor 2, as
Inductor's autotuning and compilers do: the tuning tests check none of it reaches the terminal."""

import os
import sys

import autofuse
from autofuse.core.variant import EagerVariant

MARKER = "NOISY-VARIANT-OUTPUT"


class Noisy(EagerVariant):
    name = "noisy"
    problem = "matmul_gelu_softmax"
    kind = "simplified"
    description = "the reference forward, printing as it goes"
    supports_autograd = False

    def forward(self, model, x):
        print(MARKER, "stdout")
        sys.stdout.flush()
        os.write(2, f"{MARKER} fd2\n".encode())
        return super().forward(model, x)


@autofuse.hookimpl
def autofuse_register_variants():
    return [Noisy]
