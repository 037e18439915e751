"""Fusion: fewer passes over memory.

Conv epilogues (before planning): a conv whose only user is an activation
(in C++ segments not one `split_in_segments` keeps apart) or a same-size residual add
takes that op as a oneDNN post-op (up to the extension's limit); the conv moves to the
add's position in the schedule, where its residual already exists.

Element-wise chains (after planning, so each group's output layout is
known): a pointwise node whose only user is a pointwise node of the same
size joins that user's group; each group becomes one `ir.Kernel`, a single
generated loop that keeps intermediates in registers.
"""
from __future__ import annotations

import functools
import os
from typing import Dict

import torch

from cpu_layout import ir
from cpu_layout import layout as L
from cpu_layout import op_table as T
from cpu_layout.codegen import expr as E

MAX_POST_OPS = 8


def _value_users(b: ir.Buffer):
    """`b`'s readers but its size queries: an op fused into `b`'s producer keeps
    its sizes. (Under dynamic shapes, a view's sizes are queried from its input:
    convnext_tiny's linears ran their GELUs as 18 passes of their own, 7% of
    its forward.)"""
    return [u for u in b.users if not (isinstance(u, ir.Aten) and u.target in T.SIZE_QUERIES)]


# Activations a conv in a C++ segment does not take as a post-op although
# oneDNN could (`split_in_segments` says which): its swish post-op costs more
# than the generated kernel's pass over the conv's output, which in a segment
# writes in place or into pooled storage, while that output is in cache.
# efficientnet_b0 with every silu fused vs every silu in a kernel, interleaved
# in one process (EPYC Zen 4): batch 1, 1 thread 15.38 vs 14.82 ms (fp32),
# 11.67 vs 11.28 ms (AMP); batch 8, 2 threads 68.6 vs 63.6 ms (fp32), 41.5 vs
# 41.1 ms (AMP), before kernels ran in place. Conv by conv in isolation the two
# came out even on most shapes and the split cheaper on depthwise ones
# (144x56x56, 1 thread: 129 us bare, 373 us with swish, the pass 173 us), so a
# per-shape timing would not see the in-graph gain. The Python wrapper
# allocates every kernel output, and there the split lost at batch 8 (74.8
# fused vs 85.6 ms; even at batch 1): it keeps them fused.
UNFUSED_ACTIVATIONS = ("silu",)

# ... except an fp32 output larger per thread than this many L2 caches: the
# pass then reads and writes it from memory, and the conv's swish costs less.
# Conv by conv in the graph (efficientnet_b0, Sapphire Rapids-class Xeon,
# `breakdown.py --nodes`): the 1x1 conv to 8x96x112x112 (19 MB per thread)
# 3.19 ms + a 3.79 ms pass split, 4.28 ms fused; 1x1 and depthwise convs to
# 8x144x56x56 (7.2 MB) 2.48 / 2.85 ms split, 1.87 / 2.57 fused; below 4 MB per
# thread the split won (at batch 1, one thread, all but the 4.8 MB conv), and
# a stride-2 depthwise conv to 8x96x56x56 lost 1.1 ms fused. bf16 convs (AMX)
# pay more for the swish: at batch 8 the split won on every conv. Whole model, interleaved (same machine): fp32 batch 8,
# 2 threads every silu fused 51.4 ms, none 55.5 ms; batch 1, 1 thread 12.9
# against 12.7 ms; AMP batch 8 34.6 against 31.8 ms. This rule at 4 L2s: batch
# 8 52.1 / 51.5 ms (none 53.9 / 53.5, all 51.9 / 50.4, two runs), batch 1 the
# same graph as none; at 2 L2s against 4 (20 rounds): batch 8 53.4 vs 54.7 ms,
# batch 1 13.1 vs 13.3 ms (an earlier 10-round run had batch 1 0.3 ms slower).
SPLIT_MAX_L2_MULTIPLE = 2


@functools.lru_cache(maxsize=1)
def _l2_bytes() -> int:
    """This machine's L2 cache per core (sysfs), 1 MiB when it does not say."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in sorted(os.listdir(base)):
            d = os.path.join(base, entry)
            with open(os.path.join(d, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(d, "type")) as f:
                kind = f.read().strip()
            if level == "2" and kind in ("Unified", "Data"):
                with open(os.path.join(d, "size")) as f:
                    text = f.read().strip().upper()
                scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                return int(text.rstrip("KMG")) * scale
    except (OSError, ValueError):
        pass
    return 1 << 20


def split_in_segments(conv: ir.Conv, act: ir.Pointwise) -> bool:
    """Whether the activation `act` after `conv` runs as a kernel of its own in a
    C++ segment rather than as the conv's post-op (UNFUSED_ACTIVATIONS, above)."""
    if act.op not in UNFUSED_ACTIVATIONS:
        return False
    out = conv.out
    if out.dtype != torch.float32:
        return True
    per_thread = L.nbytes_hint(out.size, out.dtype) / max(1, torch.get_num_threads())
    return per_thread <= SPLIT_MAX_L2_MULTIPLE * _l2_bytes()


def _activation(node: ir.Pointwise, conv: ir.Conv, split=None):
    """The cpu_layout.ops post-op for an activation node after `conv`, or None
    (also when `split(conv, node)` keeps it out of the conv)."""
    if node.op not in E.OPS or E.OPS[node.op].post_op is None:
        return None
    if split is not None and split(conv, node):
        return None
    return E.OPS[node.op].post_op(node.params)


