"""Hugging Face format in and out for the ``kda`` component, against flash-linear-attention's own model.

fla's KDA model is built locally from its config class (``fla.models.KDAConfig``: no download) with random
weights. fla's kernels are Triton, and on a CPU-only machine its forward fails even with
``TRITON_INTERPRET=1`` ("0 active drivers"): :func:`fla_on_cpu` swaps them, inside these tests only, for fla's
own reference ops (``fla.ops.kda.naive.naive_recurrent_kda`` and the gates of ``fla.ops.kda.gate``) and plain
torch (a causal depthwise convolution, the RMSNorms, the SwiGLU), so what is compared is fla's layer and
model code with reference arithmetic, against megaseq's chunked KDA.

Checked: logits of an import equal fla's (fp32, relative 1e-5) on plain and packed rows; export of an import
gives back fla's tensors bitwise; a megaseq-trained model exported and loaded with transformers gives
megaseq's logits; import(export(m)) == m in both layouts, and the conformance check catches wrong mappings;
the Kimi-Linear layout (names and shapes only: its modeling code is on the Hub); bad input is one line,
exit status 2, nothing written.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import shutil
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from megaseq.cli import main
from megaseq.config import validate_recipe
from megaseq.contracts import ForwardContext
from megaseq.interop import InteropError
from megaseq.interop.files import read_tensors, same_tensors
from megaseq.model import build_model
from megaseq.plugins import get_plugins
from megaseq.train import checkpoint
from megaseq_testkit.hf import assert_round_trip

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fla warns that Triton falls back to the CPU
    import fla  # noqa: F401  (registers fla's models with transformers' Auto classes)
    from fla.models import KDAConfig, KDAForCausalLM
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM

VOCAB = ["<s>", "</s>", "<unk>", "x", "A", "C", "G", "T", "N", "y", "z", "w", "v", "u", "t", "s"]


# -- fla's model on CPU, with reference arithmetic -------------------------------------------------------
def _documents(cu_seqlens, x):
    if cu_seqlens is None:
        return [x]
    bounds = cu_seqlens.tolist()
    return [x[:, a:b] for a, b in itertools.pairwise(bounds)]


def _reference_kda(q, k, v, g, beta, A_log, dt_bias, lower_bound=None, cu_seqlens=None, **kwargs):
    """What chunk_kda / fused_recurrent_kda compute with the gate, beta and L2 norm in the kernel (fla's
    defaults in KimiDeltaAttention), by fla's reference ops."""
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda

    q, k = (t.float() * torch.rsqrt(t.float().square().sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    g = naive_kda_gate(g, A_log, dt_bias) if lower_bound is None else naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound)
    beta = beta.float().sigmoid()
    parts = zip(*(_documents(cu_seqlens, t) for t in (q, k, v, g, beta)), strict=True)
    return torch.cat([naive_recurrent_kda(*p)[0] for p in parts], 1).to(v.dtype), None


def _reference_conv(self, x, cache=None, output_final_state=False, cu_seqlens=None, **kwargs):
    out = []
    for part in _documents(cu_seqlens, x):
        y = F.conv1d(part.transpose(1, 2), self.weight, self.bias, padding=self.weight.shape[-1] - 1, groups=self.weight.shape[0])
        out.append(F.silu(y[..., : part.shape[1]]).transpose(1, 2))
    return torch.cat(out, 1), None


def _rms(x, weight, eps):
    return x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps) * weight.float()


def _reference_gated_norm(self, x, g, *args, **kwargs):
    return (_rms(x, self.weight, self.eps) * torch.sigmoid(g.float())).to(x.dtype)


def _reference_rmsnorm(self, x, residual=None, prenorm=False, *args, **kwargs):
    if residual is not None:
        x = x + residual
    y = _rms(x, self.weight, self.eps).to(x.dtype)
    return (y, x) if prenorm else y


def _reference_flash_attn(q, k, v, causal=True, window_size=(-1, -1), **kwargs):
    assert causal and tuple(window_size) == (-1, -1)
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)


