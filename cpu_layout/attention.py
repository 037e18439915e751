"""Attention: torch's fused CPU attention as one node of the graph.

`scaled_dot_product_attention` reaches the backend as
`_scaled_dot_product_flash_attention_for_cpu` (torch's flash attention for CPUs,
tiled over keys with fp32 accumulation): the attention of transformers' models
(BERT, GPT-2, T5, BART, Llama with its default "sdpa"). Its second result (the log-sum-exp a backward
needs) is unused in inference, so the call lowers to `flash_attention`, one
tensor out, that runs in C++ segments through libtorch's C shim (instruction
SDPA): the same kernel eager runs, without leaving the segment. Its output
strides are torch's ([B, L, H, E] storage viewed as [B, H, L, E]), its inputs
are read as eager has them (rule EAGER).
"""
from __future__ import annotations

import operator

import torch

from cpu_layout import ir, op_table as T
from cpu_layout.patterns import FLOAT, Picked

aten = torch.ops.aten
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default


def flash_attention(q, k, v, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    """torch's CPU flash attention, its output only (the runner of the lowered node)."""
    return FLASH(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def lower(lw, n: torch.fx.Node):
    """The flash-attention call whose log-sum-exp nothing reads: one `flash_attention`
    node (EAGER: torch's own kernel, on inputs as eager has them); else as it is."""
    users = list(n.users)
    if (not users or any(u.target is not operator.getitem or u.args[1] != 0 for u in users)
            or set(n.kwargs) - {"attn_mask", "scale"}):
        return lw._aten(n, ir.EAGER)
    a = list(n.args) + [0.0, False][len(n.args) - 3:]
    q, k, v, dropout_p, is_causal = (lw._arg(x) for x in a[:5])
    args = (q, k, v, dropout_p, is_causal, lw._arg(n.kwargs.get("attn_mask")), n.kwargs.get("scale"))
    out = lw._aten(n, ir.EAGER, target=flash_attention, args=args, kwargs={})
    lw.g.nodes[-1].multi = False
    val = lw._val(n)[0]
    out.size, out.dtype, out.eager_stride = tuple(val.shape), val.dtype, tuple(val.stride())
    return Picked({0: out})


def _in_cpp(n: ir.Aten) -> bool:
    q, k, v, dropout_p, is_causal, mask, scale = n.args  # as `lower` made them
    return (all(isinstance(t, ir.Buffer) and t.dtype in FLOAT and t.dtype == q.dtype for t in (q, k, v))
            and n.out.dtype == q.dtype and dropout_p == 0 and type(is_causal) is bool
            and (mask is None or (isinstance(mask, ir.Buffer) and mask.dtype == q.dtype))
            and (scale is None or type(scale) in (int, float)))


def _encode(em, n: ir.Aten, slot_of) -> None:
    q, k, v, _, is_causal, mask, scale = n.args
    regs = [em.read(n, b) for b in (q, k, v)]
    m = em.read(n, mask) if mask is not None else -1
    s = em.p.real(scale) if scale is not None else -1
    em.p.op("SDPA", em.out_reg(n), *regs, m, int(is_causal), s, em.p.name(f"{n.name}: attention"))


T.OPS[flash_attention] = T.AtenOp(ir.EAGER, in_cpp=_in_cpp, encode=_encode)
