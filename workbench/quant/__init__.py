"""The quantization layer: weight / activation quantizers as transformations of the plain model.

A place ready for that layer (see the open issue "Quantization layer"): it sits beside
``transforms``, below ``engine``.
"""

__all__: list[str] = []