def _reference_rotary(self, q, k, seqlen_offset=0, cu_seqlens=None, max_seqlen=None, **kwargs):
    """fla's rotary (non-interleaved: channel i with channel i + D/2) on positions 0..T-1."""
    assert cu_seqlens is None and seqlen_offset == 0
    angles = torch.arange(q.shape[1], dtype=torch.float32)[:, None] * self._compute_inv_freq()
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]

    def rotate(x):
        x1, x2 = x.float().chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    return rotate(q), rotate(k)


@contextlib.contextmanager
def fla_on_cpu():
    import fla.layers.attn as attn_layer
    import fla.layers.kda as kda_layer
    from fla.modules import FusedRMSNormGated, RMSNorm, RotaryEmbedding, ShortConvolution, mlp

    def swiglu_linear(x, y, weight, bias):
        return F.linear(F.silu(x) * y, weight, bias)

    with contextlib.ExitStack() as stack:
        for target, name, value in (
            (kda_layer, "chunk_kda", _reference_kda),
            (kda_layer, "fused_recurrent_kda", _reference_kda),
            (ShortConvolution, "forward", _reference_conv),
            (FusedRMSNormGated, "forward", _reference_gated_norm),
            (RMSNorm, "forward", _reference_rmsnorm),
            (mlp, "swiglu_linear", swiglu_linear),
            (attn_layer, "flash_attn_func", _reference_flash_attn),  # also lets fla build its Attention
            (RotaryEmbedding, "forward", _reference_rotary),
        ):
            stack.enter_context(mock.patch.object(target, name, value))
        yield


def fla_logits(model, tokens):
    with fla_on_cpu(), torch.no_grad():
        return model(tokens).logits.float()


def megaseq_logits(model, tokens, ctx=None):
    with torch.no_grad():
        return model.logits(model(tokens, ctx or ForwardContext())).float()


def relative(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# -- fixtures -----------------------------------------------------------------------------------------
def write_tokenizer(directory: Path, vocab: list[str] = VOCAB) -> None:
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tokenizer.save(str(directory / "tokenizer.json"))


def fla_model(directory: Path, *, lower_bound=None, tie=False, layers=2, softmax_layers=(), seed=0) -> KDAForCausalLM:
    """A random fla KDA model saved to ``directory`` with a character tokenizer holding A C G T N;
    ``softmax_layers``: layers of fla's softmax attention (4 heads of 8, rotary)."""
    torch.manual_seed(seed)
    attn = None
    if softmax_layers:
        attn = {"layers": list(softmax_layers), "num_heads": 4, "num_kv_heads": 4, "qkv_bias": False,
                "window_size": None, "rope_theta": 500.0}
    config = KDAConfig(
        hidden_size=32, head_dim=8, num_heads=2, num_hidden_layers=layers, vocab_size=len(VOCAB), hidden_ratio=4,
        norm_eps=1e-6, lower_bound=lower_bound, tie_word_embeddings=tie, attn=attn,
    )
    with fla_on_cpu():  # fla's Attention refuses to be built without flash-attn
        model = KDAForCausalLM(config).eval()
    with torch.no_grad():  # norms and gate biases away from their initial ones and zeros, so a swap shows
        for name, p in model.named_parameters():
            if p.dim() == 1 and "A_log" not in name and "dt_bias" not in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return model


def load_import(out: Path):
    plugins = get_plugins()
    path = checkpoint.resolve(out)
    recipe = validate_recipe(checkpoint.read_meta(path)["recipe"], plugins)
    model = build_model(recipe, plugins).eval()
    checkpoint.load_weights(path, model)
    return recipe, model


# -- equality with fla ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("lower_bound", "tie", "softmax_layers"),
    [(None, False, ()), (-5.0, True, ()), (None, False, (1,))],
    ids=["softplus-untied", "bounded-tied", "hybrid-softmax"],
)
def test_import_gives_fla_logits_plain_and_packed(tmp_path, lower_bound, tie, softmax_layers):
    fla = fla_model(tmp_path / "fla", lower_bound=lower_bound, tie=tie, layers=3, softmax_layers=softmax_layers)
    assert main(["import", str(tmp_path / "fla"), "--out", str(tmp_path / "imported")]) == 0
    recipe, model = load_import(tmp_path / "imported")
    assert recipe.data.token_ids == [4, 5, 6, 7, 8]
    assert recipe.component("attention", "kda").gate == ("softplus" if lower_bound is None else "bounded")
    assert recipe.model.layer_pattern == (["kda", "sdpa", "kda"] if softmax_layers else ["kda"])

    tokens = torch.randint(0, len(VOCAB), (2, 37))
    assert relative(megaseq_logits(model, tokens), fla_logits(fla, tokens)) < 1e-5

    lengths = [13, 1, 70, 7]  # one row of four documents, a single token and one longer than a 64-token chunk
    row = torch.randint(0, len(VOCAB), (1, sum(lengths)))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = megaseq_logits(model, row, ForwardContext(cu_seqlens=cu))
    separately = torch.cat([fla_logits(fla, doc) for doc in row.split(lengths, dim=1)], 1)
    assert relative(packed, separately) < 1e-5


