"""Page allocator properties and SequenceInfo metadata (hand-checked cases and limits)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autodeploy_mla.runtime import SCRATCH_PAGE, CapacityError, OutOfPagesError, PageAllocator, SequenceInfo, StepSequence


# ------------------------------------------------------------------ allocator
ops = st.lists(
    st.one_of(
        st.tuples(st.just("grow"), st.dictionaries(st.integers(0, 5), st.integers(1, 40), max_size=4)),
        st.tuples(st.just("free"), st.integers(0, 5)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(num_pages=st.integers(2, 24), page_size=st.integers(1, 8), script=ops)
def test_allocator_invariants(num_pages, page_size, script):
    alloc = PageAllocator(num_pages, page_size)
    lengths: dict[int, int] = {}
    for op, arg in script:
        if op == "grow":
            demand = {s: max(n, lengths.get(s, 0)) for s, n in arg.items()}
            before = (alloc.owners(), alloc.num_free)
            try:
                alloc.ensure_many(demand)
                lengths.update(demand)
            except OutOfPagesError:
                assert (alloc.owners(), alloc.num_free) == before  # failed allocations change nothing
        else:
            alloc.free(arg)
            lengths.pop(arg, None)
        owned = [p for pages in alloc.owners().values() for p in pages]
        assert len(owned) == len(set(owned)), "live sequences share a page"
        assert SCRATCH_PAGE not in owned
        assert len(owned) + alloc.num_free == num_pages - 1
        for s, n in lengths.items():
            assert len(alloc.pages_of(s)) * page_size >= n


def test_freed_pages_are_reused():
    alloc = PageAllocator(5, 2)
    alloc.ensure(1, 8)  # all 4 usable pages
    with pytest.raises(OutOfPagesError, match="4 more pages but only 0"):
        alloc.ensure(2, 7)
    pages = alloc.pages_of(1)
    assert alloc.free(1) == 4
    assert sorted(alloc.ensure(2, 7)) == sorted(pages)


def test_allocator_limits():
    with pytest.raises(CapacityError, match="scratch"):
        PageAllocator(1, 4)
    alloc = PageAllocator(10, 4, max_pages_per_seq=2)
    with pytest.raises(CapacityError, match="max_pages_per_seq=2"):
        alloc.ensure(0, 9)
    assert alloc.num_free == 9


# ------------------------------------------------------------------ SequenceInfo
def _info_and_alloc():
    info = SequenceInfo(max_batch_size=4, max_num_tokens=12, max_seq_len=10, page_size=4)
    alloc = PageAllocator(12, 4, info.max_pages_per_seq)
    return info, alloc


def test_metadata_of_a_mixed_step():
    info, alloc = _info_and_alloc()
    alloc._free = list(range(11, 0, -1))  # deterministic pages: 1, 2, 3, ...
    alloc.ensure_many({7: 6})  # decode seq: 5 cached + 1 new -> pages 1, 2
    alloc.ensure_many({3: 3})  # prefill seq -> page 3
    alloc.ensure_many({9: 6})  # chunked prefill: 2 cached + 4 new -> pages 4, 5
    seqs = [StepSequence(7, [70], 5), StepSequence(3, [30, 31, 32], 0), StepSequence(9, [90, 91, 92, 93], 2)]
    order = info.prepare_step(seqs, alloc.pages_of)
    assert order == [3, 9, 7]  # prefill first (stable), decode last
    h = info.host
    assert h["batch_info"].tolist() == [2, 7, 1]
    assert h["max_seq_info"].tolist() == [4, 6]
    assert h["cu_seqlen"].tolist() == [0, 3, 7, 8, 8]
    assert h["input_pos"].tolist() == [0, 2, 5, 0]
    assert h["seq_len_with_cache"].tolist() == [3, 6, 6, 0]
    assert h["page_table"].tolist() == [[3, 0, 0], [4, 5, 0], [1, 2, 0], [0, 0, 0]]
    assert h["batch_idx"][:8].tolist() == [0, 0, 0, 1, 1, 1, 1, 2]
    # seq 9 positions 2..5 -> page 4 slots 2,3 then page 5 slots 0,1; seq 7 position 5 -> page 2 slot 1
    assert h["cache_loc"][:8].tolist() == [12, 13, 14, 18, 19, 20, 21, 9]
    assert h["input_ids"][:8].tolist() == [30, 31, 32, 90, 91, 92, 93, 70]
    assert h["position_ids"][:8].tolist() == [0, 1, 2, 2, 3, 4, 5, 5]
    assert h["last_token"][:3].tolist() == [2, 6, 7]
    ids, pos = info.graph_inputs()
    assert ids.shape == (1, 8) and pos.shape == (1, 8)
    assert info.get("batch_info_host") is h["batch_info"]


def test_decode_padding_uses_dummy_sequences_on_scratch_page():
    info, alloc = _info_and_alloc()
    alloc.ensure_many({0: 3, 1: 5})
    info.prepare_step([StepSequence(0, [1], 2), StepSequence(1, [1], 4)], alloc.pages_of, pad_to=4)
    h = info.host
    assert info.num_tokens == 2 and info.num_padded_tokens == 4
    assert h["batch_info"].tolist() == [0, 0, 4]
    assert h["cu_seqlen"].tolist() == [0, 1, 2, 3, 4]
    assert h["seq_len_with_cache"].tolist() == [3, 5, 1, 1]
    assert h["page_table"][2:].eq(SCRATCH_PAGE).all()
    assert h["cache_loc"][2:4].tolist() == [0, 0]


def test_rejected_step_leaves_metadata_untouched():
    info, alloc = _info_and_alloc()
    alloc.ensure_many({0: 4})
    info.prepare_step([StepSequence(0, [1, 2, 3, 4], 0)], alloc.pages_of)
    snapshot = {k: v.clone() for k, v in info.host.items()}
    alloc.ensure_many({i: 3 for i in range(1, 5)})
    cases = [
        ([StepSequence(i, [1], 0) for i in range(5)], "max_batch_size=4"),
        ([StepSequence(0, [1] * 13, 0)], "max_num_tokens=12"),
        ([StepSequence(0, [1] * 3, 8)], "max_seq_len=10"),
        ([StepSequence(1, [1] * 3, 2)], "allocate its pages"),
        ([StepSequence(1, [1], 0), StepSequence(1, [2], 0)], "twice"),
    ]
    for seqs, msg in cases:
        with pytest.raises((CapacityError, ValueError), match=msg):
            info.prepare_step(seqs, alloc.pages_of)
        for k, v in info.host.items():
            assert torch.equal(v, snapshot[k]), k
    with pytest.raises(KeyError, match="valid"):
        info.get("nope")
