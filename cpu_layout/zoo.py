"""Third-party model suites (torchvision, timm) for tests and benchmarks.

Never imported by the backend itself. Weights are random (nothing downloads);
batch-norm statistics are made non-trivial (models.randomize_batch_norm) so
folding is exercised.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch


_TORCHVISION_LIB = []


def _define_torchvision_op_schemas() -> None:
    # torchvision's wheel here is a CUDA build: with the CPU torch its C++ ops
    # do not load, yet its Python side registers fake kernels for nms/qnms and
    # fails with "operator torchvision::nms does not exist". Model definitions
    # need neither op, so declaring the two schemas is enough to import it.
    if _TORCHVISION_LIB:
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION_LIB.append(lib)  # a Library deregisters its schemas when collected


def import_torchvision():
    """`import torchvision`, or None when it is not installed."""
    try:
        import torchvision  # noqa: F401
        return torchvision
    except ImportError:
        return None
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
    _define_torchvision_op_schemas()
    import importlib
    import sys

    for m in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[m]
    return importlib.import_module("torchvision")


def import_timm():
    """`import timm` (which imports torchvision), or None when it is not installed."""
    if import_torchvision() is None:
        return None
    try:
        import timm
        return timm
    except ImportError:
        return None


def import_transformers():
    """`import transformers`, or None when it is not installed. It imports torchvision
    when that is installed, so torchvision's schemas are made importable first."""
    import_torchvision()
    try:
        import transformers
        return transformers
    except ImportError:
        return None


# ---- Hugging Face models, built from their configs (random weights) ------------------

# name -> (model class, config class, config overrides, decoder input: encoder-decoder
# models take decoder_input_ids too). Defaults are each architecture's base config
# (BERT-base, GPT-2 small, T5-small, BART-base ...; ALBERT's default is xxlarge, so
# albert-base-v2's sizes are given); the Llama-architecture decoder
# is a small one (8 layers, hidden 768, grouped-query attention with 4 KV heads).
HF_MODELS = {
    "bert": ("BertForSequenceClassification", "BertConfig", {}, False),
    "roberta": ("RobertaForSequenceClassification", "RobertaConfig", {}, False),
    "distilbert": ("DistilBertForSequenceClassification", "DistilBertConfig", {}, False),
    "albert": ("AlbertForSequenceClassification", "AlbertConfig",  # albert-base-v2's sizes
               dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072), False),
    "electra": ("ElectraForSequenceClassification", "ElectraConfig", {}, False),
    "t5_encoder": ("T5EncoderModel", "T5Config", {}, False),
    "t5": ("T5ForConditionalGeneration", "T5Config", {}, True),
    "bart": ("BartForConditionalGeneration", "BartConfig", {}, True),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {}, False),
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                   num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048), False),
}

# The same architectures cut down for tests: two layers, hidden 32, short vocabularies.
_TINY = {
    "bert": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 vocab_size=100),
    "distilbert": dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64, vocab_size=100),
    "t5": dict(d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=8,
               vocab_size=100),
    "bart": dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, vocab_size=100),
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100),
}
HF_TINY = tuple(_TINY)


class HFModel(torch.nn.Module):
    """A Hugging Face model as a function of tensors: (input_ids, attention_mask[,
    decoder_input_ids]) -> its first output (logits, or the encoder's last hidden
    state), so every harness calls it as it calls a vision model."""

    def __init__(self, model, decoder: bool):
        import inspect

        super().__init__()
        self.model, self.decoder = model, decoder
        # A whole sequence per call: no key/value cache returned beside the logits.
        self.no_cache = "use_cache" in inspect.signature(model.forward).parameters

    def forward(self, input_ids, attention_mask, decoder_input_ids=None):
        kw = {"use_cache": False} if self.no_cache else {}
        if self.decoder:
            kw["decoder_input_ids"] = decoder_input_ids
        return self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **kw)[0]


def build_hf(name: str, tiny: bool = False) -> HFModel:
    """The model `name` of HF_MODELS from its config, random weights, eval mode, eager
    attention (what a user's `from_config` gets without flash kernels: the graph holds
    the attention's matmuls and softmax, or SDPA where the model's default is SDPA)."""
    tf = import_transformers()
    if tf is None:
        raise ImportError("the huggingface suite needs transformers (pip install transformers)")
    if name not in HF_MODELS or (tiny and name not in _TINY):
        raise ValueError(f"unknown huggingface model {name!r}; choose from "
                         f"{', '.join(HF_TINY if tiny else HF_MODELS)}")
    cls, cfg_cls, overrides, decoder = HF_MODELS[name]
    cfg = getattr(tf, cfg_cls)(**(_TINY[name] if tiny else overrides))
    torch.manual_seed(0)
    model = getattr(tf, cls)(cfg).eval()
    return HFModel(model, decoder).eval()


