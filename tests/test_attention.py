"""Attention kernels (Triton and torch) against a float64 reference computed here from unpaged K/V."""

import os

# The interpreter is chosen when the Triton kernels are decorated: set it before any triton import.
os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from servesim.kernels import attention  # noqa: E402
from servesim.kernels.attention import paged_attention, prefill_attention, write_kv  # noqa: E402

BACKENDS = ["torch", "triton"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention of the last len(q) positions of one sequence; dense masked matmul."""
    lq, length = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    qd = q.double().transpose(0, 1)  # [Hq, Lq, D]
    kd = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # query head h -> kv head h // group
    vd = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = qd @ kd.transpose(1, 2) * scale
    q_pos = torch.arange(length - lq, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > q_pos, float("-inf"))
    return (scores.softmax(-1) @ vd).transpose(0, 1)


def _poisoned(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


class PagedCase:
    """Sequences with (context_len, query_len) laid out in a shuffled paged cache filled with noise."""

    def __init__(self, shapes, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed):
        gen = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        self.q_lens = [n for _, n in shapes]
        self.seq_lens = [c + n for c, n in shapes]
        blocks_per_seq = [-(-s // block_size) for s in self.seq_lens]
        num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay noise: reading them shows up
        cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(cache_shape, generator=gen).to(dtype) * 50
        self.v_cache = torch.randn(cache_shape, generator=gen).to(dtype) * 50
        physical = torch.randperm(num_blocks, generator=gen).tolist()
        # Unused table entries hold out-of-range garbage: any kernel that reads one must crash or fail.
        self.block_tables = torch.full((len(shapes), max(blocks_per_seq) + 2), 10**6, dtype=torch.int32)
        self.k, self.v, qs = [], [], []
        for b, length in enumerate(self.seq_lens):
            k = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
            table = [physical.pop() for _ in range(blocks_per_seq[b])]
            self.block_tables[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
            for pos in range(length):
                self.k_cache[table[pos // block_size], pos % block_size] = k[pos]
                self.v_cache[table[pos // block_size], pos % block_size] = v[pos]
            self.k.append(k)
            self.v.append(v)
            qs.append(torch.randn(self.q_lens[b], num_q_heads, head_dim, generator=gen).to(dtype))
        self.q = torch.cat(qs)
        self.query_start_loc = torch.tensor([0, *self.q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
        self.seq_lens_t = torch.tensor(self.seq_lens, dtype=torch.int32)
        self.scale = head_dim**-0.5

    def run(self, backend: str) -> torch.Tensor:
        out = _poisoned(self.q)
        ret = paged_attention(self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens_t,
                              self.query_start_loc, max(self.q_lens), backend=backend, out=out)
        assert ret.data_ptr() == out.data_ptr()
        return out

    def reference(self) -> torch.Tensor:
        starts = self.query_start_loc.tolist()
        return torch.cat([_reference(self.q[starts[b] : starts[b + 1]], self.k[b], self.v[b], self.scale)
                          for b in range(len(self.q_lens))])


def _check_paged(shapes, backend, dtype=torch.float32, heads=(4, 2), head_dim=64, block_size=16, seed=0):
    case = PagedCase(shapes, heads[0], heads[1], head_dim, block_size, dtype, seed)
    out = case.run(backend)
    assert not out.isnan().any()
    err = _rel_err(out, case.reference())
    assert err < TOL[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim"), [((2, 2), 64), ((8, 2), 128), ((8, 1), 32)])
def test_prefill_matches_float64_reference(backend, dtype, heads, head_dim):
    gen = torch.Generator().manual_seed(1)
    lens = [1, 19, 40]
    total = sum(lens)
    q = torch.randn(total, heads[0], head_dim, generator=gen).to(dtype)
    k = torch.randn(total, heads[1], head_dim, generator=gen).to(dtype)
    v = torch.randn(total, heads[1], head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    out = _poisoned(q)
    prefill_attention(q, k, v, cu, max(lens), backend=backend, out=out)
    ref = torch.cat([_reference(q[s:e], k[s:e], v[s:e], head_dim**-0.5)
                     for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)])
    assert _rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_honours_explicit_scale_and_strided_inputs(backend):
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(30, 4 + 2 + 2, 32, generator=gen)  # fused projection output, split by views
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    cu = torch.tensor([0, 12, 30], dtype=torch.int32)
    out = prefill_attention(q, k, v, cu, 18, scale=0.3, backend=backend)
    ref = torch.cat([_reference(q[:12], k[:12], v[:12], 0.3), _reference(q[12:], k[12:], v[12:], 0.3)])
    assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_over_context_not_a_multiple_of_block_size(backend, dtype):
    _check_paged([(36, 1), (0, 1), (15, 1), (150, 1)], backend, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_with_gqa_ratio(backend, group):
    _check_paged([(21, 1), (47, 1)], backend, heads=(group * 2, 2), seed=group)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_chunked_prefill_chunk_starting_mid_block(backend, head_dim):
    # Context 21 with block_size 16: the chunk's first query sits at offset 5 of the second block.
    _check_paged([(21, 13)], backend, heads=(8, 2), head_dim=head_dim)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_of_decodes_and_prefill_chunks(backend, dtype):
    # decode, fresh prefill (no context), chunk mid-block, decode at a block boundary, chunk > tile.
    shapes = [(30, 1), (0, 23), (40, 9), (32, 1), (5, 70)]
    _check_paged(shapes, backend, dtype, heads=(8, 2), block_size=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_decode_merges_partials_exactly(monkeypatch, dtype):
    # Small splits so a tiny batch is split; the 3-token sequence leaves most of its splits empty.
    monkeypatch.setattr(attention, "_MIN_TOKENS_PER_SPLIT", 16)
    assert attention._decode_splits(num_seqs=3, num_kv_heads=2, max_context=130) == 8
    _check_paged([(129, 1), (2, 1), (64, 1)], "triton", dtype, heads=(8, 2), block_size=16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention_with_odd_block_size_and_gqa_ratio_3(backend):
    _check_paged([(10, 1), (3, 6)], backend, heads=(6, 2), block_size=5)


def test_triton_and_torch_paged_attention_agree_on_llama_like_heads():
    case = PagedCase([(50, 1), (17, 20)], 32, 8, 128, 16, torch.float32, seed=7)
    assert _rel_err(case.run("triton"), case.run("torch").double()) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv_fills_scattered_slots_and_skips_negative_ones(backend):
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, heads, head_dim = 6, 4, 3, 32
    k_cache = torch.zeros(num_blocks, block_size, heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(7, heads, head_dim, generator=gen)
    v = torch.randn(7, heads, head_dim, generator=gen)
    slots = torch.tensor([13, -1, 0, 23, 5, -1, 17], dtype=torch.int64)
    write_kv(k, v, k_cache, v_cache, slots, backend=backend)
    expect_k, expect_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot // block_size, slot % block_size] = k[t]
            expect_v[slot // block_size, slot % block_size] = v[t]
    assert torch.equal(k_cache, expect_k)
    assert torch.equal(v_cache, expect_v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_written_cache_serves_paged_attention(backend):
    # write_kv then paged_attention: the path model.py takes every step.
    gen = torch.Generator().manual_seed(4)
    block_size, length = 8, 19
    k = torch.randn(length, 2, 64, generator=gen)
    v = torch.randn(length, 2, 64, generator=gen)
    q = torch.randn(3, 4, 64, generator=gen)
    k_cache = torch.full((5, block_size, 2, 64), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    table = torch.tensor([[4, 0, 2, 99]], dtype=torch.int32)
    slots = torch.tensor([table[0, p // block_size] * block_size + p % block_size for p in range(length)])
    write_kv(k, v, k_cache, v_cache, slots, backend=backend)
    out = paged_attention(q, k_cache, v_cache, table, torch.tensor([length], dtype=torch.int32),
                          torch.tensor([0, 3], dtype=torch.int32), 3, backend=backend)
    assert _rel_err(out, _reference(q, k, v, 64**-0.5)) < 1e-5


def test_unknown_backend_is_rejected_with_allowed_values():
    q = torch.zeros(1, 1, 16)
    with pytest.raises(ValueError, match="torch.*triton"):
        prefill_attention(q, q, q, torch.tensor([0, 1], dtype=torch.int32), 1, backend="cuda")
    with pytest.raises(ValueError, match="torch.*triton"):
        write_kv(q, q, q[None], q[None], torch.zeros(1, dtype=torch.int64), backend="flash")


def test_out_with_wrong_shape_is_rejected():
    q = torch.zeros(2, 2, 16)
    with pytest.raises(ValueError, match="out must match q"):
        prefill_attention(q, q, q, torch.tensor([0, 2], dtype=torch.int32), 2, out=torch.empty(2, 2, 8))


@settings(max_examples=6, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=3),
    group=st.sampled_from([1, 2, 4]),
    block_size=st.sampled_from([4, 16]),
    seed=st.integers(0, 2**16),
)
def test_triton_paged_attention_matches_reference_on_random_shapes(shapes, group, block_size, seed):
    _check_paged(shapes, "triton", heads=(group, 1), head_dim=32, block_size=block_size, seed=seed)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(32, 8), (8, 8), (16, 2)])
def test_paged_attention_sweep_with_long_contexts(backend, dtype, heads):
    shapes = [(300, 1), (129, 1), (200, 64), (0, 150), (1, 1)]
    _check_paged(shapes, backend, dtype, heads=heads, head_dim=128, seed=heads[0])


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_sweep_with_long_sequences(backend, dtype):
    gen = torch.Generator().manual_seed(5)
    lens = [257, 3, 130]
    q = torch.randn(sum(lens), 32, 128, generator=gen).to(dtype)
    k = torch.randn(sum(lens), 8, 128, generator=gen).to(dtype)
    v = torch.randn(sum(lens), 8, 128, generator=gen).to(dtype)
    cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    out = prefill_attention(q, k, v, cu, max(lens), backend=backend, out=_poisoned(q))
    ref = torch.cat([_reference(q[s:e], k[s:e], v[s:e], 1 / math.sqrt(128))
                     for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)])
    assert _rel_err(out, ref) < TOL[dtype]