def test_export_of_import_is_bitwise_fla(tmp_path):
    fla_model(tmp_path / "fla", layers=3, softmax_layers=(0,))
    assert main(["import", str(tmp_path / "fla"), "--out", str(tmp_path / "imported")]) == 0
    assert main(["export", str(tmp_path / "imported"), "--out", str(tmp_path / "exported"), "--format", "hf"]) == 0
    original, exported = read_tensors(tmp_path / "fla"), read_tensors(tmp_path / "exported")
    assert same_tensors(exported, original)
    # and sharded with an index, read back the same
    assert main(["export", str(tmp_path / "imported"), "--out", str(tmp_path / "sharded"), "--max-shard-gib", "0.00001"]) == 0
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert same_tensors(read_tensors(tmp_path / "sharded"), original)


def test_trained_model_exported_loads_in_transformers_with_the_same_logits(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[run]\nname = "t"\ndevice = "cpu"\nout_dir = "' + str(tmp_path / "run") + '"\n'
        '[data]\ntrain = "excerpt-chr20"\nheldout = "excerpt-chrX"\nseq_len = 48\n'
        '[model]\nd_model = 32\nn_layers = 2\nlayer_pattern = ["kda"]\ntie_embeddings = false\n'
        '[attention.kda]\nn_heads = 2\nhead_dim = 8\nnorm_eps = 1e-6\n'
        '[train]\nsteps = 2\nbatch_size = 2\nwarmup_steps = 1\n[eval]\nwindows = 2\nbatch_size = 2\n'
    )
    assert main(["train", str(recipe), "--no-progress"]) == 0
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded).__name__ == "KDAForCausalLM"
    _, ours = load_import(tmp_path / "run")
    tokens = torch.randint(0, 5, (2, 29))
    assert relative(megaseq_logits(ours, tokens), fla_logits(loaded, tokens)) < 1e-5


# -- the mapping conformance check -----------------------------------------------------------------------
def _recipe(raw_attention: dict, **model):
    base = {"model": {"d_model": 32, "n_layers": 2, "layer_pattern": ["kda"], "vocab_size": 16, **model},
            "attention": {"kda": {"n_heads": 2, "head_dim": 8, "norm_eps": 1e-6, **raw_attention}}, "ffn": {"swiglu": {"hidden": 64}}}
    return validate_recipe(base, get_plugins())


def test_round_trip_fla_and_kimi_layouts():
    assert_round_trip(_recipe({"gate": "bounded", "out_gate_bias": True}), get_plugins(), "kda")
    # fla's layout always has the output gate's bias: a kda without one comes back with a zero bias
    hybrid = validate_recipe({"model": {"d_model": 32, "n_layers": 3, "layer_pattern": ["kda", "sdpa"]},
                              "attention": {"kda": {"n_heads": 2, "head_dim": 8, "norm_eps": 1e-6, "out_gate_bias": True},
                                            "sdpa": {"n_heads": 4}}},
                             get_plugins())
    assert_round_trip(hybrid, get_plugins(), "kda")
    assert_round_trip(_recipe({"gate": "softplus"}, tie_embeddings=False), get_plugins(), "kimi_linear")


def test_an_all_sdpa_model_round_trips_in_flas_layout():
    """fla's layout holds a model of core's components alone (every layer in config.attn), through the
    mappings the layout carries for them."""
    recipe = validate_recipe({"model": {"d_model": 16, "n_layers": 2, "vocab_size": 5},
                              "attention": {"sdpa": {"n_heads": 2, "rope_theta": 100.0}}, "ffn": {"swiglu": {"hidden": 24}}},
                             get_plugins())
    assert_round_trip(recipe, get_plugins(), "kda")


