"""The attention router (issue 43): routes chosen from declared facts, recorded per step, set from the
`attention:` config section; and the routes of representative steps equal what the code chose before
the router existed."""

from __future__ import annotations

import pytest
import torch

from autodeploy_mla.config import load_config
from autodeploy_mla.custom_ops import MLADims, get_backend
from autodeploy_mla.custom_ops.attention.registry import SessionSpec, StepDescriptor, Target, policies_for
from autodeploy_mla.custom_ops.attention.router import RouteLog, route_decode
from autodeploy_mla.custom_ops.flashinfer.mla import FlashInferPolicy
from autodeploy_mla.custom_ops.triton_mla import TritonPolicy
from autodeploy_mla.custom_ops.triton_mla.step_shape import StepShape
from autodeploy_mla.custom_ops.triton_mla.tuning import FA3_PREFILL_MIN_TOKENS, choose_prefill_path
from autodeploy_mla.runtime.page_allocator import PageAllocator
from autodeploy_mla.runtime.sequence_info import SequenceInfo, StepSequence
from autodeploy_mla.testing.fake_flashinfer import install_fake_flashinfer

#: step name -> (cached, new) tokens per sequence (prefill first, decode last)
STEPS = {
    "decode_b1": [(1024, 1)],
    "decode_b32": [(1024, 1)] * 32,
    "prefill_2048": [(0, 2048)],
    "prefill_512": [(0, 512)],
    "mixed_128_plus_32dec": [(0, 128)] + [(1024, 1)] * 32,
    "chunk_512_on_3584": [(3584, 512)],
    "chunk_16_on_4096": [(4096, 16)],
}
#: (N, step) -> (backend running a flashinfer_mla node's step, the Triton prefill path, FA3 attention
#: where FA3 is available). Computed with the code BEFORE the router (commit cdf2037:
#: FlashInferMLASession.prepare's fallback decisions on an SM90 fake with FlashInfer 0.7.2 and Triton
#: 3.6, default policies; tuning.choose_prefill_path; FA3_PREFILL_MIN_TOKENS) and hard-coded here.
EXPECTED = {
    (16, "decode_b1"): ("triton", None, False),
    (16, "decode_b32"): ("flashinfer_mla", None, False),
    (16, "prefill_2048"): ("triton", "expand", True),
    (16, "prefill_512"): ("flashinfer_mla", "expand", False),
    (16, "mixed_128_plus_32dec"): ("flashinfer_mla", "expand", False),
    (16, "chunk_512_on_3584"): ("flashinfer_mla", "expand", False),
    (16, "chunk_16_on_4096"): ("flashinfer_mla", "absorb", False),
    (128, "decode_b1"): ("triton", None, False),
    (128, "decode_b32"): ("flashinfer_mla", None, False),
    (128, "prefill_2048"): ("triton", "expand", True),
    (128, "prefill_512"): ("flashinfer_mla", "expand", False),
    (128, "mixed_128_plus_32dec"): ("flashinfer_mla", "expand", False),
    (128, "chunk_512_on_3584"): ("triton", "expand", False),
    (128, "chunk_16_on_4096"): ("flashinfer_mla", "absorb", False),
}


def _prepare(info: SequenceInfo, seqs):
    alloc = PageAllocator(4000, 64, info.max_pages_per_seq)
    alloc.ensure_many({i: c + k for i, (c, k) in enumerate(seqs)})
    info.prepare_step([StepSequence(i, [0] * k, c) for i, (c, k) in enumerate(seqs)], alloc.pages_of)
    decode_only = all(k == 1 and c > 0 for c, k in seqs)
    return StepDescriptor(info.num_tokens, info.num_padded_tokens, len(seqs), decode_only)


@pytest.mark.parametrize("n", [16, 128])
def test_routes_equal_the_old_choices(monkeypatch, n):
    install_fake_flashinfer(monkeypatch, "0.7.2", (9, 0))
    fake = Target.detect("cpu", 64)
    target = Target(fake.device, {**fake.versions, "triton": "3.6.0"}, 64)
    dims = MLADims(n, 128, 64, 128, 512)
    info = SequenceInfo(64, 4096, 8192, 64, "cpu")
    spec = SessionSpec((dims,), torch.bfloat16, torch.device("cpu"), target, 64, 4096, info.max_pages_per_seq,
                       (torch.bfloat16,))
    sess = get_backend("flashinfer_mla").setup(spec)
    for name, seqs in STEPS.items():
        sess.prepare(info, _prepare(info, seqs))
        route = sess.routes.trace[-1][2]
        shape = StepShape.from_host(info.get("batch_info_host"), info.get("max_seq_info_host"),
                                    info.get("cu_seqlen_host"), info.get("input_pos_host"))
        path = choose_prefill_path(dims, shape.n_pre_tok, shape.prefix, shape.pairs) if shape.n_pre else None
        fa3 = bool(shape.n_pre) and path == "expand" and shape.max_q >= FA3_PREFILL_MIN_TOKENS
        assert (route.backend, path, fa3) == EXPECTED[(n, name)], (name, route)
        assert (route.backend != "flashinfer_mla") == bool(sess.step.fallback)  # the route is what runs
    counts = sess.routes.to_dict()["counts"]
    assert sum(counts.values()) == len(STEPS) and sess.routes.steps == len(STEPS)
    # the fallback (Triton) session, prepared for every handed step, recorded its own prefill path
    tri = sess.fallback_sessions["triton"].routes.to_dict()
    handed_prefills = sum(1 for (m, s), v in EXPECTED.items() if m == n and v[0] == "triton" and v[1])
    assert sum(c for k, c in tri["counts"].items() if k.startswith("prefill:triton:expand")) == handed_prefills


