"""INT8: PyTorch's quantized (PT2E) graphs on cpu_layout's oneDNN int8 kernels.

`rewrite` (rewrite.py) turns a converted graph's dequantize -> conv -> quantize
patterns into `QConv` calls (ops.py, over csrc/qconv.cpp) before lowering.
"""
from cpu_layout.quant.rewrite import rewrite

__all__ = ["rewrite"]
