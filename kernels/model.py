"""A Llama-style decoder with random weights that runs packed mixed batches over a paged KV cache.

RMSNorm, rotary embeddings (rotate-half), grouped-query attention with optional q/k/v bias (Qwen2),
SwiGLU MLP, final norm and a tied or untied LM head: the shapes of the real models, seeded random
weights instead of checkpoints. One ``forward`` call runs a whole engine step packed along tokens:
prefill chunks (with or without cached context) next to single-token decodes, all through the
attention ops of ``attention.py``. ``dense_forward`` is the cache-free reference for that path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from servesim.sim.presets import ModelConfig

from . import attention


@dataclass(slots=True)
class AttentionMetadata:
    """The packed layout of one step, built by ``ModelRunner`` (all tensors on the model's device).

    Sequence ``b`` owns tokens ``query_start_loc[b]:query_start_loc[b+1]`` of the packed batch; they
    sit at positions ``seq_lens[b] - q_len_b ...`` of that sequence, earlier positions already in
    the cache.
    """

    slot_mapping: torch.Tensor  # int64 [T], cache slot (block * block_size + offset) of each token
    block_tables: torch.Tensor  # int32 [B, max_blocks], padded with block 0
    seq_lens: torch.Tensor  # int32 [B], context + this step's tokens
    query_start_loc: torch.Tensor  # int32 [B + 1], cumulative query lengths
    max_query_len: int  # tokens
    max_seq_len: int  # tokens
    # No sequence has cached context: the varlen prefill kernel covers the step.
    prefill_only: bool
    # Packed rows whose logits are wanted (the last token of each sampling sequence); None = all.
    logits_indices: torch.Tensor | None = None  # int64 [S]


@dataclass(slots=True)
class _Layer:
    attn_norm: torch.Tensor  # [h]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, h], q, k and v projections fused
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) D]
    o: torch.Tensor  # [h, Hq D]
    mlp_norm: torch.Tensor  # [h]
    gate_up: torch.Tensor  # [2 I, h], gate and up projections fused
    down: torch.Tensor  # [h, I]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, reduced in fp32 like the Hugging Face Llama."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [T, H, D], cos/sin [T, D/2] for each token's position."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class LlamaModel:
    """Random-weight Llama-style decoder (see module docstring).

    Weights are allocated on ``device`` at construction: ``config.num_params`` values of ``dtype``
    (Llama-3.1-8B in bf16 is 16 GB), so only build the big presets where they fit.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 seed: int = 0, backend: str = "torch") -> None:
        if config.head_dim % 2:
            raise ValueError(f"{config.name}: head_dim must be even for RoPE, got {config.head_dim}")
        if config.num_heads % config.num_kv_heads:
            raise ValueError(f"{config.name}: num_heads {config.num_heads} is not a multiple of "
                             f"num_kv_heads {config.num_kv_heads}")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.backend = backend
        self.scale = config.head_dim ** -0.5
        self._rope_cos = torch.empty(0, config.head_dim // 2, dtype=dtype, device=self.device)
        self._rope_sin = self._rope_cos
        with torch.inference_mode():
            self._init_weights(seed)

    def _init_weights(self, seed: int) -> None:
        cfg = self.config
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)

        def randn(*shape: int, std: float) -> torch.Tensor:
            # Sampled straight in the target dtype on the target device: no fp32 copy of an 8B model.
            return torch.randn(shape, generator=gen, dtype=self.dtype, device=self.device).mul_(std)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, dtype=self.dtype, device=self.device)

        h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
        # Input projections get std 1/sqrt(fan_in) (0.022 at h=2048) so q, k, v and the MLP input
        # are O(1) after each RMSNorm, which keeps attention scores O(1) (not uniform) as in a
        # trained model; output projections are further scaled by 1/sqrt(2 L) (GPT-2) so the
        # residual stream stays O(1) through the layers.
        out_scale = 1.0 / math.sqrt(2 * cfg.num_layers)
        # Embedding rows of norm ~1: a tied LM head then gives O(1) logits too.
        self.embed = randn(cfg.vocab_size, h, std=h ** -0.5)
        self.layers: list[_Layer] = []
        for _ in range(cfg.num_layers):
            self.layers.append(_Layer(
                attn_norm=ones(h),
                qkv=randn(qkv_out, h, std=h ** -0.5),
                qkv_bias=randn(qkv_out, std=0.02) if cfg.qkv_bias else None,
                o=randn(h, cfg.num_heads * d, std=(cfg.num_heads * d) ** -0.5 * out_scale),
                mlp_norm=ones(h),
                gate_up=randn(2 * inter, h, std=h ** -0.5),
                down=randn(h, inter, std=inter ** -0.5 * out_scale),
            ))
        self.norm = ones(h)
        self.lm_head = self.embed if cfg.tie_word_embeddings else randn(cfg.vocab_size, h, std=h ** -0.5)

    # -- building blocks ---------------------------------------------------------------------

    def _rope(self, positions: torch.Tensor, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D/2] at ``positions`` (all < ``num_positions``), from a table grown on demand.

        The bound comes from the host so a GPU step needs no device sync to size the table.
        """
        if num_positions > self._rope_cos.shape[0]:
            size = max(num_positions, 2 * self._rope_cos.shape[0], 4096)
            d = self.config.head_dim
            inv_freq = self.config.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
            angles = torch.outer(torch.arange(size, dtype=torch.float64), inv_freq)
            self._rope_cos = angles.cos().to(self.dtype).to(self.device)
            self._rope_sin = angles.sin().to(self.dtype).to(self.device)
        return self._rope_cos[positions], self._rope_sin[positions]

    def rope_table_ptr(self) -> int:
        """Address of the rotary cos table (captured CUDA graphs read it in place)."""
        return self._rope_cos.data_ptr()

    # The decoder in pieces: what runs before a layer's attention, and what runs after it. The eager
    # forward strings them together; graphs.PiecewiseGraphs captures them and runs attention between.

    def pre_attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``i``'s q [T, Hq, D], k and v [T, Hkv, D] (rotary applied) from the residual stream x [T, h]."""
        cfg, w = self.config, self.layers[i]
        t, d = x.shape[0], cfg.head_dim
        qkv = F.linear(rms_norm(x, w.attn_norm, cfg.rms_norm_eps), w.qkv, w.qkv_bias)
        q, k, v = qkv.split([cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], dim=-1)
        q = apply_rope(q.view(t, cfg.num_heads, d), cos, sin)
        k = apply_rope(k.view(t, cfg.num_kv_heads, d), cos, sin)
        return q, k, v.view(t, cfg.num_kv_heads, d)

    def post_attention(self, i: int, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The residual stream after layer ``i``: its output projection of o [T, Hq, D] and its MLP."""
        cfg, w = self.config, self.layers[i]
        x = x + F.linear(o.reshape(x.shape[0], cfg.num_heads * cfg.head_dim), w.o)
        gate, up = F.linear(rms_norm(x, w.mlp_norm, cfg.rms_norm_eps), w.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, w.down)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    def _decoder(self, input_ids: torch.Tensor, positions: torch.Tensor, num_positions: int,
                 attend) -> torch.Tensor:
        """All layers and the final norm; ``attend(layer, q, k, v) -> [T, Hq, D]`` is the attention."""
        cos, sin = self._rope(positions, num_positions)
        x = F.embedding(input_ids, self.embed)
        for i in range(len(self.layers)):
            q, k, v = self.pre_attention(i, x, cos, sin)
            x = self.post_attention(i, x, attend(i, q, k, v))
        return self.final_norm(x)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()

    # -- entry points ------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """One packed step over the paged cache; returns fp32 logits [S, vocab] of the sampling rows.

        input_ids, positions: int64 [T] (token ids; positions in tokens from each sequence's start).
        kv_cache: [num_layers, 2, num_blocks, block_size, Hkv, D]; this step's K/V are written into
        it at ``attn_metadata.slot_mapping`` before attention reads it.
        """
        md, backend, scale = attn_metadata, self.backend, self.scale

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            attention.write_kv(k, v, k_cache, v_cache, md.slot_mapping, backend=backend)
            if md.prefill_only:
                # Nothing cached before this step: every query attends only to this step's keys.
                return attention.prefill_attention(q, k, v, md.query_start_loc, md.max_query_len,
                                                   scale=scale, backend=backend)
            return attention.paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens,
                                             md.query_start_loc, md.max_query_len, scale=scale,
                                             backend=backend)

        with torch.inference_mode():
            hidden = self._decoder(input_ids, positions, md.max_seq_len, attend)
            if md.logits_indices is not None:
                hidden = hidden[md.logits_indices]
            return self._logits(hidden)

    def dense_forward(self, token_ids: list[int]) -> torch.Tensor:
        """Plain causal forward of one sequence with no cache: fp32 logits [T, vocab] (the reference)."""

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # [T, H, D] -> [H, T, D]; GQA expands the KV heads onto their query groups.
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               is_causal=True, scale=self.scale, enable_gqa=True)
            return o.transpose(0, 1)

        with torch.inference_mode():
            ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
            positions = torch.arange(len(token_ids), device=self.device)
            return self._logits(self._decoder(ids, positions, len(token_ids), attend))

    __call__ = forward
