"""Demo: small conv nets run through cpu_layout's oneDNN convolutions vs eager.

Each net's Conv2d+BatchNorm2d+ReLU blocks are lowered by hand the way the
backend does it: batch-norm folded into the conv weights, ReLU (and the
residual add) fused into the oneDNN call, activations kept channels-last.
Prints median latencies, the speedup against eager (contiguous and
channels_last) measured in the same run, and the largest difference from
eager's output.

    python scripts/demo.py [--threads N] [--iters K]
"""
import argparse
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from cpu_layout import _native, ops


def conv_bn_relu(cin, cout, stride=1):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
    )


class Maml(nn.Module):
    """maml_omniglot's shape: three conv(64,3)+BN+ReLU+MaxPool blocks, Linear(64,5)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(c, 64, 3), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2))
             for c in (1, 64, 64)]
        )
        self.fc = nn.Linear(64, 5)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.fc(x.flatten(1))


class Residual(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.a = conv_bn_relu(c, c)
        self.b = nn.Sequential(nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return F.relu(self.b(self.a(x)) + x)


class SmallResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = conv_bn_relu(3, 32, 2)
        self.body = nn.Sequential(Residual(32), Residual(32))
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = self.body(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def fold(conv, bn):
    """Weights and bias of conv followed by inference batch-norm."""
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    w = conv.weight * scale.reshape(-1, 1, 1, 1)
    b = (conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)) - bn.running_mean
    return w.contiguous(), (b * scale + bn.bias).contiguous()


def lowered_maml(m):
    layers = [(fold(b[0], b[1]), b[0]) for b in m.blocks]

    def run(x):
        for (w, b), conv in layers:
            x = ops.conv2d(x, w, b, conv.stride, conv.padding, post_ops=["relu"], out_layout="nhwc")
            x = F.max_pool2d(x, 2)
        return F.linear(x.flatten(1), m.fc.weight, m.fc.bias)

    return run


def lowered_resnet(m):
    stem = fold(m.stem[0], m.stem[1])
    blocks = [(fold(r.a[0], r.a[1]), fold(r.b[0], r.b[1])) for r in m.body]

    def run(x):
        x = ops.conv2d(x, *stem, 2, 1, post_ops=["relu"], out_layout="nhwc")
        for (wa, ba), (wb, bb) in blocks:
            h = ops.conv2d(x, wa, ba, 1, 1, post_ops=["relu"], out_layout="nhwc")
            x = ops.conv2d(h, wb, bb, 1, 1, post_ops=[("add", x), "relu"], out_layout="nhwc")
        return F.linear(x.mean((2, 3)), m.fc.weight, m.fc.bias)

    return run


def median_ms(fn, iters):
    for _ in range(5):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"cpu_layout demo: oneDNN {'.'.join(map(str, _native.DNNL_VERSION))}, ISA {_native.cpu_isa()}, "
          f"{args.threads} thread(s), median of {args.iters} runs")
    nets = [
        ("maml_omniglot", Maml(), lowered_maml, (5, 1, 28, 28)),
        ("small_resnet", SmallResNet(), lowered_resnet, (4, 3, 64, 64)),
    ]
    print(f"{'model':<15}{'eager ms':>10}{'eager_cl ms':>12}{'ours ms':>9}{'vs eager':>10}{'vs eager_cl':>12}{'max err':>10}")
    worst = 0.0
    with torch.no_grad():
        for name, m, lower, shape in nets:
            m.eval()
            for mod in m.modules():  # non-trivial batch-norm statistics
                if isinstance(mod, nn.BatchNorm2d):
                    mod.running_mean.uniform_(-0.5, 0.5)
                    mod.running_var.uniform_(0.5, 2.0)
            x = torch.randn(shape)
            m_cl = type(m)().eval()
            m_cl.load_state_dict(m.state_dict())
            m_cl = m_cl.to(memory_format=torch.channels_last)
            x_cl = x.contiguous(memory_format=torch.channels_last)
            fast = lower(m)
            ref = m(x)
            err = (fast(x) - ref).abs().max().item() / (ref.abs().max().item() or 1)
            worst = max(worst, err)
            t_e = median_ms(lambda: m(x), args.iters)
            t_c = median_ms(lambda: m_cl(x_cl), args.iters)
            t_o = median_ms(lambda: fast(x), args.iters)
            print(f"{name:<15}{t_e:10.3f}{t_c:12.3f}{t_o:9.3f}{t_e / t_o:10.2f}{t_c / t_o:12.2f}{err:10.1e}")
    if worst > 1e-4:
        print(f"FAIL: relative error {worst:.2e} above 1e-4")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
