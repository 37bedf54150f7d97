"""Trained drafters that read the target's own hidden states (chapter 10): Medusa heads and an
EAGLE-style one-layer drafter, plus the file format that ties them to one target's weights.

Letters: B batch, T rows, C d_model (hidden size), K heads, V vocab, Vd draft vocabulary.

- `MedusaHeads(model_config, num_heads)`: K residual heads x + SiLU(W x + b), W and b started at
  zero (each head starts as the identity); head k reads the feature of token t, learns t + 2 + k.
- `EagleDrafter(model_config)`: Linear(2C -> C) over (feature of t, embedding of t + 1), then one
  decoder layer of the target's kind, predicting the feature of t + 1; `norm_inputs=True`
  RMS-normalizes both inputs first. `keys_values` and `extend` reuse its KV (`DraftKV`).
Both put the target's frozen `lm_head` on top, passed at call time, or a reduced draft vocabulary
(`draft_vocab`: the Vd most frequent ids; `token_ids` maps back). A drafter file records the
target's sizes and `weights_fingerprint(model)`, so heads never run on another model; normalized
drafters are format v2, v1 files load without the input norms.

Left out on purpose: EAGLE-3's multi-layer feature fusion, Medusa-2's joint training of the
target, Hydra's sequentially dependent heads.
"""
import contextlib
import hashlib
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.model.config import ModelConfig
from minillm.model.llama import Block, RMSNorm, apply_rope, rope_cos_sin

FORMAT = "minillm-drafter-v1"
FORMAT_V2 = "minillm-drafter-v2"    # a config that v1 readers do not know (EAGLE's norm_inputs)
_SAMPLE = 2048                      # values hashed per parameter


def weights_fingerprint(model: nn.Module) -> str:
    """sha256 over each parameter's name, shape and an evenly spaced sample of its values,
    rounded to bfloat16 first (so an fp32 target and its bf16 copy share a fingerprint).
    Milliseconds on SmolLM2; any retraining or another checkpoint changes it."""
    h = hashlib.sha256()
    for name, p in sorted(dict(model.named_parameters()).items()):
        flat = p.detach().reshape(-1)
        n = min(_SAMPLE, flat.numel())
        idx = torch.arange(n, device=flat.device) * (flat.numel() - 1) // max(n - 1, 1)
        vals = flat[idx].to(torch.bfloat16).view(torch.int16).cpu()
        h.update(f"{name}:{tuple(p.shape)};".encode())
        h.update(vals.numpy().tobytes())
    return h.hexdigest()


def _mismatch(path, what: str) -> ValueError:
    return ValueError(f"drafter file {path}: {what}; train it again for this model "
                      f"(train_medusa / train_eagle with retrain=True)")


