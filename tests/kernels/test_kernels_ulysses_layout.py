"""Ulysses layout kernels: against the definition, the torch reference, a simulated all-to-all,
and autograd."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from dcp_compile.kernels import pack_for_heads, pack_for_sequence, unpack_from_heads
from dcp_compile.kernels import ulysses_layout_reference as reference


def chunk_lengths(seq: int, sp: int) -> list[int]:
    """Rank j holds (S + P - 1 - j) // P tokens: uneven chunks, longer ones first."""
    return [(seq + sp - 1 - j) // sp for j in range(sp)]


@dataclass(frozen=True)
class HeadMap:
    """One way the pass lays heads out over ranks."""

    name: str
    num_heads: int
    hp: int
    index: Optional[list[int]]  # None: identity (slots >= num_heads are padding)


def head_maps(sp: int) -> list[HeadMap]:
    maps = [HeadMap("even", 2 * sp, 2, None)]
    # H % P != 0: pad to Hp = ceil(H / P) heads per rank, last slots are -1.
    heads = 2 * sp - 1 if sp > 1 else 3
    hp = -(-heads // sp) + (1 if sp == 1 else 0)  # P=1: pad one extra slot to still test padding
    maps.append(HeadMap("padded", heads, hp, [h if h < heads else -1 for h in range(sp * hp)]))
    maps.append(HeadMap("padded-identity", heads, hp, None))
    # GQA, fewer KV heads than ranks: each rank gets a copy of the KV head its query heads use.
    kv = max(1, sp // 2)
    maps.append(HeadMap("gqa-replicated", kv, 1, [j * kv // sp for j in range(sp)]))
    # Replication with two slots per rank and a padding slot mixed in.
    maps.append(HeadMap("gqa-mixed", 2, 2, ([0, 0, 1, -1] * sp)[: 2 * sp]))
    return maps


CASES = [(sp, m) for sp in (1, 2, 4) for m in head_maps(sp)]
CASE_IDS = [f"sp{sp}-{m.name}" for sp, m in CASES]


def index_tensor(m: HeadMap) -> Optional[torch.Tensor]:
    return None if m.index is None else torch.tensor(m.index, dtype=torch.int64)


def slot_sources(m: HeadMap, sp: int) -> list[int]:
    if m.index is not None:
        return list(m.index)
    return [k if k < m.num_heads else -1 for k in range(sp * m.hp)]


def pack_by_definition(x: torch.Tensor, sp: int, m: HeadMap) -> torch.Tensor:
    """send[j, s, b, h, d] = x[b, src(j*Hp+h), s, d], written as loops over the definition."""
    batch, _, seq, dim = x.shape
    send = torch.zeros(sp, seq, batch, m.hp, dim, dtype=x.dtype)
    for slot, src in enumerate(slot_sources(m, sp)):
        if src >= 0:
            send[slot // m.hp, :, :, slot % m.hp, :] = x[:, src].permute(1, 0, 2).cpu()
    return send


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("sp", "m"), CASES, ids=CASE_IDS)
def test_pack_for_heads_matches_definition(device, sp: int, m: HeadMap, dtype: torch.dtype) -> None:
    seq = 5  # uneven on purpose for sp 2 and 4
    x = torch.randn(2, m.num_heads, seq, 8, device=device).to(dtype)
    send = pack_for_heads(x, sp, m.hp, index_tensor(m))
    assert send.shape == (sp, seq, 2, m.hp, 8) and send.is_contiguous()
    assert torch.equal(send.cpu(), pack_by_definition(x, sp, m))
    assert torch.equal(send, reference.pack_for_heads(x, sp, m.hp, index_tensor(m)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(("sp", "m"), CASES, ids=CASE_IDS)
def test_unpack_from_heads_matches_reference(device, sp: int, m: HeadMap, dtype: torch.dtype) -> None:
    recv = torch.randn(sp, 3, 2, m.hp, 8, device=device).to(dtype)
    out = unpack_from_heads(recv, m.num_heads)
    expected = recv.permute(2, 0, 3, 1, 4).reshape(2, sp * m.hp, 3, 8)[:, : m.num_heads]
    assert out.shape == (2, m.num_heads, 3, 8) and out.is_contiguous()
    assert torch.equal(out, expected)
    # With a head map it is the adjoint of the gather: replicated slots sum up.
    summed = unpack_from_heads(recv, m.num_heads, head_index=index_tensor(m))
    ref = reference.unpack_from_heads(recv, m.num_heads, index_tensor(m))
    torch.testing.assert_close(summed, ref, rtol=1e-3, atol=1e-3)


def test_unpack_sums_replicated_slots_by_definition() -> None:
    recv = torch.arange(4 * 2 * 1 * 1 * 2, dtype=torch.float32).view(4, 2, 1, 1, 2)
    out = unpack_from_heads(recv, 2, head_index=torch.tensor([0, 0, 1, -1]))
    assert torch.equal(out[0, 0], recv[0, :, 0, 0] + recv[1, :, 0, 0])
    assert torch.equal(out[0, 1], recv[2, :, 0, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_pack_for_sequence_any_strides(device, dtype: torch.dtype) -> None:
    base = torch.randn(2, 7, 3, 8, device=device).to(dtype)  # [B, S, H, D] storage
    out = base.transpose(1, 2)  # [B, H, S, D] view with non-SDPA strides
    send = pack_for_sequence(out)
    assert send.shape == (7, 2, 3, 8) and send.is_contiguous()
    assert torch.equal(send, out.permute(2, 0, 1, 3))


def simulated_all_to_all(sends: list[torch.Tensor], send_splits: list[list[int]]) -> list[torch.Tensor]:
    """rank r receives, concatenated in rank order, block r of every rank's dim-0 split."""
    sp = len(sends)
    blocks = [list(torch.split(s, splits, dim=0)) for s, splits in zip(sends, send_splits)]
    return [torch.cat([blocks[j][r] for j in range(sp)], dim=0) for r in range(sp)]


@pytest.mark.parametrize("seq", [8, 3], ids=lambda s: f"S{s}")  # 3: uneven, and empty for sp=4
@pytest.mark.parametrize(("sp", "m"), CASES, ids=CASE_IDS)
def test_round_trip_through_simulated_all_to_all(device, sp: int, m: HeadMap, seq: int) -> None:
    batch, dim = 2, 4
    x_full = torch.randn(batch, m.num_heads, seq, dim, device=device)
    lengths = chunk_lengths(seq, sp)
    assert sum(lengths) == seq
    chunks = list(torch.split(x_full, lengths, dim=2))
    index = index_tensor(m)

    sends = [pack_for_heads(c, sp, m.hp, index).flatten(0, 1) for c in chunks]  # [P*S_r, B, Hp, D]
    recvs = simulated_all_to_all(sends, [[n] * sp for n in lengths])  # [S, B, Hp, D]

    # Layout law: after the all-to-all rank r holds every position of its slots' heads.
    sources = slot_sources(m, sp)
    for r, recv in enumerate(recvs):
        attn_view = recv.permute(1, 2, 0, 3)  # what attention reads, [B, Hp, S, D]
        for h in range(m.hp):
            src = sources[r * m.hp + h]
            want = x_full[:, src] if src >= 0 else torch.zeros_like(x_full[:, 0])
            assert torch.equal(attn_view[:, h], want), (r, h, src)

    if m.index is not None and any(i >= 0 and m.index.count(i) > 1 for i in m.index):
        return  # replicated KV heads are never sent back; the way back carries query heads

    backs = [pack_for_sequence(recv.permute(1, 2, 0, 3)) for recv in recvs]  # [S, B, Hp, D]
    back_recvs = simulated_all_to_all(backs, [lengths] * sp)  # [P*S_r, B, Hp, D]
    for r, back in enumerate(back_recvs):
        restored = unpack_from_heads(back.view(sp, lengths[r], batch, m.hp, dim), m.num_heads)
        assert torch.equal(restored, chunks[r]), r


@pytest.mark.parametrize(("sp", "m"), CASES, ids=CASE_IDS)
def test_gradients_match_reference_autograd(device, sp: int, m: HeadMap, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(2, m.num_heads, 5, 8, device=device)
    recv = torch.randn(sp, 5, 2, m.hp, 8, device=device)
    out = torch.randn(2, m.hp, 5, 8, device=device)
    index = index_tensor(m)

    def grads(backend: str) -> list[torch.Tensor]:
        monkeypatch.setenv("DCP_KERNELS", backend)
        leaves = [t.clone().requires_grad_() for t in (x, recv, out)]
        torch.manual_seed(1)
        loss = (pack_for_heads(leaves[0], sp, m.hp, index) * torch.randn(sp, 5, 2, m.hp, 8, device=device)).sum()
        loss = loss + (unpack_from_heads(leaves[1], m.num_heads) * torch.randn(2, m.num_heads, 5, 8, device=device)).sum()
        # a non-contiguous upstream gradient for the sequence pack
        g = torch.randn(5, 2, 8, m.hp, device=device).transpose(2, 3)
        loss = loss + (pack_for_sequence(leaves[2]) * g).sum()
        loss.backward()
        return [leaf.grad for leaf in leaves]

    for got, want in zip(grads("triton"), grads("torch")):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_gqa_gradient_sums_replicas() -> None:
    x = torch.randn(1, 2, 3, 4, requires_grad=True)
    index = torch.tensor([0, 0, 1, 1, 1, -1])
    send = pack_for_heads(x, 3, 2, index)
    send.backward(torch.ones_like(send))
    assert torch.equal(x.grad[:, 0], torch.full((1, 3, 4), 2.0))
    assert torch.equal(x.grad[:, 1], torch.full((1, 3, 4), 3.0))


def test_gradcheck_fp64() -> None:
    index = torch.tensor([1, 1, 0, -1])
    x = torch.randn(1, 2, 3, 2, dtype=torch.float64, requires_grad=True)
    recv = torch.randn(2, 3, 1, 2, 2, dtype=torch.float64, requires_grad=True)
    out = torch.randn(1, 2, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: pack_for_heads(t, 2, 2, index), (x,))
    assert torch.autograd.gradcheck(lambda t: unpack_from_heads(t, 3), (recv,))
    assert torch.autograd.gradcheck(lambda t: unpack_from_heads(t, 2, head_index=index), (recv,))
    assert torch.autograd.gradcheck(pack_for_sequence, (out,))


def test_opcheck_layout_ops() -> None:
    """Schema, fake (meta) impl vs the real Triton output, autograd registration, AOT dispatch."""
    index = torch.tensor([2, 0, 0, -1])
    x = torch.randn(2, 3, 5, 4, requires_grad=True)
    recv = torch.randn(2, 5, 2, 2, 4, requires_grad=True)
    out = torch.randn(2, 2, 5, 4).transpose(2, 3).contiguous().transpose(2, 3).requires_grad_()
    torch.library.opcheck(torch.ops.dcp.pack_for_heads.default, (x, 2, 2, index))
    torch.library.opcheck(torch.ops.dcp.pack_for_heads.default, (x, 2, 2, None))
    torch.library.opcheck(torch.ops.dcp.unpack_from_heads.default, (recv, 3, index))
    torch.library.opcheck(torch.ops.dcp.unpack_from_heads.default, (recv, 3, None))
    torch.library.opcheck(torch.ops.dcp.pack_for_sequence.default, (out,))
    torch.library.opcheck(torch.ops.dcp.unpack_from_sequence.default, (out.detach().permute(2, 0, 1, 3).requires_grad_(),))


def test_bad_head_maps_raise() -> None:
    x = torch.randn(1, 5, 3, 4)
    with pytest.raises(ValueError, match="length"):
        pack_for_heads(x, 2, 3, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="range"):
        pack_for_heads(x, 2, 3, torch.tensor([0, 1, 2, 3, 4, 5]))
    with pytest.raises(ValueError, match="do not fit"):
        pack_for_heads(x, 2, 2)
    with pytest.raises(ValueError, match="do not fit"):
        unpack_from_heads(torch.randn(2, 3, 1, 2, 4), 5)
    with pytest.raises(ValueError, match=r"\[B, H, S_r, D\]"):
        pack_for_heads(torch.randn(5, 3, 4), 1, 5)


def test_empty_chunk() -> None:
    """A rank whose chunk is empty (S < P) still packs and unpacks."""
    x = torch.randn(1, 4, 0, 8)
    send = pack_for_heads(x, 4, 1)
    assert send.shape == (4, 0, 1, 1, 8)
    assert unpack_from_heads(send, 4).shape == (1, 4, 0, 8)
