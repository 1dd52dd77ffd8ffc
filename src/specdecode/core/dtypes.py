"""The dtype names every command accepts (no torch import: argument parsers read this)."""

FLOAT_DTYPES = ("float32", "bfloat16")
QUANT_DTYPES = ("int8", "int4", "w8a8", "w4a8")  # quantized matrices (models/quant.py)
DTYPE_CHOICES = ("auto",) + FLOAT_DTYPES + QUANT_DTYPES  # auto: models.loading.auto_dtype
DTYPE_HELP = "auto (default): w4a8 for a quantized GGUF where this CPU runs the int8dot kernels, else float32"
