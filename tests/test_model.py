"""The live model over the paged KV cache must match a plain cache-free forward, step for step."""

import os

# The interpreter is chosen when the Triton kernels are decorated, i.e. on first import.
os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from servesim.kernels.model import LlamaModel  # noqa: E402
from servesim.kernels.runner import KVCache, ModelRunner  # noqa: E402
from servesim.sim.batch import Batch  # noqa: E402
from servesim.sim.presets import get_model  # noqa: E402
from servesim.sim.request import Request  # noqa: E402

BLOCK = 16
TINY = get_model("tiny")


@pytest.fixture(scope="module")
def tiny_model() -> LlamaModel:
    return LlamaModel(TINY, seed=0)


def _batch(rows: list[tuple[Request, int, int, bool]], swap_out=(), swap_in=()) -> Batch:
    """A Batch from (request, new tokens, context tokens, samples) rows."""
    batch = Batch.of([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows])
    batch.swap_out, batch.swap_in = list(swap_out), list(swap_in)
    return batch


class _Seq:
    """A request the test schedules by hand: prefill chunks, then decodes; blocks grow on demand."""

    def __init__(self, rid: int, prompt: list[int], chunks: list[int], start_step: int, num_decodes: int):
        assert sum(chunks) == len(prompt)
        self.req = Request(rid, 0.0, len(prompt), num_decodes + 1, prompt_token_ids=prompt)
        self.chunks, self.start_step, self.num_decodes = list(chunks), start_step, num_decodes
        self.computed = 0
        self.blocks: list[int] = []
        self.sampled: list[tuple[int, torch.Tensor]] = []  # (position whose logits these are, logits)

    @property
    def done(self) -> bool:
        return len(self.req.output_token_ids) == self.num_decodes + 1

    def tokens(self) -> list[int]:
        return self.req.all_token_ids()


def _drive(runner: ModelRunner, seqs: list[_Seq], free_blocks: list[int]) -> None:
    """Play scheduler and live executor: mixed steps until every sequence has all its tokens."""
    step = 0
    while not all(s.done for s in seqs):
        rows, tables, live = [], [], []
        for s in seqs:
            if step < s.start_step or s.done:
                continue
            n = s.chunks.pop(0) if s.chunks else 1
            total = len(s.tokens())
            while len(s.blocks) * BLOCK < s.computed + n:
                s.blocks.append(free_blocks.pop())
            rows.append((s.req, n, s.computed, s.computed + n == total))
            tables.append(list(s.blocks))
            live.append(s)
        logits = runner.compute_logits(_batch(rows), tables)
        tokens = iter(logits.argmax(-1).tolist())
        logit_rows = iter(logits)
        for s, (_, n, ctx, samples) in zip(live, rows, strict=True):
            s.computed += n
            if samples:
                s.sampled.append((ctx + n - 1, next(logit_rows).clone()))
                s.req.output_token_ids.append(next(tokens))
        step += 1


def _assert_matches_dense(model: LlamaModel, seqs: list[_Seq], rel_tol: float = 1e-4,
                          same_tokens: bool = True) -> None:
    for s in seqs:
        toks = s.tokens()
        dense = model.dense_forward(toks[:-1])  # the last sampled token was never fed back
        positions = [p for p, _ in s.sampled]
        paged = torch.stack([lg for _, lg in s.sampled])
        ref = dense[positions]
        err = (paged - ref).abs().max().item() / ref.abs().max().item()
        assert err < rel_tol, f"request {s.req.request_id}: relative logit error {err:.2e}"
        if same_tokens:
            assert s.req.output_token_ids == ref.argmax(-1).tolist(), f"request {s.req.request_id}: tokens differ"


def _shuffled_blocks(num_blocks: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).permutation(num_blocks).tolist()


