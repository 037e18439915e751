"""Hugging Face transformers (small configs, random weights) against eager: values,
sizes and strides, both wrappers, both grad modes, padded attention masks; no
graph may fall back (strict)."""
import pytest
import torch

from cpu_layout import runtime, zoo

tf = zoo.import_transformers()
pytestmark = [pytest.mark.skipif(tf is None, reason="transformers is not installed"),
              pytest.mark.usefixtures("strict_compile")]


def _check(name, cpp, mode, batch=2, seq=12):
    model = zoo.build_hf(name, tiny=True)
    fn = torch.compile(model, backend="cpu_layout", options={"cpp_wrapper": cpp})
    grad = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with grad:
        for seed in (1, 2):  # the second call runs what the first one laid out
            args = zoo.hf_inputs(name, batch, seq, seed=seed)
            got, ref = fn(*args), model(*args)
            assert got.shape == ref.shape and got.stride() == ref.stride() and got.dtype == ref.dtype
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("cpp", [False, True], ids=["python", "cpp"])
@pytest.mark.parametrize("name", zoo.HF_TINY)
def test_tiny_models_match_eager(name, cpp, mode):
    _check(name, cpp, mode)


def test_llama_decoder_compiles_whole(monkeypatch):
    """The Llama graph (rotary embeddings, grouped-query attention, causal mask)
    once failed to plan: a copy shared by several readers put a hard constraint
    on the diagonal of the min cut ("hard constraint on the diagonal cannot be
    represented") and the whole graph ran eagerly. Strict mode makes any
    fallback an error; the C++ wrapper runs all of it in one segment."""
    model = zoo.build_hf("llama", tiny=True)
    fn = torch.compile(model, backend="cpu_layout", options={"cpp_wrapper": True})
    args = zoo.hf_inputs("llama", 1, 16)
    with torch.inference_mode():
        fn(*args)
        before = runtime.SegmentCall.calls
        got = fn(*args)
        torch.testing.assert_close(got, model(*args), rtol=1e-4, atol=1e-4)
    assert runtime.SegmentCall.calls - before == 1  # the mask is built in Python before it


@pytest.mark.parametrize("backend,wrapper", [("cpu_layout", "cpp"), ("cpu_layout_export", "cpp"), ("openvino", "default")])
def test_the_benchmark_harness_takes_token_ids_and_a_mask(backend, wrapper):
    """bench_models' huggingface suite: each variant is called with the tuple of inputs
    (OpenVINO converts the model with all of them) and computes eager's logits."""
    from cpu_layout import benchmark as B

    if backend == "openvino":
        pytest.importorskip("openvino")
    model, x = zoo.build_hf("bert", tiny=True), zoo.hf_inputs("bert", 2, 12)
    r = B.run_accuracy("bert", model, x, backend, wrapper=wrapper)
    assert r.status == "pass", r.reason
    c = B.compile_model(model, backend, wrapper=wrapper)
    xi = c.prepare_input(x)
    assert xi[0].dtype == torch.int64 and xi[1].dtype == torch.int64
    with torch.no_grad():
        torch.testing.assert_close(c(xi), model(*x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cpp", [False, True], ids=["python", "cpp"])
def test_a_layer_called_many_times_packs_its_weights_once(cpp):
    """ALBERT runs one layer module 6 times here: its weights are packed once each,
    not once per call site (ALBERT-xxlarge held 11 GB for 0.9 GB of parameters);
    a change in place still repacks them for every call site."""
    from cpu_layout import ops

    cfg = tf.AlbertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64,
                          embedding_size=16, num_hidden_layers=6, vocab_size=100)
    torch.manual_seed(0)
    model = zoo.HFModel(tf.AlbertForSequenceClassification(cfg).eval(), False).eval()
    fn = torch.compile(model, backend="cpu_layout", options={"cpp_wrapper": cpp})
    x = zoo.hf_inputs("bert", 2, 12)
    weights = [p for p in model.parameters() if p.dim() == 2 and p.shape[0] != cfg.vocab_size]
    with torch.no_grad():
        before = ops.cache_stats()["weight_reorders"]
        fn(*x)
        fn(*x)
        packed = ops.cache_stats()["weight_reorders"] - before
        assert 0 < packed <= len(weights)
        layer = model.model.albert.encoder.albert_layer_groups[0].albert_layers[0]
        layer.ffn.weight.mul_(2)  # every one of the 6 call sites must see it
        torch.testing.assert_close(fn(*x), model(*x), rtol=1e-4, atol=1e-4)


def test_gpt2_conv1d_weights_run_as_convs(compiled_graphs):
    """GPT-2's Conv1D is addmm(b, x, W) with W [in, out] as stored: a 1x1 conv on a
    transposed copy made once, not ATen's addmm (0.35x the conv's speed); an
    in-place change of W reaches the copy."""
    from cpu_layout import ir

    model = zoo.build_hf("gpt2", tiny=True)
    fn = torch.compile(model, backend="cpu_layout", options={"cpp_wrapper": True})
    x = zoo.hf_inputs("gpt2", 2, 12)
    with torch.no_grad():
        fn(*x)
        nodes = [m for c in compiled_graphs for n in c.cpu_layout_graph.nodes
                 for m in (n.members if isinstance(n, ir.Segment) else [n])]
        assert not [n for n in nodes if getattr(n, "target", None) is torch.ops.aten.addmm.default]
        assert sum(isinstance(n, ir.Conv) for n in nodes) >= 4 * 2  # 4 Conv1D per layer
        model.model.transformer.h[1].mlp.c_fc.weight.mul_(-1)
        torch.testing.assert_close(fn(*x), model(*x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cpp", [False, True], ids=["python", "cpp"])
@pytest.mark.parametrize("name", ["bert", "llama"])
def test_a_dynamic_sequence_length_compiles_once(name, cpp, compiled_graphs):
    """mark_dynamic on the sequence dim: new lengths run the one graph, eager's values
    and strides."""
    model = zoo.build_hf(name, tiny=True)
    fn = torch.compile(model, backend="cpu_layout", options={"cpp_wrapper": cpp})
    with torch.inference_mode():
        for seq in (12, 17, 20):
            args = zoo.hf_inputs(name, 2, seq)
            for t in args:
                torch._dynamo.mark_dynamic(t, 1)
            got, ref = fn(*args), model(*args)
            assert got.shape == ref.shape and got.stride() == ref.stride()
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert len(compiled_graphs) == 1
