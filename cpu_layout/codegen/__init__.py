"""Code generation: the expression IR for fused elementwise bodies and the OpenMP C++ kernels."""
from cpu_layout.codegen.expr import Const, Load, Op, OPS, loads
from cpu_layout.codegen.cpp_kernels import PointwiseKernel, ReductionKernel

__all__ = ["Const", "Load", "Op", "OPS", "loads", "PointwiseKernel", "ReductionKernel"]
