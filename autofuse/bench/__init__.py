"""`autofuse bench`: eager, torch.compile, every tuned variant and the floor, side by side.

``run`` (measures), ``report`` (tables and JSON), ``targets`` (the ratios each key should meet).
"""
