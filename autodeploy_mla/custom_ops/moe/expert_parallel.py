"""`torch.ops.autodeploy.ep_moe_experts`: expert-parallel MoE — each rank holds E/W routed experts.

The routing (gate, top-k) is computed on every rank; this op takes its result and the rank's
contiguous block of experts `[rank*El, (rank+1)*El)` (`w_up [El, 2I, H]`, `w_down [El, H, I]`, and
for block-FP8 experts their stacked scale grids) and returns what the whole MoE would: for every
token, the routing-weighted sum of its top-k experts' outputs, wherever those experts live.

Why an op and not graph surgery: the dispatch needs buffers sized from the token count and collectives
between them; one op keeps the graph static (one node per layer, a fake for shapes) and lets the
per-rank expert computation be any of the fused experts ops (`expert_backend`: the torch reference
or the Triton kernels, 16-bit or FP8).

Two collective schemes, both exact (every (token, expert) pair is computed once, by the expert's
owner, with the same expert op; only the order of the final fp32 sum over owners differs from one rank):

- `all_to_all` (dispatch + combine): per destination rank, the tokens with at least one pair there are
  packed (each token once, with its k ids made local to that rank — other ranks' ids become -1 — and
  its k weights); ids, weights and activations travel side by side in one byte buffer
  (`all_to_all_single`, ids as id + 1 so the zero bytes of an unfilled slot read as -1: no pair, and
  no count has to travel first); the owners run their experts on what they received and send the
  weighted rows back (a second `all_to_all_single`), and the sender sums each token's rows from
  its owners.
- `allgather_reducescatter`: every rank sees every token (all-gather), runs only its own experts
  (other ranks' ids become -1: no pair) and a reduce-scatter sums the partial outputs back to the
  tokens' ranks; with local tokens the rows (ids, weights, activations) travel packed in one all-gather.

No host synchronisation: splits are static (`capacity` rows per destination, equal for every rank),
never read from the exchanged counts, so the op is CUDA-graph capturable and its shapes follow the
token count only. The price is padding: every (source, destination) block is `capacity` rows, and
padded slots and other ranks' pairs carry id -1, which every experts op skips (no expert work, no
row in the sum).

`tokens` says where the tokens come from:
- `replicated` (tensor-parallel attention today: every rank holds the same T tokens): rank r takes
  its chunk of `ceil(T/W)` rows (rows past T are padding with no pairs), so the pairs are dispatched
  once, not W times; the chunks' outputs are all-gathered, so every rank returns all T rows. With
  `allgather_reducescatter` the first all-gather is skipped (every rank already has every token).
- `local` (data-parallel attention, `shard.attention: data`): x is this rank's own tokens; `capacity` is the per-rank
  token bound every rank pads to (0: every rank passes the same T). A rank with no tokens (T=0)
  still calls the op and takes part in every collective with padding only — an idle rank never
  blocks the others.
"""

from __future__ import annotations

from typing import Optional

import torch

from .backends import MOE_BACKENDS, experts_op

COLLECTIVES = ("all_to_all", "allgather_reducescatter")
TOKEN_MODES = ("replicated", "local")
_F = torch.ops._c10d_functional


def _wait(t: torch.Tensor) -> torch.Tensor:
    return _F.wait_tensor(t)


def check_ep_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_up: torch.Tensor,
                    num_experts: int, rank: int, world_size: int, collective: str, tokens: str, capacity: int,
                    expert_backend: str) -> tuple[int, int]:
    """(T, local experts) of a valid call; ValueError naming the value, the limit and what to do.
    T is returned as the shape gives it: in the fake it is the token count's symbol, and `int()` on it
    would specialise every compiled piece around this op to one token count (a recompile per bucket)."""
    name = "ep_moe_experts"
    if collective not in COLLECTIVES:
        raise ValueError(f"{name}: collective {collective!r} unknown; valid: {', '.join(COLLECTIVES)}")
    if tokens not in TOKEN_MODES:
        raise ValueError(f"{name}: tokens {tokens!r} unknown; valid: {', '.join(TOKEN_MODES)}")
    if expert_backend not in MOE_BACKENDS:
        raise ValueError(f"{name}: expert_backend {expert_backend!r} unknown; valid: {', '.join(MOE_BACKENDS)}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{name}: rank {rank} must be in [0, world_size={world_size})")
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"{name}: expected x [T, H], topk_ids and topk_weights [T, k]; got {tuple(x.shape)}, "
                         f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    local = int(w_up.shape[0])
    if local * world_size != num_experts:
        raise ValueError(f"{name}: this rank holds {local} experts and world_size={world_size}, so the model would "
                         f"have {local * world_size}, but num_experts={num_experts}; every rank must hold "
                         "num_experts / world_size experts (the shard pass slices them so)")
    # a symbolic T (shape propagation over the exported graph) is bounded by the runtime, not here
    if tokens == "local" and capacity and isinstance(x.shape[0], int) and x.shape[0] > capacity:
        raise ValueError(f"{name}: {x.shape[0]} tokens on rank {rank} exceed capacity={capacity}, the per-rank "
                         "token bound every rank pads to; raise it to the scheduler's max tokens per rank")
    return x.shape[0], local