def test_the_layouts_are_this_packages_and_found_by_model_type():
    from megaseq.interop.convert import layout_for, layout_named

    plugins = get_plugins()
    layouts = plugins.registry["hf_layout"]
    assert (layouts["kda"].plugin.dist, layouts["kimi_linear"].plugin.dist) == ("megaseq-attn-kda", "megaseq-attn-kda")
    assert layout_for({"model_type": "kda"}, plugins, "c").name == "kda"
    assert layout_for({"model_type": "kimi_linear"}, plugins, "c").name == "kimi_linear"
    assert layout_named(plugins, None).name == "kda"  # export's default
    with pytest.raises(InteropError, match="c: model_type 'llama' is not supported; Hugging Face layouts installed: kda "):
        layout_for({"model_type": "llama"}, plugins, "c")


def test_round_trip_catches_wrong_mappings(monkeypatch):
    import megaseq_kda.hf as kda_hf

    class SwapsQK(kda_hf.KDAMapping):
        def tensors_to_hf(self, state, config, dims, layout):
            out = super().tensors_to_hf(state, config, dims, layout)
            out["q_proj.weight"], out["k_proj.weight"] = out["k_proj.weight"], out["q_proj.weight"]
            return out

    class LosesEps(kda_hf.KDAMapping):
        def config_from_hf(self, hf, layout):
            return {**super().config_from_hf(hf, layout), "norm_eps": 1e-5}

    class LosesBias(kda_hf.KDAMapping):
        def tensors_to_hf(self, state, config, dims, layout):
            return {**super().tensors_to_hf(state, config, dims, layout), "g_proj.1.bias": torch.zeros(16)}

    recipe = _recipe({"out_gate_bias": True})
    for wrong, message in ((SwapsQK(), "changed"), (LosesEps(), "other logits"), (LosesBias(), "changed")):
        monkeypatch.setattr(kda_hf, "MAPPING", wrong)
        with pytest.raises(AssertionError, match=message):
            assert_round_trip(recipe, get_plugins(), "kda")
    monkeypatch.undo()

    import megaseq_kda.hf_layouts as layouts
    import megaseq_kda.hf_sdpa_swiglu as fla_hf

    class ForgetsThePairOrder(fla_hf.SDPAMapping):  # export without undoing import's row permutation
        def tensors_to_hf(self, state, config, dims, layout):
            q, k, v = state["qkv.weight"].view(4, 3, 8, 32).unbind(1)
            return {"q_proj.weight": q.reshape(32, 32), "k_proj.weight": k.reshape(32, 32), "v_proj.weight": v.reshape(32, 32),
                    "o_proj.weight": state["out.weight"]}

    monkeypatch.setitem(layouts.FLA.mappings, ("attention", "sdpa"), ForgetsThePairOrder())
    hybrid = validate_recipe({"model": {"d_model": 32, "n_layers": 2, "layer_pattern": ["kda", "sdpa"]},
                              "attention": {"kda": {"n_heads": 2, "head_dim": 8, "norm_eps": 1e-6, "out_gate_bias": True},
                                            "sdpa": {"n_heads": 4}}},
                             get_plugins())
    with pytest.raises(AssertionError, match="changed"):
        assert_round_trip(hybrid, get_plugins(), "kda")


# -- Kimi-Linear's layout ------------------------------------------------------------------------------
KIMI_NAMES = {
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
    "A_log", "dt_bias", "b_proj.weight", "f_a_proj.weight", "f_b_proj.weight", "g_a_proj.weight", "g_b_proj.weight",
    "o_norm.weight", "o_proj.weight",
}


