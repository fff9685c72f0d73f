"""The EAGLE-3 head (`Eagle3Model`) and its checkpoints, in the layout vLLM and SGLang load."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DynamicCache, LlamaConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from ...engine.sharding import PolicyWeights
from ..draft_vocab import prior_draft_ids
from .config import eagle3_config


WEIGHTS_NAME = "model.safetensors"


# `engine` values of `save_pretrained`: the two serving engines' layouts (layer ids differ), and trl-tlt's own
# checkpoint layout, which also holds heads that no engine can serve (a policy under 3 layers repeats a layer id).
ENGINES = ("vllm", "sglang", "trl-tlt")


# Every tensor an exported checkpoint must hold (besides the `midlayer.` layer weights; `d2t`/`t2d` only with a
# draft vocabulary smaller than the policy's).
REQUIRED_TENSORS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")


class Eagle3Layer(nn.Module):
    """vLLM's EAGLE-3 decoder layer: attention over concat(normed embedding, normed hidden state)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim,
        )
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * hidden, self.num_heads * head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * hidden, self.num_kv_heads * head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * hidden, self.num_kv_heads * head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(self.num_heads * head_dim, hidden, bias=False)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)

    def qkv(self, embeds, hidden, cos, sin):
        """Queries, keys, values (B, heads, n, d) with RoPE applied."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        shape = (*x.shape[:-1], -1, self.head_dim)
        attn = self.self_attn
        q = attn.q_proj(x).view(shape).transpose(1, 2)
        k = attn.k_proj(x).view(shape).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def finish(self, attn_out, hidden):
        """Output projection, residuals and MLP: the pre-norm output (B, n, H)."""
        hidden = hidden + self.self_attn.o_proj(attn_out.transpose(1, 2).flatten(2))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def repeat_kv(self, x):
        groups = self.num_heads // self.num_kv_heads
        return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class Eagle3Model(nn.Module):
    """The trainable EAGLE-3 head; the policy's embedding is held by reference (frozen, never saved).

    Args:
        config: From `eagle3_config(policy.config, ...)`.
        embed_tokens: The policy's input embedding.

    Example:
        >>> head = Eagle3Model.for_policy(policy)
        >>> head.save_pretrained("drafter/")  # loads in vLLM as speculative_config={"method": "eagle3", ...}
    """

    def __init__(self, config: LlamaConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(3 * config.target_hidden_size, hidden, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        object.__setattr__(self, "embed_tokens", embed_tokens)  # shared, not a submodule: not saved, not trained
        self.embedding_copy: torch.Tensor | None = None  # `use_policy_weights`

    @classmethod
    def for_policy(
        cls,
        policy: PreTrainedModel,
        aux_hidden_state_layer_ids: list[int] | None = None,
        draft_vocab_size: int | None = None,
        token_counts: torch.Tensor | None = None,
    ) -> Eagle3Model:
        """A new head for `policy`, on its device, warm-started by `init_from_policy`."""
        config = eagle3_config(policy.config, aux_hidden_state_layer_ids, draft_vocab_size)
        head = cls(config, policy.get_input_embeddings()).to(policy.device)
        head.init_from_policy(policy, token_counts)
        return head

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.config.eagle_config["eagle_aux_hidden_state_layer_ids"])

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def exportable(self) -> bool:
        """vLLM and SGLang capture each auxiliary layer once: the head needs 3 distinct layer ids (a policy of at
        least 3 layers). A head with repeated ids drafts and trains here, and saves with `engine="trl-tlt"` only."""
        return len(set(self.aux_layer_ids)) == 3

    def init_from_policy(self, policy: PreTrainedModel, token_counts: torch.Tensor | None = None) -> None:
        """Warm-start: draft vocabulary = the most frequent tokens of `token_counts` (without: the lowest ids and the
        special tokens, `prior_draft_ids`), LM head and final norm copied from the policy."""
        vocab, draft_vocab = self.config.vocab_size, self.config.draft_vocab_size
        if draft_vocab < vocab and token_counts is not None:
            draft_ids = torch.topk(token_counts.float(), draft_vocab).indices.sort().values
        elif draft_vocab < vocab:  # no rollouts yet: revised from the policy's own tokens by `DraftVocabulary`
            draft_ids = prior_draft_ids(vocab, draft_vocab, special_token_ids(policy))
        else:
            draft_ids = torch.arange(vocab)
        self.set_vocab(draft_ids)
        head = policy.get_output_embeddings().weight.detach()
        with torch.no_grad():
            self.lm_head.weight.copy_(head[draft_ids.to(head.device)])
            self.norm.weight.copy_(policy.get_decoder().norm.weight.detach())

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """`draft_ids`: ascending policy token ids of the draft vocabulary."""
        draft_ids = draft_ids.to(self.d2t.device)
        self.d2t.copy_(draft_ids - torch.arange(draft_ids.numel(), device=draft_ids.device))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    @torch.no_grad()
    def remap_vocab(self, draft_ids: torch.Tensor, policy_head_weight: torch.Tensor) -> torch.Tensor:
        """Switch to the draft vocabulary `draft_ids` (ascending policy ids, same size), in place: the LM head rows of
        tokens in both keep their weights, new tokens' rows start from the policy's LM head (as `init_from_policy`).
        Returns, per new row, the old row it came from (-1: new), to carry optimizer state along."""
        if draft_ids.numel() != self.config.draft_vocab_size:
            raise ValueError(
                f"A draft vocabulary of {self.config.draft_vocab_size} ids is needed, got {draft_ids.numel()}."
            )
        device = self.d2t.device
        draft_ids = draft_ids.to(device)
        old_row = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=device)
        old_row[self.draft_ids] = torch.arange(self.d2t.numel(), device=device)
        source = old_row[draft_ids]
        kept = source >= 0
        weight = policy_head_weight.detach()[draft_ids.to(policy_head_weight.device)].to(self.lm_head.weight)
        weight[kept] = self.lm_head.weight[source[kept]]
        self.lm_head.weight.copy_(weight)
        self.set_vocab(draft_ids)
        return source

    @torch.no_grad()
    def resize_draft_vocab(self, draft_ids: torch.Tensor, policy_head_weight: torch.Tensor | None) -> None:
        """A new draft vocabulary of another size (ascending policy ids): a new LM head, its rows from the policy's
        (for a head that has not trained yet: vLLM, which loads the head once, keeps its size); zeros without
        `policy_head_weight` (weights about to be loaded)."""
        hidden, size = self.config.hidden_size, draft_ids.numel()
        if not 0 < size <= self.config.vocab_size:
            raise ValueError(f"A draft vocabulary needs 1 to {self.config.vocab_size} ids, got {size}.")
        weight = self.lm_head.weight
        self.config.draft_vocab_size = size
        self.lm_head = nn.Linear(hidden, size, bias=False, device=weight.device, dtype=weight.dtype)
        if policy_head_weight is None:
            self.lm_head.weight.zero_()
        else:
            self.lm_head.weight.copy_(policy_head_weight.detach()[draft_ids.to(policy_head_weight.device)])
        self.d2t = torch.zeros(size, dtype=torch.long, device=self.d2t.device)
        self.set_vocab(draft_ids)

    @property
    def draft_ids(self) -> torch.Tensor:
        """Policy token id of every draft-vocabulary entry."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def use_policy_weights(self, weights: PolicyWeights | None) -> None:
        """Embed with the whole copy in `weights` (a sharded policy's own embedding is a shard between its forwards:
        `SpeculativeEngine.generate` copies it once per call), or with the policy's embedding module (None)."""
        self.embedding_copy = None if weights is None else weights.input_embedding

    @property
    def embedding_weight(self) -> torch.Tensor:
        """(V, H) the policy's input embedding the head reads: its whole copy, if any, else the policy's module's."""
        return self.embed_tokens.weight if self.embedding_copy is None else self.embedding_copy

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The policy's embedding of `input_ids`, outside autograd: training the head must never leave a gradient on
        the policy's (shared) embedding, which the policy's own optimizer step would then apply."""
        with torch.no_grad():
            return F.embedding(input_ids, self.embedding_weight)

    def fuse(self, policy_hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Hugging Face `hidden_states` of the policy -> fused (.., H) inputs."""
        aux = torch.cat([policy_hidden_states[i] for i in self.aux_layer_ids], dim=-1)
        return self.fc(aux.to(self.fc.weight.dtype))

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits from pre-norm outputs."""
        return self.lm_head(self.norm(prenorm))

    def to_policy_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """(.., V_draft) -> (.., V) with -inf outside the draft vocabulary."""
        if draft_logits.size(-1) == self.config.vocab_size:  # full vocabulary: d2t is all zeros
            return draft_logits
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return out.index_copy(-1, self.draft_ids, draft_logits)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: DynamicCache,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Cached inference over n new positions (the `RaggedKVModel` contract).

        `hidden_states` (B, n, H): fused policy states or the drafter's own pre-norm outputs. `attention_mask`
        (B, T) marks the valid cache positions, the new ones last (causal among themselves), or is a prepared
        additive mask (B, 1, n, T) (tree drafting). Returns policy-vocabulary `logits` and the
        pre-norm outputs as `hidden_states[0]`.
        """
        layer = self.midlayer
        embeds = self.embed(input_ids).to(hidden_states.dtype)
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        q, k, v = layer.qkv(embeds, hidden_states, cos, sin)
        k, v = past_key_values.update(k, v, 0)
        n, total = q.size(2), k.size(2)
        if attention_mask.dim() == 4:  # a prepared additive mask (B, 1, n, T): tree drafting
            mask = attention_mask.to(q.dtype)
        else:
            valid = attention_mask.bool()
            query_index = torch.arange(total - n, total, device=q.device)
            causal = torch.arange(total, device=q.device)[None, :] <= query_index[:, None]  # (n, T)
            mask = causal[None] & valid[:, None, :]
            mask = mask | (torch.arange(total, device=q.device)[None, :] == query_index[:, None])[None]  # never empty
            mask = mask[:, None]
        out = F.scaled_dot_product_attention(q, layer.repeat_kv(k), layer.repeat_kv(v), attn_mask=mask)
        prenorm = layer.finish(out, hidden_states)
        logits = self.to_policy_vocab(self.logits(prenorm))
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values, hidden_states=(prenorm,))

    def ttt_forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
        ttt_length: int,
    ) -> list[torch.Tensor]:
        """Training-time test: `ttt_length` unrolled draft steps over packed rows, all positions at once.

        Args:
            input_ids: (B, T) token t+1 at index t (the drafter's step-0 input).
            hidden_states: (B, T, H) fused policy states at position t.
            position_ids: (B, T) position of index t within its sample.
            seq_ids: (B, T) sample of index t (packed samples never attend across each other; 0 = padding).
            ttt_length: Unrolled steps J.

        Returns:
            J pre-norm outputs (B, T, H); step j at index t predicts token t+j+2. Step j's query at index t attends
            to the step-0 keys at indices s <= t of its sample and to its own steps 1..j at index t: exactly the
            cache inference builds when it drafts j tokens after position t.
        """
        layer = self.midlayer
        scale = 1.0 / math.sqrt(layer.head_dim)
        same = seq_ids[:, :, None] == seq_ids[:, None, :]
        index = torch.arange(input_ids.size(1), device=input_ids.device)
        base_mask = same & (index[None, :, None] >= index[None, None, :])  # (B, T, T)
        keys, values, outputs = [], [], []
        hidden = hidden_states
        for j in range(ttt_length):
            ids_j = shift_left(input_ids, j, 0)
            embeds = self.embed(ids_j).to(hidden.dtype)
            cos, sin = self.rotary_emb(hidden, position_ids + j)
            q, k, v = layer.qkv(embeds, hidden, cos, sin)
            k, v = layer.repeat_kv(k), layer.repeat_kv(v)
            keys.append(k)
            values.append(v)
            scores = torch.matmul(q, keys[0].transpose(-1, -2)) * scale  # (B, h, T, T)
            scores = scores.masked_fill(~base_mask[:, None], float("-inf"))
            diag = [(q * keys[i]).sum(-1, keepdim=True) * scale for i in range(1, j + 1)]  # (B, h, T, 1) each
            probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
            out = torch.matmul(probs[..., : scores.size(-1)], values[0])
            for i in range(1, j + 1):
                out = out + probs[..., scores.size(-1) + i - 1 : scores.size(-1) + i] * values[i]
            hidden = layer.finish(out, hidden)
            outputs.append(hidden)
        return outputs

    # ----- checkpoint (the layout vLLM's LlamaForCausalLMEagle3 and SGLang load) -----

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The saved tensors; `d2t`/`t2d` only with a reduced draft vocabulary (vLLM rejects them otherwise)."""
        skip = (
            ("rotary_emb",) if self.config.draft_vocab_size < self.config.vocab_size else ("rotary_emb", "d2t", "t2d")
        )
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith(skip)}

    def save_pretrained(
        self, path: str | Path, engine: str = "vllm", state_dict: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Write config.json + model.safetensors. `engine="sglang"` writes SGLang's layer ids (vLLM's + 1);
        `engine="trl-tlt"` writes vLLM's layout without requiring an exportable head (trainer checkpoints).
        `state_dict`: a snapshot from `export_state_dict` to write instead of the live weights (background saves)."""
        if engine not in ENGINES:
            raise ValueError(f"`engine` must be one of {ENGINES}, got {engine!r}.")
        state = self.export_state_dict() if state_dict is None else state_dict
        check_complete(state, self.config.to_dict(), exportable=engine != "trl-tlt")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = self.config.to_dict()
        if engine == "sglang":
            ids = [i + 1 for i in self.aux_layer_ids]
            config["eagle_config"] = {**config["eagle_config"], "eagle_aux_hidden_state_layer_ids": ids}
        save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt", "engine": engine})
        (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    def frozen_copy(self) -> Eagle3Model:
        """A copy with its own weights, frozen (e.g. to compare against as this one trains), still sharing the
        policy's embedding."""
        shared = (self.embed_tokens, self.embedding_copy)
        frozen = copy.deepcopy(self, memo={id(x): x for x in shared if x is not None})
        return frozen.requires_grad_(False)

    @classmethod
    def from_pretrained(cls, path: str | Path, policy: PreTrainedModel) -> Eagle3Model:
        """Load a drafter written by `save_pretrained` (vLLM layout) for `policy`; refuses incomplete checkpoints."""
        path = Path(path)
        if not (path / "config.json").is_file() or not (path / WEIGHTS_NAME).is_file():
            raise FileNotFoundError(f"{path} is not an EAGLE-3 drafter: it needs config.json and {WEIGHTS_NAME}.")
        try:
            raw = json.loads((path / "config.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"Cannot read the EAGLE-3 drafter config {path / 'config.json'}: {error}") from error
        try:
            state = load_file(str(path / WEIGHTS_NAME))
            with safe_open(str(path / WEIGHTS_NAME), "pt") as f:
                engine = (f.metadata() or {}).get("engine", "vllm")
        except Exception as error:  # a truncated or foreign file: say which one
            raise ValueError(f"Cannot read the EAGLE-3 drafter weights {path / WEIGHTS_NAME}: {error}") from error
        if engine == "sglang":  # its layer ids are output-indexed (vLLM's + 1): loading them here would shift layers
            raise ValueError(
                f"{path} was saved for SGLang (output-indexed layer ids); load the drafter saved with engine='vllm'."
            )
        check_complete(state, raw, exportable=engine != "trl-tlt")
        config = LlamaConfig.from_dict(raw)
        policy_text = policy.config.get_text_config()
        if config.target_hidden_size != policy_text.hidden_size or config.vocab_size != policy_text.vocab_size:
            raise ValueError(
                f"Drafter {path} was built for a policy with hidden size {config.target_hidden_size} and vocabulary "
                f"{config.vocab_size}; this policy has {policy_text.hidden_size} and {policy_text.vocab_size}."
            )
        layer_ids = raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        if max(layer_ids) >= policy_text.num_hidden_layers:
            raise ValueError(
                f"Drafter {path} reads policy layers {layer_ids}; this policy has {policy_text.num_hidden_layers}. "
                "It was built for another policy: warm-start one for this policy (trl-tlt train-drafter)."
            )
        model = cls(config, policy.get_input_embeddings()).to(state["fc.weight"].dtype)  # the saved dtype: exact
        missing = set(model.export_state_dict()) - set(state)
        if missing:
            raise ValueError(f"Drafter checkpoint {path} lacks {sorted(missing)}.")
        model.load_state_dict(state, strict=False)
        return model.to(policy.device)


def check_complete(state: dict[str, torch.Tensor], config: dict, exportable: bool = True) -> None:
    """Refuse a checkpoint without layer ids, vocabulary mapping or any tensor (vLLM would load it silently), and,
    when it is meant for vLLM or SGLang (`exportable`), one whose layer ids repeat."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    reduced_vocab = config.get("draft_vocab_size") is not None and config["draft_vocab_size"] < config.get(
        "vocab_size", 0
    )
    required = REQUIRED_TENSORS if reduced_vocab else tuple(n for n in REQUIRED_TENSORS if n not in ("d2t", "t2d"))
    missing = [name for name in required if name not in state]
    if not any(name.startswith("midlayer.") for name in state):
        missing.append("midlayer.*")
    if not ids or len(ids) != 3:
        missing.append("eagle_config.eagle_aux_hidden_state_layer_ids")
    elif exportable and len(set(ids)) != 3:
        raise ValueError(
            f"EAGLE-3 layer ids {ids} repeat a layer: vLLM and SGLang capture each layer once and would break. Build the "
            "drafter with 3 distinct `aux_hidden_state_layer_ids` (the policy needs at least 3 layers), or save it with "
            "engine='trl-tlt' to keep it for trl-tlt only."
        )
    if config.get("draft_vocab_size") is None:
        missing.append("draft_vocab_size")
    if missing:
        raise ValueError(f"Incomplete EAGLE-3 drafter: missing {missing}. Build it with Eagle3Model and save again.")


def special_token_ids(policy: PreTrainedModel) -> list[int]:
    """The policy's EOS, BOS and padding ids (config and generation config): always in a draft vocabulary."""
    ids = []
    for config in (policy.config.get_text_config(), getattr(policy, "generation_config", None)):
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            value = getattr(config, name, None)
            ids += value if isinstance(value, list | tuple) else [] if value is None else [value]
    return ids


def shift_left(x: torch.Tensor, j: int, fill) -> torch.Tensor:
    """x[:, t + j] at index t (`fill` past the end), along dim 1; as long as x (all `fill` for j >= its length)."""
    if j == 0:
        return x
    j = min(j, x.size(1))
    pad = x.new_full((x.size(0), j, *x.shape[2:]), fill)
    return torch.cat([x[:, j:], pad], dim=1)