def _local_experts(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                   w_up_scale: Optional[torch.Tensor], w_down_scale: Optional[torch.Tensor], block_n: int,
                   block_k: int, backend: str, activation: str) -> torch.Tensor:
    """The rank's experts on rows whose ids are local; -1 (another rank's expert, or padding) is no pair:
    every experts op skips negative ids (the torch references match no expert, the Triton layout
    never places them and their top-k sum leaves them out), so they cost no expert work."""
    if w_up_scale is not None:
        assert w_down_scale is not None
        return experts_op(backend, fp8=True)(x, ids, wts, w_up, w_up_scale, w_down, w_down_scale, block_n, block_k,
                                             activation)
    return experts_op(backend)(x, ids, wts, w_up, w_down, activation)


def _local_ids(ids: torch.Tensor, rank: int, local: int) -> torch.Tensor:
    """Expert ids as this rank's local indices; -1 for another rank's expert (and for padding, -1 already)."""
    mine = torch.div(ids, local, rounding_mode="floor") == rank  # -1 // local = -1: never a rank
    return torch.where(mine, ids - rank * local, torch.full_like(ids, -1))


def _all_to_all(t: torch.Tensor, world: int, group: str) -> torch.Tensor:
    """Equal blocks of dim 0 to every rank (static splits: no host sync)."""
    rows = t.shape[0] // world
    return _wait(_F.all_to_all_single(t.contiguous(), [rows] * world, [rows] * world, group))


def _pack(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[torch.dtype, int]]]:
    """The tensors' rows side by side as bytes ([..., B], B a multiple of 8), so ids, weights and
    activations travel in one collective instead of three. Widest dtypes first, so every part starts
    at a multiple of its element size and `_unpack` can view it without a copy."""
    order = sorted(range(len(parts)), key=lambda i: -parts[i].element_size())
    raw = [parts[i].contiguous().view(torch.uint8) for i in order]
    pad = -sum(r.shape[-1] for r in raw) % 8
    if pad:
        raw.append(raw[0].new_zeros(*raw[0].shape[:-1], pad))
    spec = [(p.dtype, p.shape[-1]) for p in parts]
    return torch.cat(raw, -1), spec