def kimi_dir(tmp_path: Path, **config_changes) -> Path:
    """A Kimi-Linear-layout directory (all-KDA, dense MLPs) written by hand: names and shapes as published."""
    h, k, d, layers = 2, 8, 32, 2
    tensors = {"model.embed_tokens.weight": torch.randn(len(VOCAB), d), "model.norm.weight": torch.rand(d) + 0.5,
               "lm_head.weight": torch.randn(len(VOCAB), d)}
    shapes = {"q_proj.weight": (h * k, d), "k_proj.weight": (h * k, d), "v_proj.weight": (h * k, d),
              "q_conv1d.weight": (h * k, 1, 4), "k_conv1d.weight": (h * k, 1, 4), "v_conv1d.weight": (h * k, 1, 4),
              "A_log": (1, 1, h, 1), "dt_bias": (h * k,), "b_proj.weight": (h, d), "f_a_proj.weight": (k, d),
              "f_b_proj.weight": (h * k, k), "g_a_proj.weight": (k, d), "g_b_proj.weight": (h * k, k),
              "o_norm.weight": (k,), "o_proj.weight": (d, h * k)}
    assert set(shapes) == KIMI_NAMES
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({p + "self_attn." + n: 0.2 * torch.randn(s) for n, s in shapes.items()})
        tensors.update({p + "input_layernorm.weight": torch.rand(d) + 0.5, p + "post_attention_layernorm.weight": torch.rand(d) + 0.5})
        tensors.update({p + "mlp.gate_proj.weight": 0.2 * torch.randn(64, d), p + "mlp.up_proj.weight": 0.2 * torch.randn(64, d),
                        p + "mlp.down_proj.weight": 0.2 * torch.randn(d, 64)})
    config = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "hidden_size": d, "num_hidden_layers": layers,
        "vocab_size": len(VOCAB), "rms_norm_eps": 1e-6, "intermediate_size": 64, "hidden_act": "silu",
        "tie_word_embeddings": False, "num_experts": None, "moe_layer_freq": 1, "first_k_dense_replace": layers,
        "linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [], "num_heads": h, "head_dim": k, "short_conv_kernel_size": 4},
        **config_changes,
    }
    directory = tmp_path / "kimi"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    write_tokenizer(directory)
    return directory


def test_kimi_linear_layout_imports_and_exports_the_same_tensors(tmp_path):
    src = kimi_dir(tmp_path)
    assert main(["import", str(src), "--out", str(tmp_path / "imported")]) == 0
    assert main(["export", str(tmp_path / "imported"), "--out", str(tmp_path / "back"), "--layout", "kimi_linear"]) == 0
    assert same_tensors(read_tensors(tmp_path / "back"), read_tensors(src))
    _, model = load_import(tmp_path / "imported")
    kda = model.blocks[1].attention
    assert torch.equal(kda.A_log, read_tensors(src)["model.layers.1.self_attn.A_log"].reshape(2))


