"""DecodeGraphs: a decode step padded to its capture size over static buffers gives the logits of
the plain forward (on a CPU the padded path runs without capture; a GPU adds only the capture)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from servesim.kernels.graphs import DecodeGraphs, capture_sizes  # noqa: E402
from servesim.kernels.model import LlamaModel  # noqa: E402
from servesim.kernels.runner import KVCache, ModelRunner  # noqa: E402
from servesim.sim.batch import Batch  # noqa: E402
from servesim.sim.presets import get_model  # noqa: E402
from servesim.sim.request import Request  # noqa: E402

BLOCK = 8
TINY = get_model("tiny")


def test_capture_sizes_follow_vllm_and_end_at_the_largest_batch():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64)[-3:] == [48, 56, 64] and len(capture_sizes(64)) == 11
    with pytest.raises(ValueError, match="max_batch"):
        capture_sizes(0)


def _twin_runners(num_blocks: int, backend: str = "torch") -> tuple[ModelRunner, ModelRunner]:
    """Two runners of one model, each over its own cache: the plain path and the one under test."""
    model = LlamaModel(TINY, seed=0, backend=backend)
    return (ModelRunner(model, KVCache(TINY, num_blocks, BLOCK), BLOCK),
            ModelRunner(model, KVCache(TINY, num_blocks, BLOCK), BLOCK))


def _prefilled(runner: ModelRunner, lens: list[int], seed: int) -> tuple[list[Request], list[list[int]]]:
    """Requests whose prompts (lengths ``lens``) are prefilled into shuffled blocks, one token
    sampled each: ready to decode."""
    rng = np.random.default_rng(seed)
    free = rng.permutation(runner.kv_cache.num_blocks).tolist()
    reqs, tables = [], []
    for i, n in enumerate(lens):
        r = Request(i, 0.0, n, 64, prompt_token_ids=rng.integers(0, TINY.vocab_size, n).tolist())
        tables.append([free.pop() for _ in range(-(-(n + 40) // BLOCK))])
        reqs.append(r)
    logits = runner.compute_logits(Batch.of(reqs, lens, [0] * len(lens)), tables)
    for r, tok in zip(reqs, logits.argmax(-1).tolist(), strict=True):
        r.output_token_ids.append(tok)
    return reqs, tables


def _decode(runner: ModelRunner, reqs: list[Request], tables: list[list[int]]) -> torch.Tensor:
    ctx = [r.prompt_len + len(r.output_token_ids) - 1 for r in reqs]
    logits = runner.compute_logits(Batch.of(reqs, [1] * len(reqs), ctx), tables)
    for r, tok in zip(reqs, logits.argmax(-1).tolist(), strict=True):
        r.output_token_ids.append(tok)
    return logits


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_padded_graph_path_matches_the_plain_forward_step_for_step(backend):
    plain, graphed = _twin_runners(96, backend)
    g = graphed.use_decode_graphs(max_batch=12, max_context=256)
    assert g.sizes == [1, 2, 4, 8, 12] and not g.capture  # a CPU: the padded path, eager
    lens = [5, 17, 40, 9, 33, 3, 24, 8, 11]
    a, ta = _prefilled(plain, lens, seed=1)
    b, tb = _prefilled(graphed, lens, seed=1)
    assert g.num_replays == 0  # a prefill is not a decode step
    # 9 rows (padded to 12), then 3 (padded to 4: rows of the bigger step must not linger), then 1, 5
    for rows in (slice(0, 9), slice(2, 5), slice(7, 8), slice(0, 9, 2)):
        want = _decode(plain, a[rows], ta[rows])
        got = _decode(graphed, b[rows], tb[rows])
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert g.num_replays == 4
    assert [r.output_token_ids for r in b] == [r.output_token_ids for r in a]


def test_steps_that_are_not_plain_decodes_run_the_plain_forward():
    model = LlamaModel(TINY, seed=0)
    runner = ModelRunner(model, KVCache(TINY, 64, BLOCK), BLOCK)
    g = runner.use_decode_graphs(max_batch=2, max_context=64)
    reqs, tables = _prefilled(runner, [5, 7, 9], seed=2)
    cases = [
        Batch.of(reqs, [1, 1, 1], [5, 7, 9]),  # more rows than the largest capture size
        Batch.of(reqs[:2], [1, 2], [5, 6]),  # a row with two new tokens
        Batch.of(reqs[:1], [1], [5], [False]),  # a row that does not sample
    ]
    for batch in cases:
        runner.compute_logits(batch, tables[:batch.size])
    assert g.num_replays == 0
    # a row whose new token would be the 65th of a 64-token max_context
    assert not g.covers(np.array([1]), np.array([64]), np.array([True]))
    assert g.covers(np.array([1]), np.array([63]), np.array([True]))


def test_capture_needs_a_cuda_device():
    model = LlamaModel(TINY, seed=0)
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(model, KVCache(TINY, 8, BLOCK).tensor, BLOCK, 4, 64, capture=True)
    with pytest.raises(ValueError, match="max_context"):
        DecodeGraphs(model, KVCache(TINY, 8, BLOCK).tensor, BLOCK, 4, 0)


def test_a_block_table_wider_than_the_graphs_is_cut_to_the_columns_a_row_can_read():
    plain, graphed = _twin_runners(96)
    g = graphed.use_decode_graphs(max_batch=4, max_context=64)  # 8 columns
    a, ta = _prefilled(plain, [20, 30], seed=4)
    b, tb = _prefilled(graphed, [20, 30], seed=4)
    assert max(map(len, tb)) > g.width  # the helper gives each request blocks for 40 more tokens: 9 > 8
    torch.testing.assert_close(_decode(graphed, b, tb), _decode(plain, a, ta), rtol=1e-4, atol=1e-4)
    assert g.num_replays == 1


def test_token_capture_sizes_pad_by_at_most_a_quarter_and_end_at_the_budget():
    from servesim.kernels.graphs import token_capture_sizes

    sizes = token_capture_sizes(2048)
    assert sizes[:3] == [16, 32, 48] and sizes[-3:] == [1536, 1792, 2048] and 256 in sizes and 1024 in sizes
    assert all(b / a <= 1.25 for a, b in zip(sizes[4:], sizes[5:], strict=False))
    assert token_capture_sizes(100)[-1] == 100 and token_capture_sizes(8) == [8]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_piecewise_path_matches_the_plain_forward_on_prefill_and_mixed_steps(backend):
    plain, pieced = _twin_runners(128, backend)
    pw = pieced.use_piecewise_graphs(max_tokens=96, max_context=400)
    dg = pieced.use_decode_graphs(max_batch=8, max_context=400)
    assert not pw.capture and pw.sizes[-1] == 96
    lens = [37, 5, 20]
    a, ta = _prefilled(plain, lens, seed=5)  # a prefill-only step of 62 tokens (padded to 64)
    b, tb = _prefilled(pieced, lens, seed=5)
    assert pw.num_replays == 1 and [r.output_token_ids for r in a] == [r.output_token_ids for r in b]
    assert ta == tb
    free = sorted(set(range(128)) - {blk for t in ta for blk in t})
    for step in range(3):
        # a mixed step: a new prompt chunk of 33 (then 10, then 1) tokens beside the three decodes
        chunk = (33, 10, 1)[step]
        new_a = Request(10 + step, 0.0, chunk, 4, prompt_token_ids=list(range(1, chunk + 1)))
        new_b = Request(10 + step, 0.0, chunk, 4, prompt_token_ids=list(range(1, chunk + 1)))
        blocks = free[5 * step:5 * step + 5]  # 5 blocks of 8 hold the 33-token chunk
        ctx = [r.prompt_len + len(r.output_token_ids) - 1 for r in a]
        want = plain.compute_logits(Batch.of([*a, new_a], [1, 1, 1, chunk], [*ctx, 0]), [*ta, blocks])
        got = pieced.compute_logits(Batch.of([*b, new_b], [1, 1, 1, chunk], [*ctx, 0]), [*tb, blocks])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for r, s, tok in zip(a, b, want.argmax(-1).tolist()[:3], strict=False):
            r.output_token_ids.append(tok)
            s.output_token_ids.append(tok)
    assert pw.num_replays == 4 and dg.num_replays == 0
    assert not pw.covers(97, 10) and not pw.covers(10, 401) and pw.covers(96, 400)
