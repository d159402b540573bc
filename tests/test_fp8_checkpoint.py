"""FP8 checkpoints in the published formats (DeepSeek-V3 block scales; Mistral's per-tensor scales):
`optimize(ckpt_dir)` keeps the weights FP8 + scales and generates the greedy tokens of the HF model
with the dequantized weights (fp32, CPU); every loader error names the tensor or value."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from autodeploy_mla import optimize
from autodeploy_mla.config.schema import ModelConfig
from autodeploy_mla.custom_ops.fp8.format import BlockFP8Format, FP8FormatError
from autodeploy_mla.models.errors import ModelLoadError
from autodeploy_mla.models.fp8_modules import FP8Linear
from autodeploy_mla.models.loading import build_eager_model
from autodeploy_mla.testing.fp8_checkpoints import edit_checkpoint, reference_hf_model, write_fp8_checkpoint
from autodeploy_mla.testing.tiny_configs import TINY_CONFIGS, build_tiny_model
from autodeploy_mla.verify import hf_greedy_generate

CPU = torch.device("cpu")
RUNTIME = ["runtime.max_num_tokens=8", "runtime.page_size=4", "runtime.max_seq_len=64", "runtime.max_batch_size=4",
           "model.device=cpu", "model.dtype=float32"]
PROMPTS = [[5, 9, 200, 17], [3, 3, 8, 1, 90, 2, 7, 7, 7, 100, 11], [42]]
NEW = 6
#: hidden 200 and dense intermediate 96 are multiples of neither 128 nor 32, kv_b_proj's 176 rows
#: neither: partial edge blocks in rows and columns; the expert intermediate 128 is a whole block.
DIMS = {"hidden_size": 200, "intermediate_size": 96, "moe_intermediate_size": 128}


def _config(family: str) -> dict:
    cfg = copy.deepcopy(TINY_CONFIGS[family])
    cfg.update(DIMS)
    return cfg


def _write(tmp_path_factory, family: str, fmt: BlockFP8Format, shards: int = 1, name: str = "ckpt"):
    cfg = _config(family)
    out = tmp_path_factory.mktemp(name)
    ref = write_fp8_checkpoint(build_tiny_model(cfg), out, fmt, shards=shards)
    return out, reference_hf_model(build_tiny_model(cfg, seed=1), ref)


@pytest.fixture(scope="module")
def ds3_128(tmp_path_factory):
    return _write(tmp_path_factory, "deepseek_v3", BlockFP8Format(128, 128), shards=3, name="ds3_128")


@pytest.fixture(scope="module")
def ds3_32(tmp_path_factory):
    return _write(tmp_path_factory, "deepseek_v3", BlockFP8Format(32, 32), name="ds3_32")


@pytest.fixture(scope="module")
def mistral4(tmp_path_factory):
    return _write(tmp_path_factory, "mistral_small_4", BlockFP8Format(per_tensor=True, activation_scheme="static"),
                  name="mistral4")


def _published_layout(ckpt) -> None:
    """The checkpoint holds exactly the published names, dtypes and scale shapes."""
    from safetensors import safe_open

    cfg = json.loads((ckpt / "config.json").read_text())
    fmt = BlockFP8Format.from_quantization_config(cfg["quantization_config"])
    index = ckpt / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    seen = {}
    for f in files:
        with safe_open(str(ckpt / f), "pt") as h:
            for k in h.keys():
                seen[k] = h.get_tensor(k)
    assert seen["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert seen["lm_head.weight"].dtype == torch.bfloat16
    assert seen["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    w = seen["model.layers.1.mlp.experts.3.up_proj.weight"]
    assert w.dtype == torch.float8_e4m3fn and tuple(w.shape) == (128, 200)
    s = seen["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"]
    kv = seen["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"]
    if fmt.per_tensor:
        assert s.shape == () and kv.shape == ()
    else:
        bn, bk = fmt.block
        assert tuple(s.shape) == (-(-128 // bn), -(-200 // bk)) and s.dtype == torch.float32
        assert tuple(kv.shape) == (-(-176 // bn), -(-40 // bk))


def _check(om, hf):
    got = om.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True)
    want = [hf_greedy_generate(hf, p, NEW, ignore_eos=True) for p in PROMPTS]
    assert got == want
    return got


def _weights_stay_fp8(om) -> None:
    """Every decoder linear / expert weight in the compiled graph is FP8; the only 16-bit copy of an
    FP8 weight is kv_b_proj's (weight absorption)."""
    gm = om.gm
    params = dict(gm.named_parameters())
    fp8 = [n for n, p in params.items() if p.dtype == torch.float8_e4m3fn]
    assert any("experts.gate_up_proj" in n for n in fp8) and any("q_b_proj" in n for n in fp8)
    wide = [n for n, p in params.items() if p.dtype != torch.float8_e4m3fn and p.dim() >= 2
            and not n.endswith("_scale_inv")]
    for n in wide:
        assert any(k in n for k in ("embed_tokens", "lm_head", "mlp.gate.weight", "kv_b_proj.weight_dequantized",
                                    "norm")), n
    assert sum("kv_b_proj.weight_dequantized" in n for n in wide) == 2


