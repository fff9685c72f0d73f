"""An EAGLE-3 head's configuration, derived from the policy's: which layers it reads, the Llama config vLLM loads."""

from __future__ import annotations

from transformers import LlamaConfig


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """Low, middle and high policy layers: vLLM's default (2, L // 2, L - 3) from 7 layers, (0, L // 2, L - 1)
    below (distinct from 3 layers on; vLLM and SGLang need distinct ids)."""
    if num_layers >= 7:
        return [2, num_layers // 2, num_layers - 3]
    return [0, num_layers // 2, num_layers - 1]


def eagle3_config(
    policy_config, aux_hidden_state_layer_ids: list[int] | None = None, draft_vocab_size: int | None = None
) -> LlamaConfig:
    """The drafter's config, derived from the policy's (same width, heads, RoPE and vocabulary; one layer)."""
    text = policy_config.get_text_config() if hasattr(policy_config, "get_text_config") else policy_config
    num_layers = text.num_hidden_layers
    ids = list(aux_hidden_state_layer_ids or default_aux_layer_ids(num_layers))
    if len(ids) != 3 or not all(0 <= i < num_layers for i in ids):
        raise ValueError(
            f"`aux_hidden_state_layer_ids` must be 3 policy layer ids in [0, {num_layers - 1}], got {ids}."
        )
    vocab = text.vocab_size
    draft_vocab_size = draft_vocab_size or vocab
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(
            f"`draft_vocab_size` must be in [1, {vocab}] (the policy's vocabulary), got {draft_vocab_size}."
        )
    if getattr(text, "final_logit_softcapping", None):
        raise ValueError("EAGLE-3 drafters need a policy without final logit soft-capping; use drafter_type='model'.")
    heads = text.num_attention_heads
    return LlamaConfig(
        architectures=["LlamaForCausalLMEagle3"],
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        hidden_act=text.hidden_act,
        rms_norm_eps=text.rms_norm_eps,
        rope_parameters=dict(text.rope_parameters),
        max_position_embeddings=text.max_position_embeddings,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=text.hidden_size,
        tie_word_embeddings=False,
        eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        torch_dtype=str(text.dtype).removeprefix("torch.") if getattr(text, "dtype", None) else "float32",
    )