def _residual(node: ir.Pointwise, conv_out: ir.Buffer):
    """The other operand of `conv_out + other` when it can be a fused residual."""
    if node.op != "add" or len(node.args) != 2:
        return None
    a, b = node.args
    other = b if a is conv_out else a if b is conv_out else None
    if not isinstance(other, ir.Buffer) or other is conv_out or not other.is_tensor:
        return None
    if not L.same_sizes(other.size, conv_out.size) or other.dtype != conv_out.dtype or node.out.dtype != conv_out.dtype:
        return None
    return other


def _activation_through_views(g: ir.Graph, conv: ir.Conv, split=None) -> bool:
    """conv -> views -> activation (a linear run as a 1x1 conv, then reshaped
    before its GELU): the activation becomes a post-op and the views carry the
    activated values; an element-wise op commutes with any view."""
    b, chain = conv.out, []
    readers = _value_users(b)
    while len(readers) == 1 and isinstance(readers[0], ir.Aten) and readers[0].rule == ir.VIEW:
        b = readers[0].out
        chain.append(b)
        readers = _value_users(b)
    if not chain or len(readers) != 1 or not isinstance(readers[0], ir.Pointwise):
        return False
    user = readers[0]
    act = _activation(user, conv, split) if len(user.inputs) == 1 else None
    if act is None or user.out.dtype != b.dtype or not L.same_sizes(user.out.size, b.size):
        return False
    conv.post_ops.append(act)
    g.replace_all_uses(user.out, b)
    g.remove(user)
    g.buffers.pop(user.out.name, None)
    return True


def fuse_conv_epilogues(g: ir.Graph, split=None) -> int:
    """Returns how many nodes were folded into convolutions; an activation for
    which `split(conv, node)` holds (`split_in_segments` for C++ segments) is
    left to a kernel."""
    fused = 0
    for conv in g.convs():
        while len(conv.post_ops) < MAX_POST_OPS and _activation_through_views(g, conv, split):
            fused += 1
        while len(conv.post_ops) < MAX_POST_OPS:
            out = conv.out
            readers = _value_users(out)
            if len(readers) != 1 or not isinstance(readers[0], ir.Pointwise):
                break
            user = readers[0]
            if user.out.dtype != out.dtype or not L.same_sizes(user.out.size, out.size):
                break
            act = _activation(user, conv, split) if len(user.inputs) == 1 else None
            # (a residual moves the conv to the add: a size query between them would
            # read the conv's output before it exists)
            residual = None if act is not None or len(out.users) != 1 else _residual(user, out)
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
            g.replace_all_uses(out, user.out)  # its size queries: the same sizes
            g.buffers.pop(out.name, None)
            conv.out = user.out
            user.out.producer = conv
            fused += 1
    return fused


def _expr(node: ir.Pointwise, env):
    """The codegen expression of one pointwise node, or None if codegen lacks the op."""
    args = []
    for a in node.args:
        if isinstance(a, ir.Buffer):
            args.append(env[a])
        elif isinstance(a, (bool, int, float)):
            args.append(E.Const(float(a)))
        else:
            return None
    op, p = node.op, node.params
    if op == "to":
        return args[0]  # the kernel loads and stores in each buffer's own dtype
    if op not in E.OPS or E.OPS[op].arity != len(args):
        return None
    return E.Op(op, tuple(args), p)  # Op checks and normalises the parameters


def _kernelizable(n: ir.Node) -> bool:
    # A kernel loads tensors: an operand computed at run time as a Python number
    # (a symbolic size's scale under dynamic shapes) keeps the node on ATen.
    if (not isinstance(n, ir.Pointwise) or not n.out.is_tensor
            or any(isinstance(a, ir.Buffer) and not a.is_tensor for a in n.args)):
        return False
    probe = {b: E.Load(0) for b in n.inputs}
    return _expr(n, probe) is not None


def pointwise_groups(g: ir.Graph) -> Dict[ir.Node, ir.Node]:
    """The element-wise chains that become one kernel each: every node a kernel
    can compute -> its chain's root, whose output the kernel writes. A node
    joins its only user's chain unless it is a graph output or its sizes or
    layout differ from the user's. Before planning (no layouts yet) this is what
    the plan prices the chains by (`plan/ir_plan.py`)."""
    outputs = set(ir.values_of(g.output.values)) if g.output is not None else set()
    group: Dict[ir.Node, ir.Node] = {}
    for n in reversed(g.nodes):
        if not _kernelizable(n):
            continue
        users = n.out.users
        u = users[0] if len(users) == 1 else None
        if (u is not None and u in group and n.out not in outputs and L.same_sizes(u.out.size, n.out.size)
                and n.out.layout == u.out.layout):
            group[n] = group[u]
        else:
            group[n] = n  # the root: its output is the group's output
    return group


def fuse_pointwise(g: ir.Graph) -> int:
    """Replace element-wise chains by `ir.Kernel` nodes; returns how many kernels."""
    group = pointwise_groups(g)
    order = {n: i for i, n in enumerate(g.nodes)}
    members = {}
    for n, root in group.items():
        members.setdefault(root, []).append(n)
    for root, ms in members.items():
        ms.sort(key=order.__getitem__)
        inside = {m.out for m in ms}
        inputs = []
        for m in ms:
            for b in m.inputs:
                if b.is_tensor and b not in inside and b not in inputs:
                    inputs.append(b)
        env = {b: E.Load(i) for i, b in enumerate(inputs)}
        for m in ms:
            env[m.out] = _expr(m, env)
        k = ir.Kernel(f"kernel_{root.name}", inputs, root.out, expr=env[root.out], members=len(ms))
        pos = g.nodes.index(root)
        for m in ms:
            g.remove(m)
            if m is not root:
                g.buffers.pop(m.out.name, None)
        g.nodes.insert(pos - (len(ms) - 1), k)
        for b in inputs:
            b.users.append(k)
        root.out.producer = k
    return len(members)