def _unpack(buf: torch.Tensor, spec: list[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """`_pack`'s parts back (views of `buf`), in the order they were given."""
    order = sorted(range(len(spec)), key=lambda i: -spec[i][0].itemsize)
    out: list[Optional[torch.Tensor]] = [None] * len(spec)
    at = 0
    for i in order:
        dtype, width = spec[i]
        out[i] = buf[..., at:at + width * dtype.itemsize].view(dtype)
        at += width * dtype.itemsize
    return out  # type: ignore[return-value]


def _dispatch_combine(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, local: int, world: int, group: str,
                      run) -> torch.Tensor:
    """all-to-all scheme for c = x.shape[0] rows (ids -1: no pair); returns the rows' outputs [c, H].
    Two collectives: the packed rows (ids, weights, activations in one byte buffer) out, the owners'
    weighted sums back. Rows a source did not fill are zero bytes, i.e. id -1 (ids travel as id + 1):
    no pair, so no count needs to travel with them."""
    c, h = x.shape
    k = ids.shape[1]
    dev = x.device
    dest = torch.where(ids >= 0, torch.div(ids, local, rounding_mode="floor"), torch.full_like(ids, -1))  # [c, k]
    ranks = torch.arange(world, device=dev).view(world, 1, 1)
    on = dest.unsqueeze(0) == ranks  # [W, c, k]: pair j of token t goes to rank d
    mask = on.any(-1)  # [W, c]: token t sends one row to rank d
    pos = mask.long().cumsum(1) - 1  # its slot among rank d's rows
    dump = world * c  # one extra slot that every unsent (d, t) writes to; dropped before sending
    slot = torch.where(mask, ranks.view(world, 1) * c + pos, torch.full_like(pos, dump)).reshape(-1)
    local_ids = torch.where(on, ids.unsqueeze(0) - ranks * local + 1, torch.zeros_like(on, dtype=ids.dtype))
    rows, spec = _pack([local_ids.to(torch.int32), wts.unsqueeze(0).expand(world, c, k),
                        x.unsqueeze(0).expand(world, c, h)])
    send = rows.new_zeros(dump + 1, rows.shape[-1]).index_copy_(0, slot, rows.reshape(-1, rows.shape[-1]))
    recv_i, recv_w, recv_x = _unpack(_all_to_all(send[:dump], world, group), spec)
    out_rows = run(recv_x.contiguous(), recv_i - 1, recv_w.contiguous())  # [W*c, H]: sums over my experts
    back = _all_to_all(out_rows, world, group)  # my rows' results, in my send layout
    gathered = back.index_select(0, slot.clamp(max=dump - 1) if dump else slot).view(world, c, h)
    return (gathered.float() * mask.unsqueeze(-1)).sum(0).to(x.dtype)


def _gather_scatter(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, rank: int, local: int, world: int,
                    group: str, run) -> torch.Tensor:
    """allgather_reducescatter scheme for local tokens: one all-gather of the packed rows, this rank's
    experts on every rank's rows, one reduce-scatter of the sums back to the rows' ranks."""
    packed, spec = _pack([ids.to(torch.int32), wts, x])
    ia, wa, xa = _unpack(_wait(_F.all_gather_into_tensor(packed, world, group)), spec)
    out = run(xa.contiguous(), _local_ids(ia, rank, local), wa.contiguous())
    return _wait(_F.reduce_scatter_tensor(out.contiguous(), "sum", world, group))


@torch.library.custom_op("autodeploy::ep_moe_experts", mutates_args=())
def ep_moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor, w_up_scale: Optional[torch.Tensor], w_down_scale: Optional[torch.Tensor],
                   num_experts: int, rank: int, world_size: int, group_name: str, collective: str = "all_to_all",
                   tokens: str = "replicated", capacity: int = 0, expert_backend: str = "torch", block_n: int = 0,
                   block_k: int = 0, activation: str = "silu") -> torch.Tensor:
    """MoE output for x's tokens [T, H] with the experts spread over `world_size` ranks (module doc)."""
    t, local = check_ep_inputs(x, topk_ids, topk_weights, w_up, num_experts, rank, world_size, collective, tokens,
                               capacity, expert_backend)
    w, g, h = world_size, group_name, x.shape[1]

    def run(xr: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        return _local_experts(xr, ids, wts, w_up, w_down, w_up_scale, w_down_scale, block_n, block_k,
                              expert_backend, activation)

    def pad(rows: int):
        extra = rows - t
        if not extra:
            return x, topk_ids, topk_weights
        return (torch.cat([x, x.new_zeros(extra, h)]), torch.cat([topk_ids, topk_ids.new_full((extra, topk_ids.shape[1]), -1)]),
                torch.cat([topk_weights, topk_weights.new_zeros(extra, topk_weights.shape[1])]))

    if tokens == "replicated":
        c = -(-t // w)  # this rank's chunk of the (same) tokens
        xp, ip, wp = pad(w * c)
        if collective == "all_to_all":
            sl = slice(rank * c, (rank + 1) * c)
            mine = _dispatch_combine(xp[sl], ip[sl], wp[sl], local, w, g, run)
        else:  # every rank has every token already: the all-gather is skipped
            mine = _wait(_F.reduce_scatter_tensor(run(xp, _local_ids(ip, rank, local), wp).contiguous(), "sum", w, g))
        return _wait(_F.all_gather_into_tensor(mine.contiguous(), w, g))[:t].contiguous()
    xp, ip, wp = pad(capacity or t)
    if collective == "all_to_all":
        return _dispatch_combine(xp, ip, wp, local, w, g, run)[:t].contiguous()
    return _gather_scatter(xp, ip, wp, rank, local, w, g, run)[:t].contiguous()


@ep_moe_experts.register_fake
def _(x, topk_ids, topk_weights, w_up, w_down, w_up_scale, w_down_scale, num_experts, rank, world_size, group_name,
      collective="all_to_all", tokens="replicated", capacity=0, expert_backend="torch", block_n=0, block_k=0,
      activation="silu"):
    check_ep_inputs(x, topk_ids, topk_weights, w_up, num_experts, rank, world_size, collective, tokens, capacity,
                    expert_backend)
    return x.new_empty(x.shape)


EP_MOE_EXPERTS = torch.ops.autodeploy.ep_moe_experts.default

__all__ = ["COLLECTIVES", "EP_MOE_EXPERTS", "TOKEN_MODES", "check_ep_inputs", "ep_moe_experts"]
