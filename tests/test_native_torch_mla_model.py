"""A model whose own code calls torch_mla: no matching needed, and the softmax scale must survive
cache insertion whether the model passes it positionally or by keyword (DESIGN §6)."""

import pytest
import torch
from torch import nn

from autodeploy_mla import optimize
from autodeploy_mla.custom_ops.attention.registry import get_backend

SMALL = ["runtime.max_num_tokens=6", "runtime.page_size=4", "runtime.max_seq_len=40", "model.device=cpu"]


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE on the last dim of x [B,S,H,D] at positions pos [B,S]."""
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos[..., None].float() * inv  # [B,S,D/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, :, None], torch.cat([ang.sin(), ang.sin()], -1)[:, :, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class NativeMLALM(nn.Module):
    def __init__(self, scale: float, by_keyword: bool, vocab=64, hidden=32, n=2, dn=8, dr=4, dv=6, r=12, layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.config = type("Cfg", (), {"vocab_size": vocab, "num_hidden_layers": layers})()
        self.n, self.dn, self.dr, self.dv, self.r = n, dn, dr, dv, r
        self.scale, self.by_keyword = scale, by_keyword
        self.emb = nn.Embedding(vocab, hidden)
        self.q = nn.ModuleList(nn.Linear(hidden, n * (dn + dr), bias=False) for _ in range(layers))
        self.kv_a = nn.ModuleList(nn.Linear(hidden, r + dr, bias=False) for _ in range(layers))
        self.kv_b = nn.ParameterList(nn.Parameter(torch.randn(n * (dn + dv), r) / r**0.5) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(n * dv, hidden, bias=False) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, position_ids=None, use_cache=False):
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s).expand(b, s)
        x = self.emb(input_ids)
        for q_proj, kv_a, w, o in zip(self.q, self.kv_a, self.kv_b, self.o):
            q = q_proj(x).view(b, s, self.n, self.dn + self.dr)
            q_nope, q_pe = q.split([self.dn, self.dr], -1)
            ckv, kpe = kv_a(x).split([self.r, self.dr], -1)
            q_pe, kpe = _rope(q_pe, position_ids), _rope(kpe[:, :, None], position_ids)
            if self.by_keyword:
                a = torch.ops.autodeploy.torch_mla(q_nope, q_pe, ckv, kpe, w, is_causal=True, scale=self.scale)
            else:
                a = torch.ops.autodeploy.torch_mla(q_nope, q_pe, ckv, kpe, w, True, self.scale)
            x = x + o(a.reshape(b, s, self.n * self.dv))
        return self.head(x)


@torch.no_grad()
def _greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("by_keyword", [True, False])
def test_native_model_generates_with_its_scale(by_keyword):
    model = NativeMLALM(scale=1.7, by_keyword=by_keyword).eval()
    om = optimize(model, overrides=SMALL)
    assert om.report()["passes"][1]["summary"].endswith("(native)")
    nodes = [n for n in om.gm.graph.nodes if "mla_backend" in n.meta]
    assert len(nodes) == 2
    assert all(n.args[-1] == pytest.approx(1.7) for n in nodes)  # the constant after the cache
    assert all(get_backend(n.meta["mla_backend"].backend).constants for n in nodes)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [7, 7], [10, 20, 30, 40]]
    assert om.generate(prompts, max_new_tokens=5) == [_greedy(model, p, 5) for p in prompts]
    # logits match the model's own, and differ clearly from the default scale's: a dropped scale fails
    default = NativeMLALM(scale=None, by_keyword=by_keyword).eval()
    with torch.no_grad():
        ref, ref_default = model(torch.tensor([prompts[0]]))[0], default(torch.tensor([prompts[0]]))[0]
    ours = om.prefill_logits(prompts[0])
    assert (ours - ref).abs().max() < 1e-5
    assert (ours - ref_default).abs().max() > 1e-3
