"""Fusion: fold what follows a convolution into its oneDNN call.

A conv whose only user is an activation or a same-size residual add takes
that op as a post-op (up to the extension's limit), so the activation and
the add never make a pass over memory of their own. The conv moves to the
add's position in the schedule, where its residual already exists.
"""
from __future__ import annotations

from cpu_layout import ir

MAX_POST_OPS = 8


def _activation(node: ir.Pointwise):
    """The cpu_layout.ops post-op for an activation node, or None."""
    op, p = node.op, node.params
    if op in ("relu", "silu", "hardswish", "sigmoid", "tanh"):
        return op
    if op == "gelu":
        return "gelu_tanh" if p and p[0] == "tanh" else "gelu"
    if op == "leaky_relu":
        return ("leaky_relu", float(p[0]))
    if op == "clamp":
        lo, hi = p
        return ("clamp", None if lo is None else float(lo), None if hi is None else float(hi))
    return None


def _residual(node: ir.Pointwise, conv_out: ir.Buffer):
    """The other operand of `conv_out + other` when it can be a fused residual."""
    if node.op != "add" or len(node.args) != 2:
        return None
    a, b = node.args
    other = b if a is conv_out else a if b is conv_out else None
    if not isinstance(other, ir.Buffer) or other is conv_out or not other.is_tensor:
        return None
    if other.size != conv_out.size or other.dtype != conv_out.dtype or node.out.dtype != conv_out.dtype:
        return None
    return other


def fuse_conv_epilogues(g: ir.Graph) -> int:
    """Returns how many nodes were folded into convolutions."""
    fused = 0
    for conv in g.convs():
        while len(conv.post_ops) < MAX_POST_OPS:
            out = conv.out
            if len(out.users) != 1 or not isinstance(out.users[0], ir.Pointwise):
                break
            user = out.users[0]
            if user.out.dtype != out.dtype or user.out.size != out.size:
                break
            act = _activation(user) if len(user.inputs) == 1 else None
            residual = None if act is not None else _residual(user, out)
            if act is None and residual is None:
                break
            if act is not None:
                conv.post_ops.append(act)
            else:
                conv.post_ops.append(("add", residual))
                conv.inputs.append(residual)
                residual.users.append(conv)
                # Run the conv where the add was: its residual exists by then.
                g.nodes.remove(conv)
                g.nodes.insert(g.nodes.index(user), conv)
            g.remove(user)
            g.buffers.pop(out.name, None)
            conv.out = user.out
            user.out.producer = conv
            fused += 1
    return fused