# -- bad input: one line, exit status 2, nothing written ---------------------------------------------------
def _fails(capsys, argv, out: Path, expect: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("megaseq: error: ") and expect in err, err
    assert not out.exists() and not any(p.name.startswith(".tmp-") for p in out.parent.iterdir())


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    src = tmp_path / "fla"
    fla_model(src)
    out = tmp_path / "out" / "imported"
    (tmp_path / "out").mkdir()

    def variant(name: str, change) -> Path:
        copy = tmp_path / name
        shutil.copytree(src, copy)
        change(copy)
        return copy

    def edit_config(**changes):
        def change(d: Path) -> None:
            config = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**config, **changes}))
        return change

    def truncate(d: Path) -> None:
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: len(data) // 2])

    def extra_tensor(d: Path) -> None:
        tensors = read_tensors(d)
        tensors["model.layers.0.attn.surprise.weight"] = torch.zeros(2)
        save_file(tensors, str(d / "model.safetensors"))

    cases = [
        (tmp_path / "empty", "no config.json"),
        (variant("truncated", truncate), "not a readable safetensors file"),
        (variant("llama", edit_config(model_type="llama")), "model_type 'llama' is not supported"),
        (variant("neg", edit_config(allow_neg_eigval=True)), "allow_neg_eigval = True is not supported"),
        (variant("gva", edit_config(num_v_heads=4)), "num_v_heads = 4 is not supported"),
        (variant("shape", edit_config(head_dim=4, num_heads=4)), "has shape"),
        (variant("unknown", extra_tensor), "unknown tensor model.layers.0.attn.surprise.weight"),
        (variant("no-g", lambda d: write_tokenizer(d, [t for t in VOCAB if t != "G"])), "no single-character token for 'G'"),
        (variant("mla", lambda d: None), ""),  # replaced below by a Kimi-Linear config with an MLA layer
    ]
    (tmp_path / "empty").mkdir()
    cases[-1] = (kimi_dir(tmp_path, linear_attn_config={"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2, "head_dim": 8,
                                                         "short_conv_kernel_size": 4}), "is an MLA layer")
    capsys.readouterr()  # what building the fixtures printed
    for directory, expect in cases:
        _fails(capsys, ["import", str(directory), "--out", str(out)], out, expect)

    # an existing output directory is neither used nor overwritten
    out.mkdir()
    (out / "keep").write_text("mine")
    assert main(["import", str(src), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and (out / "keep").read_text() == "mine"
    assert main(["export", str(tmp_path / "empty"), "--out", str(tmp_path / "out" / "x")]) == 2
    assert "not a megaseq checkpoint" in capsys.readouterr().err


# -- docs/hf-interop.md's walk-through, as written ----------------------------------------------------------
def test_walkthrough_runs(tmp_path, monkeypatch):
    import re
    import shlex

    doc = (Path(__file__).resolve().parents[3] / "docs" / "hf-interop.md").read_text()
    blocks = re.findall(r"```(python|bash)\n(.*?)```", doc, flags=re.S)
    assert [kind for kind, _ in blocks] == ["python", "bash"]
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0][1], "hf-interop.md", "exec"), {})
    commands = [line for line in blocks[1][1].splitlines() if line.strip()]
    assert [c.split()[1] for c in commands] == ["import", "train", "eval", "export"]
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "megaseq" and main(argv[1:]) == 0, command
    recipe, model = load_import(tmp_path / "kda-tuned")
    assert recipe.data.token_ids == [3, 4, 5, 6, 7] and checkpoint.resolve(tmp_path / "kda-tuned").name == "step_0000003"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "kda-tuned-hf").eval()
    tokens = torch.randint(0, 8, (1, 21))
    assert relative(megaseq_logits(model, tokens), fla_logits(loaded, tokens)) < 1e-5


# -- what reads an import: --resume, --init-from, the cached inference engine ---------------------------------
def test_resume_and_init_from_an_import_train_the_same_and_the_engine_scores_like_fla(tmp_path):
    from megaseq.builtins.config import CachedEngineConfig
    from megaseq.distributed.sharded import read_full_weights
    from megaseq.inference.cached import build as build_engine

    fla = fla_model(tmp_path / "fla")
    imported = tmp_path / "imported"
    assert main(["import", str(tmp_path / "fla"), "--out", str(imported)]) == 0
    short = ["--no-progress", "--set", "data.train=excerpt-chr20", "--set", "data.heldout=excerpt-chrX", "--set", "data.seq_len=32",
             "--set", "train.steps=1", "--set", "train.batch_size=2", "--set", "eval.windows=1", "--set", "eval.batch_size=1"]
    copy = tmp_path / "copy"
    shutil.copytree(imported, copy)
    recipe = str(imported / "recipe.toml")
    assert main(["train", recipe, "--init-from", str(imported), "--set", f"run.out_dir={tmp_path / 'tuned'}", *short]) == 0
    assert main(["train", recipe, "--resume", "--set", f"run.out_dir={copy}", *short]) == 0  # the import as its run

    def first_loss(run: Path) -> float:
        return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]

    assert first_loss(tmp_path / "tuned") == first_loss(copy)

    path = checkpoint.resolve(imported)
    recipe_obj = validate_recipe(checkpoint.read_meta(path)["recipe"], get_plugins())
    engine = build_engine(CachedEngineConfig(device="cpu"), recipe_obj, get_plugins())
    engine.update_weights(read_full_weights(path, checkpoint.read_meta(path)))
    tokens = torch.randint(0, len(VOCAB), (2, 23))
    expected = torch.log_softmax(fla_logits(fla, tokens), -1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    assert relative(engine.score(tokens), expected) < 1e-5


def test_the_hf_extra_brings_what_import_fla_needs():
    """fla's package imports triton at import time: an `[hf]` install without it could not load fla's models."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    names = {Requirement(r).name for r in meta["project"]["optional-dependencies"]["hf"]}
    assert {"flash-linear-attention", "triton"} <= names, names