def _run_mixed(model: LlamaModel, lens: list[int], chunks: list[list[int]], starts: list[int],
               num_decodes: int, seed: int = 0) -> list[_Seq]:
    rng = np.random.default_rng(seed)
    seqs = [_Seq(i, rng.integers(0, model.config.vocab_size, n).tolist(), c, st, num_decodes)
            for i, (n, c, st) in enumerate(zip(lens, chunks, starts, strict=True))]
    num_blocks = sum(-(-(n + num_decodes + 1) // BLOCK) for n in lens) + 3
    cache = KVCache(model.config, num_blocks, BLOCK, dtype=model.dtype)
    _drive(ModelRunner(model, cache, BLOCK), seqs, _shuffled_blocks(num_blocks, seed + 1))
    return seqs


# Step 0 is two whole prompts and nothing cached (the varlen prefill route). Later steps mix decodes
# of those with chunked prefills: 64 = 16 + 20 + 28 (the third chunk starts mid-block at 36),
# 23 = 7 + 9 + 7 (starts mid-block at 7), and a whole 50-token prompt arriving at step 3.
MIXED = dict(lens=[37, 5, 64, 23, 50], chunks=[[37], [5], [16, 20, 28], [7, 9, 7], [50]],
             starts=[0, 0, 1, 2, 3])


def test_paged_mixed_batches_match_dense_forward(tiny_model):
    seqs = _run_mixed(tiny_model, **MIXED, num_decodes=8)
    _assert_matches_dense(tiny_model, seqs)


def test_qkv_bias_and_tied_head_match_dense_forward():
    cfg = dataclasses.replace(TINY, qkv_bias=True, tie_word_embeddings=True, num_layers=2)
    model = LlamaModel(cfg, seed=3)
    assert model.lm_head is model.embed
    seqs = _run_mixed(model, lens=[21, 9], chunks=[[5, 16], [9]], starts=[0, 1], num_decodes=4)
    _assert_matches_dense(model, seqs)


def test_bf16_paged_path_stays_close_to_dense_forward():
    # bf16 weights, activations and cache (the GPU dtype): rounding differs, structure must not.
    model = LlamaModel(dataclasses.replace(TINY, num_layers=2), dtype=torch.bfloat16, seed=2)
    seqs = _run_mixed(model, lens=[30, 9], chunks=[[13, 17], [9]], starts=[0, 1], num_decodes=4)
    _assert_matches_dense(model, seqs, rel_tol=3e-2, same_tokens=False)


def test_triton_backend_matches_dense_forward_small():
    model = LlamaModel(dataclasses.replace(TINY, num_layers=2), seed=1, backend="triton")
    seqs = _run_mixed(model, lens=[13, 20], chunks=[[13], [7, 13]], starts=[0, 1], num_decodes=3)
    _assert_matches_dense(model, seqs)


@pytest.mark.slow
def test_triton_backend_matches_dense_forward_mixed():
    model = LlamaModel(TINY, seed=0, backend="triton")
    seqs = _run_mixed(model, **MIXED, num_decodes=4)
    _assert_matches_dense(model, seqs)


def test_swapped_out_blocks_come_back_to_new_blocks_and_decoding_continues(tiny_model):
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, TINY.vocab_size, 40).tolist()
    cache = KVCache(TINY, 12, BLOCK, num_host_blocks=4)
    runner = ModelRunner(tiny_model, cache, BLOCK)
    req = Request(0, 0.0, len(prompt), 8, prompt_token_ids=prompt)
    blocks = [9, 2, 5]
    req.output_token_ids += runner.execute(_batch([(req, 40, 0, True)]), [blocks])
    for ctx in range(40, 43):
        req.output_token_ids += runner.execute(_batch([(req, 1, ctx, True)]), [blocks])

    # Swap out alone, then let another request scribble over the freed device blocks.
    host = [3, 0, 1]
    assert runner.execute(_batch([], swap_out=zip(blocks, host, strict=True)), []) == []
    cache.tensor[:, :, blocks] = torch.randn_like(cache.tensor[:, :, blocks])

    new_blocks = [0, 11, 7]
    assert not set(new_blocks) & set(blocks)
    req.output_token_ids += runner.execute(_batch([(req, 1, 43, True)], swap_in=zip(host, new_blocks, strict=True)),
                                           [new_blocks])
    for ctx in range(44, 47):
        req.output_token_ids += runner.execute(_batch([(req, 1, ctx, True)]), [new_blocks])

    dense = tiny_model.dense_forward(req.all_token_ids()[:-1])
    assert req.output_token_ids == dense[39:].argmax(-1).tolist()


def test_swap_out_and_in_in_one_step_reuses_the_freed_block(tiny_model):
    cache = KVCache(TINY, 4, BLOCK, num_host_blocks=2)
    cache.tensor[:, :, 1] = 1.0
    cache.tensor[:, :, 2] = 2.0
    cache.copy_blocks_out([(2, 1)])
    # The step swaps block 1 out and the earlier host copy of block 2 into the same device block 1.
    ModelRunner(tiny_model, cache, BLOCK).execute(_batch([], swap_out=[(1, 0)], swap_in=[(1, 1)]), [])
    assert torch.all(cache.host[:, :, 0] == 1.0) and torch.all(cache.tensor[:, :, 1] == 2.0)


def test_runner_packs_tokens_positions_and_slots_from_block_tables(tiny_model):
    a = Request(0, 0.0, 17, 4, prompt_token_ids=list(range(100, 117)), output_token_ids=[7, 8, 9])
    b = Request(1, 0.0, 5, 4, prompt_token_ids=list(range(200, 205)))
    runner = ModelRunner(tiny_model, KVCache(TINY, 8, BLOCK), BLOCK)
    # a: tokens 14..19 straddle its prompt/output boundary and its first/second block; b: whole prompt.
    batch = _batch([(a, 6, 14, True), (b, 5, 0, False)])
    ids, pos, md = runner.prepare(batch, [[6, 3], [1]])
    assert ids.tolist() == [114, 115, 116, 7, 8, 9, 200, 201, 202, 203, 204]
    assert pos.tolist() == [14, 15, 16, 17, 18, 19, 0, 1, 2, 3, 4]
    assert md.slot_mapping.tolist() == [6 * 16 + 14, 6 * 16 + 15, 3 * 16, 3 * 16 + 1, 3 * 16 + 2, 3 * 16 + 3,
                                        16, 17, 18, 19, 20]
    assert md.block_tables.tolist() == [[6, 3], [1, 0]]
    assert md.seq_lens.tolist() == [20, 5] and md.query_start_loc.tolist() == [0, 6, 11]
    assert md.logits_indices.tolist() == [5] and md.max_query_len == 6 and not md.prefill_only
    assert len(a.output_token_ids) == 3 and a.num_computed_tokens == 0  # requests untouched


def test_runner_names_the_request_whose_block_table_is_too_short(tiny_model):
    r = Request(42, 0.0, 20, 1, prompt_token_ids=list(range(20)))
    runner = ModelRunner(tiny_model, KVCache(TINY, 4, BLOCK), BLOCK)
    with pytest.raises(ValueError, match="request 42"):
        runner.execute(_batch([(r, 20, 0, True)]), [[0]])


def test_runner_rejects_token_ids_outside_the_vocabulary(tiny_model):
    r = Request(3, 0.0, 4, 1, prompt_token_ids=[1, 2, TINY.vocab_size, 3])
    runner = ModelRunner(tiny_model, KVCache(TINY, 4, BLOCK), BLOCK)
    with pytest.raises(ValueError, match="vocab_size"):
        runner.execute(_batch([(r, 4, 0, True)]), [[0]])


def test_blocks_for_budget_counts_whole_blocks_of_k_and_v_in_every_layer():
    per_block = KVCache.block_bytes(TINY, BLOCK, torch.float32)
    assert per_block == TINY.kv_bytes_per_token * BLOCK  # tiny's dtype_bytes is 4 (fp32)
    assert KVCache.blocks_for_budget(TINY, BLOCK, 10 * per_block + per_block - 1, torch.float32) == 10
    assert KVCache.blocks_for_budget(TINY, BLOCK, 10 * per_block, torch.bfloat16) == 20
    assert KVCache(TINY, 3, BLOCK).bytes_per_block == per_block


def test_weights_are_seeded_and_logits_are_order_one():
    a, b = LlamaModel(TINY, seed=5), LlamaModel(TINY, seed=5)
    assert torch.equal(a.layers[-1].down, b.layers[-1].down)
    assert not torch.equal(a.embed, LlamaModel(TINY, seed=6).embed)
    logits = a.dense_forward(list(range(0, 4000, 37)))
    # Random weights should still give a non-degenerate distribution: not uniform, not one-hot.
    assert 0.3 < logits.std().item() < 10.0


def test_mixed_step_of_32_sequences_is_fast_on_cpu(tiny_model):
    rng = np.random.default_rng(0)
    rows, tables, next_block = [], [], 0
    for i in range(32):
        ctx, n = (200 + i, 1) if i < 28 else (64 * (i - 28), 64)
        r = Request(i, 0.0, ctx + n, 1, prompt_token_ids=rng.integers(0, TINY.vocab_size, ctx + n).tolist())
        nb = -(-(ctx + n) // BLOCK)
        tables.append(list(range(next_block, next_block + nb)))
        next_block += nb
        rows.append((r, n, ctx, True))
    runner = ModelRunner(tiny_model, KVCache(TINY, next_block, BLOCK), BLOCK)
    batch = _batch(rows)
    runner.execute(batch, tables)  # warm-up
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        runner.execute(batch, tables)
        times.append(time.perf_counter() - t0)
    print(f"\ntiny mixed step (28 decodes @ ~200 ctx + 4 prefill chunks of 64), torch CPU: "
          f"median {1e3 * float(np.median(times)):.1f} ms over 10 runs")
