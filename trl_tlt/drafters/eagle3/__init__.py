"""EAGLE-3 drafter: one decoder layer on the policy's fused hidden states, in the layout vLLM and SGLang load.

Drafter position t reads the policy's hidden states at position t (three layers, `aux_hidden_state_layer_ids`,
concatenated and fused by `fc`) and the embedding of token t+1 (the policy's embedding, shared and frozen), and
predicts token t+2. Further draft steps feed the drafter's own pre-norm output back in place of the fused hidden
state, one position later, as vLLM's EAGLE proposer does:

    x      = cat(input_layernorm(embed(token)), hidden_norm(h))        # (.., 2H)
    h'     = h + o_proj(attn(x))                                        # attention over the drafter's cache
    h''    = h' + mlp(post_attention_layernorm(h'))                     # pre-norm output, fed back
    logits = lm_head(norm(h''))  over the draft vocabulary; target id = draft id + d2t[draft id]

Layer ids follow vLLM: id i is the input of policy layer i, i.e. Hugging Face's `hidden_states[i]`.
"""

from .config import default_aux_layer_ids, eagle3_config
from .drafter import Eagle3Drafter
from .model import (
    ENGINES,
    REQUIRED_TENSORS,
    WEIGHTS_NAME,
    Eagle3Layer,
    Eagle3Model,
    check_complete,
    shift_left,
    special_token_ids,
)


__all__ = [
    "ENGINES",
    "REQUIRED_TENSORS",
    "WEIGHTS_NAME",
    "Eagle3Drafter",
    "Eagle3Layer",
    "Eagle3Model",
    "check_complete",
    "default_aux_layer_ids",
    "eagle3_config",
    "shift_left",
    "special_token_ids",
]
