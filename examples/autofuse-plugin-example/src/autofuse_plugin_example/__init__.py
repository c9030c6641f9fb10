"""An example autofuse plugin: the problem ``matmul_sigmoid_sum`` and the variant
``matmul_gelu_softmax/row_chunked``, both registered through the ``autofuse`` entry-point group."""