class _Drafter(nn.Module):
    """What Medusa heads and the EAGLE drafter share: the vocabulary on top and the file."""

    kind = ""
    config_keys: frozenset = frozenset()                          # what config_dict may hold

    def _init_vocab(self, model_config: ModelConfig, draft_vocab) -> None:
        self.hidden_size, self.vocab_size = model_config.d_model, model_config.vocab_size
        self.target_fingerprint: str | None = None
        self.meta: dict = {}
        if draft_vocab is not None:
            draft_vocab = torch.as_tensor(draft_vocab, dtype=torch.long).flatten()
            if draft_vocab.numel() < 1 or draft_vocab.unique().numel() != draft_vocab.numel() \
                    or int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= self.vocab_size:
                raise ValueError(f"draft_vocab must hold distinct token ids in [0, "
                                 f"{self.vocab_size}), got {draft_vocab.numel()} ids")
        self.register_buffer("draft_vocab", draft_vocab)            # (Vd,) or None
        self._rows = None                                          # cached lm_head rows

    def vocab_logits(self, x: torch.Tensor, lm_head) -> torch.Tensor:
        """x (..., C) -> logits (..., V) through lm_head, or (..., Vd) over the draft vocabulary."""
        weight = lm_head.weight if hasattr(lm_head, "weight") else lm_head   # (V, C)
        if self.draft_vocab is None:
            return F.linear(x, weight)
        key = (weight.data_ptr(), weight._version, weight.dtype, self.draft_vocab.data_ptr())
        if self._rows is None or self._rows[0] != key:             # gather the Vd rows once
            self._rows = (key, weight.detach()[self.draft_vocab.to(weight.device)].contiguous())
        return F.linear(x, self._rows[1])                          # (..., Vd)

    def token_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into `vocab_logits`' last axis -> real token ids."""
        return idx if self.draft_vocab is None else self.draft_vocab.to(idx.device)[idx]

    def config_dict(self) -> dict:
        """The constructor arguments a file must record beyond the target's sizes (none here)."""
        return {}

    def file_format(self) -> str:
        return FORMAT

    def save(self, path, model=None) -> None:
        """Write the drafter; `model` (else the one it was trained for) is fingerprinted."""
        fp = weights_fingerprint(model) if model is not None else self.target_fingerprint
        if fp is None:
            raise ValueError("save needs the target: save(path, model), so the file records "
                             "which weights these drafters belong to")
        state = {k: v.detach().cpu() for k, v in self.state_dict().items()}
        torch.save({"format": self.file_format(), "kind": self.kind, "hidden_size": self.hidden_size,
                    "vocab_size": self.vocab_size, "weights_sha256": fp,
                    "config": self.config_dict(), "meta": self.meta, "state": state}, Path(path))

    @classmethod
    def load(cls, path, model):
        """The drafter saved at `path`, checked against `model` and put on its device / dtype."""
        try:
            blob = torch.load(Path(path), map_location="cpu", weights_only=True)
            ok = isinstance(blob, dict) and blob.get("format") in (FORMAT, FORMAT_V2)
        except FileNotFoundError:
            raise
        except Exception as err:                                   # truncated, not a torch file
            raise _mismatch(path, f"unreadable or corrupt ({type(err).__name__}: {err})") from err
        if not ok:
            raise _mismatch(path, "not a minillm drafter file")
        if blob["kind"] != cls.kind:
            raise _mismatch(path, f"holds {blob['kind']!r} drafters, not {cls.kind!r}")
        cfg = model.config
        for field, mine in (("hidden_size", cfg.d_model), ("vocab_size", cfg.vocab_size)):
            if blob[field] != mine:
                raise _mismatch(path, f"{field} {blob[field]} != the model's {mine}")
        if blob["weights_sha256"] != weights_fingerprint(model):
            raise _mismatch(path, "made for other weights (weights fingerprint differs)")
        state, config = dict(blob["state"]), dict(blob.get("config", {}))
        if not set(config) <= cls.config_keys:
            raise _mismatch(path, f"unknown settings {sorted(set(config) - cls.config_keys)}")
        out = cls(cfg, **config, draft_vocab=state.get("draft_vocab"))
        try:
            out.load_state_dict(state)
        except RuntimeError as err:
            raise _mismatch(path, f"its tensors do not fit ({err})") from err
        out.target_fingerprint, out.meta = blob["weights_sha256"], dict(blob.get("meta", {}))
        return out.to(model.device, model.dtype).eval()


@contextlib.contextmanager
def _seeded(seed):
    """Module construction inside draws its init from `seed` (None: the global RNG)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class MedusaHeads(_Drafter):
    """K residual SiLU heads over the last feature; `logits(hidden, lm_head)` -> (..., K, V)."""

    kind = "medusa"
    config_keys = frozenset({"num_heads"})

    def __init__(self, model_config: ModelConfig, num_heads: int, seed: int | None = None,
                 draft_vocab=None):
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be an int >= 1, got {num_heads!r}")
        self._init_vocab(model_config, draft_vocab)
        self.num_heads, self.seed = num_heads, seed
        C = model_config.d_model
        self.blocks = nn.ModuleList(nn.Linear(C, C) for _ in range(num_heads))
        for lin in self.blocks:                                    # identity at the start
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def config_dict(self) -> dict:
        return {"num_heads": self.num_heads}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., C) -> each head's feature (..., K, C)."""
        return torch.stack([hidden + F.silu(lin(hidden)) for lin in self.blocks], dim=-2)

    def logits(self, hidden: torch.Tensor, lm_head) -> torch.Tensor:
        """hidden (..., C) -> (..., K, V), or (..., K, Vd) with a draft vocabulary."""
        return self.vocab_logits(self(hidden), lm_head)


class _MaskedAttention:
    """The drafter's attention: over exactly the rows passed in, under an explicit mask."""

    def __init__(self, mask: torch.Tensor | None):
        self.mask = mask                                           # (T, T) bool, True = seen

    def attend(self, layer_idx: int, q, k, v, positions=None):
        # q (B, H, T, D), k/v (B, Hkv, T, D) -> (B, H, T, D)
        causal = self.mask is None and q.shape[2] > 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=causal,
                                              enable_gqa=k.shape[1] != q.shape[1])


class DraftKV:
    """Keys and values of the rows a drafter has run so far, k and v (B, Hkv, R, D) each."""

    def __init__(self):
        self.k = self.v = None

    @property
    def rows(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)         # (B, Hkv, R, D)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)


