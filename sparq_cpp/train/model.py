"""A minimal Llama in torch, laid out exactly like Hugging Face's LlamaForCausalLM.

Module names match the HF checkpoint's tensor names, so `state_dict()` is the checkpoint. RoPE is
HF's "rotate_half" form (pairs (i, i + D/2)); llama.cpp's LLAMA architecture rotates adjacent pairs
(2i, 2i+1), and `sparq-cpp convert` permutes the q/k rows between the two, as upstream's converter
does for every real HF Llama checkpoint — the round-trip test checks that permutation.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf(self) -> dict:
        """config.json for transformers' LlamaForCausalLM."""
        d = asdict(self)
        d.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                 head_dim=self.head_dim, attention_bias=False, mlp_bias=False, torch_dtype="float32",
                 initializer_range=0.02, pretraining_tp=1, rope_scaling=None, use_cache=True)
        return d

    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in fields})


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(cfg: LlamaConfig, n_pos: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (n_pos, head_dim), HF layout (the D/2 frequencies repeated twice)."""
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64, device=device) / D))
    ang = torch.arange(n_pos, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float(), ang.sin().float()


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        D = cfg.head_dim
        self.n_head, self.n_kv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_head * D, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * D, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * D, bias=False)
        self.o_proj = nn.Linear(self.n_head * D, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.D).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.D).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv != self.n_head:  # GQA: KV head j serves query heads j*g .. j*g+g-1, as HF and llama.cpp
            g = self.n_head // self.n_kv
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.D))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rope = (0, None, None)

    def init_weights(self, seed: int = 0) -> None:
        """GPT-2 style: N(0, 0.02), residual output projections scaled down by depth."""
        g = torch.Generator().manual_seed(seed)
        std_out = 0.02 / (2 * self.config.num_hidden_layers) ** 0.5
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                std = std_out if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def _rope_for(self, T: int, device):
        if self._rope[0] < T:
            self._rope = (T, *rope_tables(self.config, T, device))
        return self._rope[1][:T], self._rope[2][:T]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids (B, T) at positions 0..T-1."""
        cos, sin = self._rope_for(ids.shape[1], ids.device)
        x = self.model.embed_tokens(ids)
        for block in self.model.layers:
            x = block(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors under their HF names (lm_head left out when tied, as HF saves it)."""
        sd = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return sd