@pytest.mark.parametrize("which", ["ds3_128", "ds3_32"])
def test_deepseek_v3_fp8_greedy_equals_hf_dequantized(which, request):
    ckpt, hf = request.getfixturevalue(which)
    _published_layout(ckpt)
    om = optimize(str(ckpt), overrides=RUNTIME)
    _check(om, hf)
    _weights_stay_fp8(om)
    mla = next(r for r in om.history if r.name == "match_mla")
    assert "2 attention blocks" in mla.summary


def test_eager_fp8_model_matches_hf_bitwise(ds3_32):
    ckpt, hf = ds3_32
    m = build_eager_model(ModelConfig(path=str(ckpt), device="cpu", dtype="float32"), CPU, torch.float32)
    assert isinstance(m.model.layers[0].self_attn.q_a_proj, FP8Linear)
    assert m.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
    assert m.model.layers[1].mlp.experts.down_proj_scale_inv.shape == (8, 7, 4)  # [E, ceil(200/32), 128/32]
    ids = torch.tensor([[5, 9, 100, 17, 3]])
    with torch.no_grad():
        assert torch.equal(m(input_ids=ids).logits, hf(input_ids=ids).logits)


def test_mistral_small_4_per_tensor_fp8(mistral4):
    ckpt, hf = mistral4
    _published_layout(ckpt)
    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert qc["activation_scheme"] == "static" and qc["weight_block_size"] is None
    om = optimize(str(ckpt), overrides=RUNTIME)
    _check(om, hf)
    _weights_stay_fp8(om)


# ----------------------------------------------------------------------------- loader errors
def _copy(src, tmp_path):
    import shutil

    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _load(ckpt):
    return build_eager_model(ModelConfig(path=str(ckpt), device="cpu", dtype="float32"), CPU, torch.float32)


@pytest.fixture(scope="module")
def one_file(tmp_path_factory):
    ckpt, _ = _write(tmp_path_factory, "deepseek_v3", BlockFP8Format(32, 32), name="one_file")
    return ckpt


def test_missing_scale_is_named(one_file, tmp_path):
    ckpt = _copy(one_file, tmp_path)
    edit_checkpoint(ckpt, drop=("model.layers.0.self_attn.o_proj.weight_scale_inv",))
    with pytest.raises(FP8FormatError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight.*float8_e4m3fn.*"
                                             r"o_proj\.weight_scale_inv is missing"):
        _load(ckpt)


def test_missing_expert_scale_is_named(one_file, tmp_path):
    ckpt = _copy(one_file, tmp_path)
    edit_checkpoint(ckpt, drop=("model.layers.1.mlp.experts.5.down_proj.weight_scale_inv",))
    with pytest.raises(FP8FormatError, match=r"experts\.5\.down_proj\.weight_scale_inv is missing"):
        _load(ckpt)


def test_misshapen_scale_is_named(one_file, tmp_path):
    ckpt = _copy(one_file, tmp_path)
    edit_checkpoint(ckpt, replace={"model.layers.0.self_attn.kv_b_proj.weight_scale_inv": torch.ones(3, 2)})
    with pytest.raises(FP8FormatError, match=r"kv_b_proj\.weight_scale_inv has shape \[3, 2\], expected \[6, 2\]"):
        _load(ckpt)


