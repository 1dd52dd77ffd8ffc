"""The dtype names every command accepts (no torch import: argument parsers read this)."""

FLOAT_DTYPES = ("float32", "bfloat16")
# quantized matrices (models/quant.py); w4a8-lossy: every matrix in 4 bits, for drafts
QUANT_DTYPES = ("int8", "int4", "w8a8", "w4a8", "w4a8-lossy")
DTYPE_CHOICES = ("auto",) + FLOAT_DTYPES + QUANT_DTYPES  # auto: models.loading.auto_dtype


def draft_default(dtype: str) -> str:
    """A draft's dtype when only its target's is given: the same, but w4a8 as w4a8-lossy. A
    draft's error costs acceptance, never exactness, and reading 4 bits where the file had 5 to
    8 made the Qwen 0.5B's step 0.73x as long for 1 point of acceptance (BENCHMARKS.md)."""
    return "w4a8-lossy" if dtype == "w4a8" else dtype


DRAFT_DTYPE_HELP = "a --draft model's (default: --dtype, with w4a8 as w4a8-lossy: every matrix in 4 bits)"
DTYPE_HELP = "auto (default): w4a8 for a quantized GGUF where this CPU runs the int8dot kernels, else float32"
