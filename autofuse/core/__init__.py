"""What a problem and a variant are, how plugins register them, and the precision classes.

``problem`` (reference model, shapes, inputs, tolerances), ``variant`` (one implementation and its
parameters), ``precision`` (ieee, fp32, tf32, bf16 and their math modes), ``plugins`` and
``registry`` (the ``autofuse`` entry-point group, folded into problems and variants by name).
"""
