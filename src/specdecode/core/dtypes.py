"""The dtype names every command accepts (no torch import: argument parsers read this)."""

FLOAT_DTYPES = ("float32", "bfloat16")
QUANT_DTYPES = ("int8", "int4", "w8a8")  # weight-only matrices on torch's CPU kernels (models/quant.py)
DTYPE_CHOICES = FLOAT_DTYPES + QUANT_DTYPES
