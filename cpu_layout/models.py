"""Built-in model suite: small conv nets of the shapes users benchmark.

No downloads: definitions only, random weights from fixed seeds, batch-norm
statistics made non-trivial so folding is exercised. Each entry builds
(model in eval mode, example input) at a size that runs in seconds on two
cores. Used by the tests, scripts/bench_models.py and scripts/single_run.sh.
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


def conv_bn(cin, cout, k=3, stride=1, groups=1, act=nn.ReLU):
    layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


class MamlOmniglot(nn.Module):
    """torchbench maml_omniglot: three conv(64,3)+BN+ReLU+MaxPool(2) blocks, Linear(64,5)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 64, 3), nn.BatchNorm2d(64, momentum=1, affine=True), nn.ReLU(inplace=True),
            nn.MaxPool2d(2, 2),
            nn.Conv2d(64, 64, 3), nn.BatchNorm2d(64, momentum=1, affine=True), nn.ReLU(inplace=True),
            nn.MaxPool2d(2, 2),
            nn.Conv2d(64, 64, 3), nn.BatchNorm2d(64, momentum=1, affine=True), nn.ReLU(inplace=True),
            nn.MaxPool2d(2, 2),
            nn.Flatten(),
            nn.Linear(64, 5),
        )

    def forward(self, x):
        return self.net(x)


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.a = conv_bn(cin, cout, 3, stride)
        self.b = conv_bn(cout, cout, 3, 1, act=None)
        self.down = conv_bn(cin, cout, 1, stride, act=None) if stride != 1 or cin != cout else None

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        return F.relu(self.b(self.a(x)) + idt)


class Bottleneck(nn.Module):
    def __init__(self, cin, mid, cout, stride=1, groups=1):
        super().__init__()
        self.a = conv_bn(cin, mid, 1)
        self.b = conv_bn(mid, mid, 3, stride, groups=groups)
        self.c = conv_bn(mid, cout, 1, act=None)
        self.down = conv_bn(cin, cout, 1, stride, act=None) if stride != 1 or cin != cout else None

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        return F.relu(self.c(self.b(self.a(x))) + idt)