def hf_inputs(name: str, batch: int, seq: int, vocab: int = 100, seed: int = 1,
              padded: bool = True) -> Tuple[torch.Tensor, ...]:
    """Token ids and an attention mask (the last quarter of every other row padded
    when `padded`), plus decoder ids for encoder-decoder models."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padded and seq >= 4:
        mask[1::2, seq - seq // 4:] = 0
    if HF_MODELS[name][3]:
        return ids, mask, torch.randint(0, vocab, (batch, seq), generator=g)
    return ids, mask


def example_input(shape: Tuple[int, ...], seed: int = 1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---- the tiers the tests and scripts/model_tier.py run -------------------------------

# (suite, name, input size without the batch dim, op family it stands for): a dozen
# models at small resolutions, chosen so every op family real CNNs use appears once.
CI_TIER = (
    # tests/test_real_models.py gives entry i the configurations i and i + 12 of its
    # list: 0-3 static, 4-7 dynamic=True, 8-11 mark_dynamic on the batch. Swin stays
    # static: with every dim symbolic, Dynamo's own tracing of it takes minutes.
    ("torchvision", "swin_t", (3, 64, 64), "attention with relative position bias"),
    ("torchvision", "mobilenet_v3_small", (3, 64, 64), "depthwise + SE, hardswish"),
    ("torchvision", "regnet_x_400mf", (3, 64, 64), "grouped convs"),
    ("torchvision", "densenet121", (3, 32, 32), "dense concat"),
    ("torchvision", "resnet18", (3, 64, 64), "residual"),
    ("torchvision", "shufflenet_v2_x0_5", (3, 64, 64), "channel shuffle, chunk"),
    ("torchvision", "googlenet", (3, 64, 64), "inception branches"),
    ("torchvision", "r3d_18", (3, 4, 32, 32), "conv3d"),
    ("torchvision", "convnext_tiny", (3, 32, 32), "permute + layer_norm + linear"),
    ("torchvision", "deeplabv3_mobilenet_v3_large", (3, 64, 64), "dilated convs, bilinear upsampling"),
    ("timm", "resnest14d", (3, 64, 64), "split attention (radix softmax)"),
    ("timm", "convnext_atto", (3, 64, 64), "timm's own layers"),
)


def build(suite: str, name: str) -> torch.nn.Module:
    """The model in eval mode: random weights, non-trivial batch-norm statistics."""
    from cpu_layout.models import randomize_batch_norm

    torch.manual_seed(0)
    if suite == "torchvision":
        tv = import_torchvision()
        if tv is None:
            raise ImportError("torchvision is not installed")
        kwargs = {}
        if name in ("googlenet", "inception_v3"):
            kwargs = {"aux_logits": False, "init_weights": True}
        elif name.startswith(("deeplabv3", "fcn", "lraspp")):
            kwargs = {"weights_backbone": None}
        model = tv.models.get_model(name, weights=None, **kwargs)
    elif suite == "timm":
        timm = import_timm()
        if timm is None:
            raise ImportError("timm is not installed")
        model = timm.create_model(name, pretrained=False)
    else:
        raise ValueError(f"unknown suite {suite!r}")
    return randomize_batch_norm(model, 0)


def default_input_shape(suite: str, name: str, model: torch.nn.Module,
                        size: Optional[int] = None) -> Tuple[int, ...]:
    """A model's usual input size without the batch dim: timm's own config; for
    torchvision 224 px (inception 299), video clips of 8 frames at 112 px (16 at
    224 px for MViT, S3D and Swin3D). `size` replaces the two spatial sizes."""
    if suite == "timm":
        shape = tuple(model.default_cfg.get("input_size", (3, 224, 224)))
    elif name == "inception_v3":
        shape = (3, 299, 299)
    elif type(model).__module__.startswith("torchvision.models.video."):
        big = name.startswith(("mvit", "s3d", "swin3d"))
        shape = (3, 16, 224, 224) if big else (3, 8, 112, 112)
    else:
        shape = (3, 224, 224)
    return shape[:-2] + (size, size) if size else shape


def model_and_input(suite: str, name: str, batch: int, size: Optional[int] = None):
    """(model in eval mode, example input at `batch`) for a model of `suite`
    (builtin, torchvision, timm or huggingface) at its default input shape; `size`
    replaces the spatial sizes (huggingface: the sequence length, 128 by default;
    the input is a tuple of tensors). The one place the benchmark scripts get a
    model from."""
    if suite == "huggingface":
        return build_hf(name), hf_inputs(name, batch, size or 128)
    if suite == "builtin":
        from cpu_layout import models

        return models.build(name, batch_size=batch)
    model = build(suite, name)
    return model, example_input((batch,) + default_input_shape(suite, name, model, size))


def compare_with_eager(model: torch.nn.Module, shape: Tuple[int, ...], dtype: str = "float32",
                       shapes: str = "static", wrapper: str = "default",
                       grad_mode: str = "inference_mode", batch: int = 2) -> List[str]:
    """Compile `model` with cpu_layout (`shapes`: static, dynamic = dynamic=True,
    mark_dynamic = the batch dim marked) and run it next to eager at `batch`, and
    at batch + 1 unless static. Returns what differs, one line each (empty: nothing):
    output sizes, dtypes and strides must be eager's exactly, values must pass
    PyTorch's benchmark check against an fp64 reference (benchmark.TOLERANCE)."""
    from cpu_layout import benchmark as B

    fn = torch.compile(model, backend="cpu_layout", dynamic=True if shapes == "dynamic" else None,
                       options={"cpp_wrapper": wrapper == "cpp"})
    problems = []
    for bs in (batch,) if shapes == "static" else (batch, batch + 1):
        x = example_input((bs,) + tuple(shape), seed=bs)
        if shapes == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 0)
        mode = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()
        with mode, B._autocast(dtype):
            ref = model(x)
            out = fn(x)
        got = [(tuple(t.shape), t.stride(), t.dtype) for t in B._flatten(out)]
        want = [(tuple(t.shape), t.stride(), t.dtype) for t in B._flatten(ref)]
        if got != want:
            problems.append(f"batch {bs}: (size, stride, dtype) {got} where eager has {want}")
        fp64 = B.fp64_reference(model, x)
        if not B.values_match(ref, out, fp64, dtype):
            problems.append(f"batch {bs}: values: " + B.describe_error(ref, out, fp64, dtype))
    return problems