class _CachedAttention:
    """New rows attend over the cached rows and themselves, under an explicit mask; their keys
    and values join the cache."""

    def __init__(self, kv: DraftKV, mask: torch.Tensor):
        self.kv, self.mask = kv, mask                              # mask (T, R + T) bool

    def attend(self, layer_idx: int, q, k, v, positions=None):
        # q (B, H, T, D), k/v (B, Hkv, T, D) -> (B, H, T, D) over the R + T rows
        self.kv.append(k, v)
        k, v = self.kv.k, self.kv.v                                # (B, Hkv, R + T, D)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask,
                                              enable_gqa=k.shape[1] != q.shape[1])


class EagleDrafter(_Drafter):
    """Fuse (feature_t, embed(token_{t+1})), one decoder layer, predict feature_{t+1}."""

    kind = "eagle"
    config_keys = frozenset({"norm_inputs"})

    def __init__(self, model_config: ModelConfig, seed: int | None = None, draft_vocab=None,
                 norm_inputs: bool = False):
        super().__init__()
        if not isinstance(norm_inputs, bool):
            raise TypeError(f"norm_inputs must be a bool, got {norm_inputs!r}")
        self._init_vocab(model_config, draft_vocab)
        self.seed, self.cfg = seed, model_config.with_(n_layer=1)
        self.norm_inputs = norm_inputs
        C = model_config.d_model
        with _seeded(seed):
            self.fc = nn.Linear(2 * C, C)
            self.block = Block(self.cfg, 0)
        if norm_inputs:                                            # ones: no draw from the RNG
            self.feature_norm = RMSNorm(C, model_config.norm_eps)
            self.token_norm = RMSNorm(C, model_config.norm_eps)

    def config_dict(self) -> dict:
        return {"norm_inputs": True} if self.norm_inputs else {}   # {}: the v1 file, unchanged

    def file_format(self) -> str:
        return FORMAT_V2 if self.norm_inputs else FORMAT

    def fuse(self, features: torch.Tensor, next_tokens: torch.Tensor, embed) -> torch.Tensor:
        """features (B, T, C), next_tokens (B, T) -> the layer's input rows (B, T, C)."""
        emb = embed(next_tokens)                                   # (B, T, C)
        if self.norm_inputs:
            features, emb = self.feature_norm(features), self.token_norm(emb)
        return self.fc(torch.cat([features, emb], dim=-1))         # (B, T, C)

    def _rope(self, positions: torch.Tensor, dtype):
        positions = positions if positions.dim() == 2 else positions[None]   # (1 or B, T)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype)
        return cos[:, None], sin[:, None], positions               # (1 or B, 1, T, D) each

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, embed,
                positions: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """features (B, T, C), next_tokens (B, T), positions (T,) or (B, T), mask (T, T) bool
        (None: causal) -> predicted next features (B, T, C). `embed` is the target's."""
        x = self.fuse(features, next_tokens, embed)                # (B, T, C)
        cos, sin, positions = self._rope(positions, x.dtype)
        return self.block(x, cos, sin, _MaskedAttention(mask), 0, positions)

    def keys_values(self, features: torch.Tensor, next_tokens: torch.Tensor, embed,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values of these rows, (B, Hkv, T, D) each, without running the
        rest of the layer: what later rows attend to. Same inputs as `forward`."""
        x = self.fuse(features, next_tokens, embed)                # (B, T, C)
        cos, sin, _ = self._rope(positions, x.dtype)
        attn, (B, T, _) = self.block.attn, x.shape
        H, Hkv, D = attn.n_head, attn.n_kv_head, attn.head_dim
        w = attn.qkv_proj.weight[H * D:]                           # the k and v rows only
        kv = F.linear(self.block.input_norm(x), w).view(B, T, 2 * Hkv, D)   # (B, T, 2Hkv, D)
        k, v = kv.transpose(1, 2).split([Hkv, Hkv], dim=1)         # (B, Hkv, T, D) each
        return apply_rope(k, cos, sin), v

    def extend(self, features: torch.Tensor, next_tokens: torch.Tensor, embed,
               positions: torch.Tensor, kv: DraftKV, mask: torch.Tensor) -> torch.Tensor:
        """Run T new rows that attend over the R rows in `kv` and themselves: mask (T, R + T)
        bool, True = seen. Their keys and values are appended to `kv`. -> (B, T, C)."""
        if mask.shape != (next_tokens.shape[-1], kv.rows + next_tokens.shape[-1]):
            raise ValueError(f"mask must be (T, R + T) = ({next_tokens.shape[-1]}, "
                             f"{kv.rows + next_tokens.shape[-1]}), got {tuple(mask.shape)}")
        x = self.fuse(features, next_tokens, embed)                # (B, T, C)
        cos, sin, positions = self._rope(positions, x.dtype)
        return self.block(x, cos, sin, _CachedAttention(kv, mask), 0, positions)