class ResNet(nn.Module):
    """resnet18-like (basic blocks) or resnet50-like (bottlenecks), narrow."""

    def __init__(self, bottleneck=False, width=16, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(conv_bn(3, width, 7, 2), nn.MaxPool2d(3, 2, 1))
        blocks, c = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            out = width * 2**i
            if bottleneck:
                blocks += [Bottleneck(c, out // 2, out * 2, stride), Bottleneck(out * 2, out // 2, out * 2)]
                c = out * 2
            else:
                blocks += [BasicBlock(c, out, stride), BasicBlock(out, out)]
                c = out
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class InvertedResidual(nn.Module):
    def __init__(self, cin, cout, stride, expand, act=nn.ReLU6, se=False):
        super().__init__()
        mid = cin * expand
        self.use_res = stride == 1 and cin == cout
        layers = [conv_bn(cin, mid, 1, act=act)] if expand != 1 else []
        layers.append(conv_bn(mid, mid, 3, stride, groups=mid, act=act))
        if se:
            layers.append(SqueezeExcite(mid))
        layers.append(conv_bn(mid, cout, 1, act=None))
        self.body = nn.Sequential(*layers)

    def forward(self, x):
        y = self.body(x)
        return x + y if self.use_res else y


class SqueezeExcite(nn.Module):
    def __init__(self, c, r=4, gate=nn.Sigmoid):
        super().__init__()
        self.fc1 = nn.Conv2d(c, max(8, c // r), 1)
        self.fc2 = nn.Conv2d(max(8, c // r), c, 1)
        self.gate = gate()

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)
        return x * self.gate(self.fc2(F.silu(self.fc1(s))))


class MobileNetV2(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        cfg = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 2, 2), (6, 64, 1, 2)]
        layers, c = [conv_bn(3, 16, 3, 2, act=nn.ReLU6)], 16
        for t, cout, n, s in cfg:
            for i in range(n):
                layers.append(InvertedResidual(c, cout, s if i == 0 else 1, t))
                c = cout
        layers.append(conv_bn(c, 128, 1, act=nn.ReLU6))
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


class MobileNetV3(nn.Module):
    """Hardswish, squeeze-excite with hardsigmoid gates."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = conv_bn(3, 16, 3, 2, act=nn.Hardswish)
        self.blocks = nn.Sequential(
            InvertedResidual(16, 16, 2, 1, act=nn.ReLU, se=True),
            InvertedResidual(16, 24, 2, 4, act=nn.ReLU),
            InvertedResidual(24, 24, 1, 3, act=nn.Hardswish, se=True),
            InvertedResidual(24, 40, 2, 3, act=nn.Hardswish, se=True),
        )
        self.head = conv_bn(40, 96, 1, act=nn.Hardswish)
        self.fc = nn.Sequential(nn.Linear(96, 64), nn.Hardswish(), nn.Linear(64, num_classes))

    def forward(self, x):
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class RegNet(nn.Module):
    """Grouped 3x3 bottlenecks (group width 8) with a plain stem: grouped and regular convs mix."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = conv_bn(3, 16, 3, 2)
        self.blocks = nn.Sequential(
            Bottleneck(16, 32, 32, 2, groups=4), Bottleneck(32, 32, 32, 1, groups=4),
            Bottleneck(32, 64, 64, 2, groups=8), Bottleneck(64, 64, 64, 1, groups=8),
        )
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


class DenseNet(nn.Module):
    """Dense blocks: every layer's output is concatenated onto its input."""

    def __init__(self, growth=8, num_classes=10):
        super().__init__()
        self.stem = conv_bn(3, 16, 3, 2)
        c = 16
        self.block1 = nn.ModuleList()
        for _ in range(3):
            self.block1.append(nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, growth, 3, 1, 1)))
            c += growth
        self.trans = nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c // 2, 1), nn.AvgPool2d(2))
        c //= 2
        self.block2 = nn.ModuleList()
        for _ in range(3):
            self.block2.append(nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, growth, 3, 1, 1)))
            c += growth
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.block1:
            x = torch.cat([x, layer(x)], 1)
        x = self.trans(x)
        for layer in self.block2:
            x = torch.cat([x, layer(x)], 1)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class EfficientNet(nn.Module):
    """SiLU everywhere, squeeze-excite, depthwise convs."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = conv_bn(3, 16, 3, 2, act=nn.SiLU)
        self.blocks = nn.Sequential(
            InvertedResidual(16, 16, 1, 1, act=nn.SiLU, se=True),
            InvertedResidual(16, 24, 2, 4, act=nn.SiLU, se=True),
            InvertedResidual(24, 24, 1, 4, act=nn.SiLU, se=True),
            InvertedResidual(24, 40, 2, 4, act=nn.SiLU, se=True),
        )
        self.head = conv_bn(40, 128, 1, act=nn.SiLU)
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x):
        return self.fc(self.head(self.blocks(self.stem(x))).mean((2, 3)))


class UNet(nn.Module):
    """Encoder-decoder with nearest upsampling and skip concatenations."""

    def __init__(self, c=16, out_ch=2):
        super().__init__()
        self.e1 = nn.Sequential(conv_bn(3, c), conv_bn(c, c))
        self.e2 = nn.Sequential(conv_bn(c, 2 * c), conv_bn(2 * c, 2 * c))
        self.mid = nn.Sequential(conv_bn(2 * c, 4 * c), conv_bn(4 * c, 4 * c))
        self.d2 = nn.Sequential(conv_bn(6 * c, 2 * c), conv_bn(2 * c, 2 * c))
        self.d1 = nn.Sequential(conv_bn(3 * c, c), conv_bn(c, c))
        self.out = nn.Conv2d(c, out_ch, 1)

    def forward(self, x):
        e1 = self.e1(x)
        e2 = self.e2(F.max_pool2d(e1, 2))
        m = self.mid(F.max_pool2d(e2, 2))
        d2 = self.d2(torch.cat([F.interpolate(m, scale_factor=2.0, mode="nearest"), e2], 1))
        d1 = self.d1(torch.cat([F.interpolate(d2, scale_factor=2.0, mode="nearest"), e1], 1))
        return self.out(d1)


class PlainConvNet(nn.Module):
    """`layers` 3x3 convs of `channels` channels with ReLU: per-call overhead dominates."""

    def __init__(self, layers: int = 5, channels: int = 16):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in range(layers))

    def forward(self, x):
        for conv in self.convs:
            x = F.relu(conv(x))
        return x


def randomize_batch_norm(model: nn.Module, seed: int) -> nn.Module:
    """Non-trivial batch-norm statistics and affine parameters (fresh ones are
    identities, which would hide folding bugs); the model in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.copy_(torch.rand(m.running_mean.shape, generator=g) - 0.5)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
                if m.affine:
                    m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                    m.bias.copy_(torch.rand(m.bias.shape, generator=g) - 0.5)
    return model.eval()


# name -> (constructor, default input size)
MODELS: Dict[str, Tuple[Callable[[], nn.Module], Tuple[int, ...]]] = {
    "maml_omniglot": (MamlOmniglot, (5, 1, 28, 28)),
    "resnet18": (lambda: ResNet(bottleneck=False), (4, 3, 64, 64)),
    "resnet50": (lambda: ResNet(bottleneck=True), (4, 3, 64, 64)),
    "mobilenet_v2": (MobileNetV2, (4, 3, 64, 64)),
    "mobilenet_v3": (MobileNetV3, (4, 3, 64, 64)),
    "regnet": (RegNet, (4, 3, 64, 64)),
    "densenet": (DenseNet, (4, 3, 64, 64)),
    "efficientnet": (EfficientNet, (4, 3, 64, 64)),
    "unet": (UNet, (2, 3, 64, 64)),
}


# Not in the suite: for measuring wrapper overhead (scripts/bench_wrapper.py).
SMALL_MODELS: Dict[str, Tuple[Callable[[], nn.Module], Tuple[int, ...]]] = {
    "conv5x16": (PlainConvNet, (1, 16, 16, 16)),
}


def build(name: str, batch_size: int = 0, seed: int = 0):
    """(model, example input) for a built-in model; batch_size > 0 overrides the default."""
    known = {**MODELS, **SMALL_MODELS}
    if name not in known:
        raise KeyError(f"unknown model {name!r}; built-in: {', '.join(known)}")
    ctor, shape = known[name]
    torch.manual_seed(seed)
    model = randomize_batch_norm(ctor(), seed)
    if batch_size > 0:
        shape = (batch_size,) + tuple(shape[1:])
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1))
    return model, x