# ---- INT8: PyTorch's PT2E flow -------------------------------------------------------

CALIBRATION_BATCHES = 8


def calibration_batches(example: torch.Tensor, count: int = CALIBRATION_BATCHES,
                        seed: int = 0) -> List[torch.Tensor]:
    """`count` random batches shaped like `example` (standard normal, from a
    torch.Generator seeded `seed`): the fixed calibration set of the INT8 benchmarks,
    the same for PT2E and for OpenVINO's NNCF."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(example.shape, generator=g, dtype=example.dtype) for _ in range(count)]


def quantize_pt2e(model: torch.nn.Module, example_input: torch.Tensor,
                  calibration_batches: List[torch.Tensor]) -> torch.nn.Module:
    """PyTorch's INT8 flow (PT2E, static quantization) for x86 CPUs: the converted
    graph module, fp32 ATen ops between quantized_decomposed quantize/dequantize
    nodes with int8 weight constants, as `torch.compile` backends receive it.

    1. Batch-norm statistics of `model` are re-estimated on the calibration batches,
       IN PLACE (so the fp32 model and its quantized graph compute the same function):
       torchvision's random init leaves them at (0, 1), and mobilenet/efficientnet
       activations then shrink to ~1e-10, which int8 rounds to 0.
    2. torch.export.export(model, (example_input,), strict=True): with torch 2.13's
       default non-strict export, X86InductorQuantizer fails on ResNets ("Input
       partition has more than one output node": a ReLU module called several times
       is one source partition).
    3. torchao's X86InductorQuantizer, default config (per-channel symmetric int8
       weights, per-tensor uint8 activations), prepare_pt2e, one call per calibration
       batch, convert_pt2e.

    The result keeps export's guard on the batch size of `example_input` (another
    batch size raises "Guard failed"): quantize at the batch size you run. `model`
    is left in eval mode. Needs torchao (pip install torchao==0.18.0)."""
    try:
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    except ImportError as exc:
        raise ImportError(f"INT8 quantization (PT2E) needs torchao: pip install torchao==0.18.0 "
                          f"({exc})") from exc
    if not calibration_batches:
        raise ValueError("quantize_pt2e needs at least one calibration batch")
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in bns]
    model.train()
    try:
        with torch.no_grad():
            for m in bns:
                m.reset_running_stats()
                m.momentum = None  # cumulative average over the calibration batches
            for c in calibration_batches:
                model(c)
    finally:
        for m, mom in zip(bns, momenta):
            m.momentum = mom
        model.eval()
    ep = torch.export.export(model, (example_input,), strict=True)
    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(ep.module(), quantizer)
    with torch.no_grad():
        for c in calibration_batches:
            prepared(c)
    return convert_pt2e(prepared)