def test_node_paths_name_both_paths_with_reasons(monkeypatch):
    install_fake_flashinfer(monkeypatch, "0.7.2", (9, 0))
    fake = Target.detect("cpu", 64)
    target = Target(fake.device, {**fake.versions, "triton": "3.6.0"}, 64)
    d16, d20 = MLADims(16, 128, 64, 128, 512), MLADims(20, 192, 64, 256, 512)
    spec = SessionSpec((d16, d20), torch.bfloat16, torch.device("cpu"), target, 8, 256, 64)
    sess = get_backend("flashinfer_mla").setup(spec)
    p16, p20 = sess.paths(d16), sess.paths(d20)
    assert p16.decode.backend == "flashinfer_mla" and "decode_fallback_max_seqs" in p16.decode.reason
    assert p16.prefill.backend == "flashinfer_mla" and "estimated cost" in p16.prefill.reason
    assert p20.prefill.backend == "triton" and "query tile" in p20.prefill.reason  # N=20: safety handoff
    tri = get_backend("triton").setup(SessionSpec((d16,), torch.bfloat16, torch.device("cpu"), target, 8, 256, 64))
    tp = tri.paths(d16).to_dict()
    assert tp["decode"]["backend"] == tp["prefill"]["backend"] == "triton" and "cost rule" in tp["prefill"]["reason"]


def test_route_log_is_bounded_and_counts_every_step():
    log = RouteLog(trace_steps=2)
    for k in range(5):
        log.next_step()
        log.record("c", route_decode("flashinfer_mla", "triton", k, 1, ("triton",)))
    d = log.to_dict()
    assert d["steps"] == 5 and len(d["trace"]) == 2 and d["trace"][-1]["step"] == 5
    assert d["counts"] == {"decode:triton:handoff": 2, "decode:flashinfer_mla:absorbed": 3}
    with pytest.raises(ValueError, match="trace_steps=-1"):
        RouteLog(-1)


def test_attention_config_section_sets_policies():
    cfg = load_config(overrides=["attention.flashinfer_mla.decode_fallback_max_seqs=0",
                             "attention.triton.prefill_mode=absorb"])
    sections = cfg.attention.set_fields()
    assert sections == {"flashinfer_mla": {"decode_fallback_max_seqs": 0}, "triton": {"prefill_mode": "absorb"}}
    pol = policies_for(sections)
    assert pol["flashinfer_mla"] == FlashInferPolicy(decode_fallback_max_seqs=0)
    assert pol["triton"] == TritonPolicy(prefill_mode="absorb")
    override = FlashInferPolicy(prefill="flashinfer")
    assert policies_for(sections, {"flashinfer_mla": override})["flashinfer_mla"] is override  # Python wins
    assert policies_for(load_config().attention.set_fields()) == {}  # nothing set: backend defaults
    with pytest.raises(Exception, match="decode_fallback_max_seqs"):
        load_config(overrides=["attention.flashinfer_mla.decode_fallback_max_seqs=-1"])
    with pytest.raises(Exception, match="not_a_knob"):
        load_config(overrides=["attention.triton.not_a_knob=1"])


def test_handed_off_steps_run_with_the_models_policy_of_the_handoff_backend(monkeypatch):
    """A flashinfer_mla node that hands steps to Triton makes Triton's session with the model's
    `attention.triton` policy (through the runner's SessionSpec.peer_policies), not Triton's default."""
    install_fake_flashinfer(monkeypatch, "0.7.2", (9, 0))
    fake = Target.detect("cpu", 64)
    target = Target(fake.device, {**fake.versions, "triton": "3.6.0"}, 64)
    dims = MLADims(16, 128, 64, 128, 512)
    pol = policies_for(load_config(overrides=["attention.triton.prefill_mode=absorb"]).attention.set_fields())
    spec = SessionSpec((dims,), torch.bfloat16, torch.device("cpu"), target, 8, 256, 64,
                       peer_policies=tuple(pol.items()))
    sess = get_backend("flashinfer_mla").setup(spec)
    assert sess.fallback_sessions["triton"].policy == TritonPolicy(prefill_mode="absorb")
    plain = get_backend("flashinfer_mla").setup(SessionSpec((dims,), torch.bfloat16, torch.device("cpu"), target, 8,
                                                           256, 64))
    assert plain.fallback_sessions["triton"].policy == TritonPolicy()


def test_config_sections_mirror_the_policies():
    """Every policy knob (except the cost facts, a measured table) is in its config section with the same
    default, so a config that sets nothing builds the backend's default policy."""
    from dataclasses import fields

    from autodeploy_mla.config.schema import AttentionConfig

    for name, section in AttentionConfig.model_fields.items():
        policy_type = get_backend(name).policy_type
        default = policy_type()
        knobs = {f.name for f in fields(policy_type)} - {"prefill_cost"}
        assert knobs == set(section.annotation.model_fields), name
        built = policy_type(**{k: tuple(v) if isinstance(v, list) else v
                               for k, v in section.annotation().model_dump().items()})
        assert built == default, name


def test_trtllm_paths_hand_prefill_off(monkeypatch):
    install_fake_flashinfer(monkeypatch, "0.7.2", (10, 0))
    fake = Target.detect("cpu", 64)
    target = Target(fake.device, {**fake.versions, "triton": "3.6.0"}, 64)
    d = MLADims(16, 128, 64, 128, 512)
    sess = get_backend("flashinfer_trtllm_mla").setup(
        SessionSpec((d,), torch.bfloat16, torch.device("cpu"), target, 8, 256, 64))
    p = sess.paths(d)
    assert p.decode.backend == "flashinfer_trtllm_mla" and p.prefill.backend == "triton"
    assert "handed off" in p.prefill.reason