def test_block_size_that_disagrees_with_the_scales(one_file, tmp_path):
    ckpt = _copy(one_file, tmp_path)
    edit_checkpoint(ckpt, config={"weight_block_size": [64, 64]})
    with pytest.raises(FP8FormatError, match=r"weight_scale_inv has shape .* expected .*weight_block_size"):
        _load(ckpt)


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "gptq"}, r"quant_method 'gptq' is not supported"),
    ({"weight_block_size": [48, 128]}, r"block_n 48"),
    ({"weight_block_size": [128, 2048]}, r"block_k 2048"),
    ({"activation_scheme": "static"}, r"activation_scheme 'static' with weight_block_size"),
    ({"activation_scheme": "per-channel"}, r"activation_scheme 'per-channel' is not supported"),
])
def test_bad_quantization_config_is_refused_before_loading(one_file, tmp_path, qc, words):
    ckpt = _copy(one_file, tmp_path)
    edit_checkpoint(ckpt, config=qc)
    with pytest.raises(FP8FormatError, match=words) as e:
        _load(ckpt)
    assert str(ckpt) in str(e.value)  # names where the value came from


def test_fp8_weight_in_a_16_bit_model_is_refused(one_file, tmp_path):
    ckpt = _copy(one_file, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    from autodeploy_mla.models.skeleton import build_skeleton
    from autodeploy_mla.models.checkpoint import load_module_weights

    with pytest.raises(ModelLoadError, match=r"float8_e4m3fn, but the model takes it in 16 bits"):
        load_module_weights(build_skeleton(ModelConfig(path=str(ckpt)), CPU, torch.float32), CPU)


# ----------------------------------------------------------------------------- passes on FP8 graphs
def test_fuse_moe_runs_fp8_experts_on_their_fp8_weights(ds3_32):
    """fuse_moe (backend torch) swaps the FP8 experts region (dequantize + grouped GEMMs) for
    torch_moe_experts_fp8 on the FP8 weights and scales themselves; the tokens stay HF's."""
    ckpt, hf = ds3_32
    om = optimize(str(ckpt), overrides=[*RUNTIME, "transforms.fuse_moe.backend=torch"])
    rec = next(r for r in om.history if r.name == "fuse_moe")
    layer = rec.details["layers"][0]
    assert layer["backend"] == "torch" and layer["weights"] == "fp8 blocks [32, 32]", layer
    targets = {str(n.target) for n in om.gm.graph.nodes if n.op == "call_function"}
    assert any("torch_moe_experts_fp8" in t for t in targets), sorted(targets)
    # the shared expert (FP8, same blocks, fuse_gemms' [gate; up]) runs in the op as expert 8
    assert layer["shared_experts"].startswith("in the fused op as expert 8"), layer
    assert not any(n.target == "shared_experts" or "shared_experts" in str(n.target) for n in om.gm.graph.nodes
                   if n.op == "get_attr"), "the shared MLP's own weights left the graph"
    up = om.gm.get_parameter("model.model.layers.1.mlp.experts.w_up_with_shared")
    up_s = om.gm.get_parameter("model.model.layers.1.mlp.experts.w_up_scale_with_shared")
    assert up.dtype == torch.float8_e4m3fn and tuple(up.shape) == (9, 256, 200) and tuple(up_s.shape) == (9, 8, 7)
    _check(om, hf)


@pytest.mark.parametrize("extra, words", [
    (["transforms.fuse_gemms.enabled=false"], "in the fused op as expert 8"),  # separate gate and up linears
    (["transforms.fuse_moe.shared_experts=never"], "kept the model's shared MLP: fuse_moe.shared_experts is never"),
])
def test_fuse_moe_fp8_shared_expert(ds3_32, extra, words):
    ckpt, hf = ds3_32
    om = optimize(str(ckpt), overrides=[*RUNTIME, "transforms.fuse_moe.backend=torch", *extra])
    layer = next(r for r in om.history if r.name == "fuse_moe").details["layers"][0]
    assert layer["shared_experts"].startswith(words), layer
    _check(om, hf)


def test_fuse_moe_keeps_a_16_bit_shared_expert_of_fp8_experts(tmp_path):
    """Experts FP8, the shared MLP left bf16 in the checkpoint: they do not stack; kept, with the reason."""
    cfg = _config("deepseek_v3")
    shared = tuple(f"model.layers.1.mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
    ref = write_fp8_checkpoint(build_tiny_model(cfg), tmp_path, BlockFP8Format(32, 32), skip=shared)
    hf = reference_hf_model(build_tiny_model(cfg, seed=1), ref)
    om = optimize(str(tmp_path), overrides=[*RUNTIME, "transforms.fuse_moe.backend=torch"])
    layer = next(r for r in om.history if r.name == "fuse_moe").details["layers"][0]
    assert layer["shared_experts"] == ("kept the model's shared MLP: the experts are FP8 and the shared MLP's "
                                       "weights are not: they do not stack"), layer
    _check(om, hf)


def _shard_refusal(model_arg, overrides):
    """Run the pipeline as rank 0 of 2 on a weightless skeleton; the ShardError and the model."""
    from autodeploy_mla.api import build_config
    from autodeploy_mla.custom_ops import Target
    from autodeploy_mla.models.skeleton import build_skeleton, is_placeholder
    from autodeploy_mla.runtime.artifacts import TensorParallel
    from autodeploy_mla.transforms.context import BuildContext
    from autodeploy_mla.transforms.pass_manager import run_pipeline
    from autodeploy_mla.transforms.shard import ShardError

    cfg, pipe = build_config(model_arg, None, [*RUNTIME, *overrides, "transforms.shard.enabled=true"])
    model = build_skeleton(cfg.model, CPU, torch.float32)
    ctx = BuildContext(cfg, model, CPU, torch.float32, Target.detect(CPU, 4), TensorParallel(2, 0, "g"))
    with pytest.raises(ShardError) as e:
        run_pipeline(ctx, pipe)
    # refused at planning: no pass after shard ran, every weight is still a placeholder (none read)
    assert [r.name for r in ctx.history][-1] == "match_mla"
    assert all(is_placeholder(p) for p in model.parameters() if p.numel() > 1)
    return str(e.value)


def test_tensor_parallel_split_inside_an_fp8_block_is_refused(ds3_32):
    """Heads of 24 + 16 query rows: rank 0 of 2 would keep q_b_proj rows [0, 80), and 80 falls inside
    the 32-row block [64, 96). Refused naming the tensor, the boundary, the block and what works."""
    ckpt, _ = ds3_32
    msg = _shard_refusal(str(ckpt), [])
    assert "FP8 weight model.model.layers.0.self_attn.q_b_proj.weight [160, 48]" in msg, msg
    assert "rows [0, 80)" in msg and "boundary 80 falls inside the block of rows [64, 96)" in msg, msg
    assert "multiple of the block (32)" in msg and "block-aligned and divide the head count 4: 1." in msg, msg


def test_tensor_parallel_fp8_mlp_split_inside_a_block_is_refused():
    """Attention splits on blocks, the dense MLP's intermediate 96 does not (48 per rank): refused with
    the replicate alternative named."""
    cfg = {**_config("deepseek_v3"), "hidden_size": 64, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
           "v_head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 64,
           "quantization_config": BlockFP8Format(32, 32).to_quantization_config()}
    msg = _shard_refusal(None, [f"model.hf_config={json.dumps(cfg)}", "model.init=hashed"])
    assert "model.model.layers.0.mlp.gate_proj.weight [96, 64]" in msg and "boundary 48" in msg, msg
    assert "transforms.shard.mlp=replicate" in msg, msg


def _fuse_gemms_groups(om) -> list[dict]:
    return next(r for r in om.history if r.name == "fuse_gemms").details["groups"]


def test_fuse_gemms_keeps_fp8_groups_whose_blocks_would_straddle(ds3_32):
    """q_a_proj (48 rows) and kv_a_proj_with_mqa (56) both end inside a 32-row block: kept, the
    report says why; the gated MLPs (96 and 128 rows: whole blocks) fuse."""
    ckpt, _ = ds3_32
    om = optimize(str(ckpt), overrides=RUNTIME)
    groups = _fuse_gemms_groups(om)
    qa = next(g for g in groups if any(m.endswith("q_a_proj") for m in g["members"]))
    assert "fused_weight" not in qa and "do not end on a block_n (32) boundary" in qa["reason"], qa
    assert "q_a_proj (N 48)" in qa["reason"] and "kv_a_proj_with_mqa (N 56)" in qa["reason"], qa
    mlps = [g for g in groups if any(m.endswith("gate_proj") for m in g["members"])]
    assert len(mlps) == 2 and all(g.get("block") == [32, 32] and "FP8" in g["reason"] for g in mlps), mlps


@pytest.fixture(scope="module")
def ds3_fusable(tmp_path_factory):
    """q_lora_rank 64 (two whole 32-blocks) + kv_a 56 rows (partial, goes last): fusable."""
    cfg = {**_config("deepseek_v3"), "q_lora_rank": 64}
    out = tmp_path_factory.mktemp("ds3_fusable")
    ref = write_fp8_checkpoint(build_tiny_model(cfg), out, BlockFP8Format(32, 32))
    return out, reference_hf_model(build_tiny_model(cfg, seed=1), ref)


def test_fuse_gemms_fuses_fp8_linears_into_one_fp8_linear(ds3_fusable):
    """q_a + kv_a and gate + up of FP8 checkpoints become one fp8_block_linear each (weights and
    scale rows concatenated); greedy tokens stay HF's with the dequantized weights."""
    from autodeploy_mla.custom_ops.fp8.linear import FP8_LINEAR

    ckpt, hf = ds3_fusable
    om = optimize(str(ckpt), overrides=[*RUNTIME, "transforms.resolve_fp8_linear.enabled=false"])
    groups = _fuse_gemms_groups(om)
    fused = [g for g in groups if "fused_weight" in g]
    assert len(fused) == len(groups) == 4, groups  # 2 x (q_a + kv_a), the dense and the shared gate + up
    qa = [g for g in fused if g["members"][-1].endswith("kv_a_proj_with_mqa")]
    assert len(qa) == 2 and all(g["members"][0].endswith("q_a_proj") and g["out_features"] == [64, 56] for g in qa)
    assert all("FP8" in g["reason"] and g["block"] == [32, 32] for g in fused)
    gm = om.gm
    scale = gm.get_parameter(qa[0]["fused_scale"])
    assert gm.get_parameter(qa[0]["fused_weight"]).shape == (120, 200) and scale.shape == (4, 7)  # 2 + ceil(56/32)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is FP8_LINEAR
             and n.args[1].target == qa[0]["fused_weight"]]
    assert len(nodes) == 1 and nodes[0].args[2].target == qa[0]["fused_scale"]
    _check(om, hf)
    _weights_stay_fp8(om)


def test_hashed_fp8_init_is_fp8_and_sliceable():
    """`model.init: hashed` with a quantization_config: FP8 weights generated directly (per
    selection: a slice equals the same slice of the whole), and the model builds and generates."""
    from autodeploy_mla.models.fp8_modules import hashed_fp8_tensor
    from autodeploy_mla.models.random_init import HashedInit

    init = HashedInit(seed=3, std=0.02, kinds={})
    whole = hashed_fp8_tensor(init.tensor, "w", (8, 200, 96), torch.float8_e4m3fn, CPU, None, (32, 32), 0.02)
    part = hashed_fp8_tensor(init.tensor, "w", (8, 200, 96), torch.float8_e4m3fn, CPU,
                             (None, ((32, 64), (100, 120)), None), (32, 32), 0.02)
    assert whole.dtype == torch.float8_e4m3fn and whole.float().abs().max() > 400
    assert torch.equal(part.view(torch.uint8), torch.cat([whole[:, 32:64], whole[:, 100:120]], 1).view(torch.uint8))
    cfg = _config("deepseek_v3")
    cfg["quantization_config"] = BlockFP8Format(32, 32).to_quantization_config()
    om = optimize(None, {"model": {"hf_config": cfg, "init": "hashed"}}, overrides=RUNTIME)
    assert om.eager_model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert len(om.generate(PROMPTS[:1], max_new_tokens=3, ignore_eos=True)[0]) == 3
