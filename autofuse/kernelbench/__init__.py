"""KernelBench files as problems, and tuned modules exported back as KernelBench files.

``file`` (reads a KernelBench ``Model`` file), ``problem`` (turns one into a Problem),
``export`` (writes a ``ModelNew`` that dispatches through the tuned table).

``autofuse.kernelbench.register_source`` is what exported ``ModelNew`` files call: a stable
name, imported lazily so that reading this package does not import torch.
"""

_FROM_PROBLEM = ("KernelBenchProblem", "load", "register_source")


def __getattr__(name):
    if name in _FROM_PROBLEM:
        from autofuse.kernelbench import problem
        return getattr(problem, name)
    raise AttributeError(f"module 'autofuse.kernelbench' has no attribute {name!r}")
