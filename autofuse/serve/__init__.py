"""At run time: the module ``get_module`` returns, and how a call finds its variant.

``runtime`` (the dispatching ``nn.Module``), ``dispatch`` (which table entry serves a call
key), ``table`` (the JSON dispatch table, its keys and locking), ``grad_mode`` (grad-mode calls
that no backward follows), ``tune_on_miss`` (background tunes of keys the table lacks).
"""
