"""EAGLE-3 drafter: cached inference == training-time test, packing isolation, lossless engine, checkpoints."""

import json

import pytest
import torch

from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model, eagle3_config
from trl_tlt.engine.generate import SpeculativeEngine
from trl_tlt.engine.kv_cache import RaggedKVModel
from trl_tlt.engine.sampling import SamplingParams
from trl_tlt.tooling.tiny import build_tiny_model


@pytest.fixture(scope="module")
def policy64(tokenizer):
    torch.manual_seed(0)
    return build_tiny_model(
        tokenizer, arch="qwen2", hidden_size=64, num_hidden_layers=4, num_attention_heads=2, dtype=torch.float64
    ).eval()


def make_head(policy, draft_vocab_size=None, seed=1):
    torch.manual_seed(seed)
    config = eagle3_config(policy.config, draft_vocab_size=draft_vocab_size)
    head = Eagle3Model(config, policy.get_input_embeddings()).to(torch.float64)
    with torch.no_grad():  # random weights large enough that mistakes show
        for p in head.parameters():
            p.normal_(0, 0.2)
    if draft_vocab_size:
        head.set_vocab(torch.randperm(policy.config.vocab_size)[:draft_vocab_size].sort().values)
    return head.eval()


def features(policy, head, ids):
    with torch.no_grad():
        out = policy(torch.tensor([ids]), output_hidden_states=True)
    return head.fuse(out.hidden_states)[0]  # (N, H)


def test_config_derives_from_policy(policy64):
    config = eagle3_config(policy64.config)
    assert config.hidden_size == policy64.config.hidden_size and config.num_hidden_layers == 1
    assert config.eagle_config["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert config.architectures == ["LlamaForCausalLMEagle3"]
    with pytest.raises(ValueError, match="aux_hidden_state_layer_ids"):
        eagle3_config(policy64.config, aux_hidden_state_layer_ids=[0, 1, 4])
    with pytest.raises(ValueError, match="draft_vocab_size"):
        eagle3_config(policy64.config, draft_vocab_size=10**6)


@pytest.mark.parametrize("draft_vocab_size", [None, 64])
def test_ttt_equals_cached_inference(policy64, draft_vocab_size):
    """Step j of the training-time test at index t == drafting j tokens after position t with the KV cache."""
    head = make_head(policy64, draft_vocab_size)
    ids = torch.randint(0, policy64.config.vocab_size, (12,)).tolist()
    fused = features(policy64, head, ids)
    n = len(ids) - 1
    inputs = torch.tensor([ids[1:]])
    outs = head.ttt_forward(inputs, fused[None, :n], torch.arange(n)[None], torch.ones(1, n, dtype=torch.long), 3)
    for t in (0, 4, n - 3):
        runner = RaggedKVModel(head, output_hidden_states=True)
        runner.prefill([ids[1 : t + 2]], hidden_states=fused[None, : t + 1])
        prenorm = runner.hidden_states[0][:, -1]
        torch.testing.assert_close(prenorm[0], outs[0][0, t])
        for j in (1, 2):
            one = torch.ones(1, 1, dtype=torch.bool)
            runner.extend(torch.tensor([[ids[t + j + 1]]]), one, hidden_states=prenorm[:, None])
            prenorm = runner.hidden_states[0][:, 0]
            torch.testing.assert_close(prenorm[0], outs[j][0, t])


def test_packed_samples_do_not_attend_across(policy64):
    head = make_head(policy64)
    a = torch.randint(0, policy64.config.vocab_size, (7,)).tolist()
    b = torch.randint(0, policy64.config.vocab_size, (9,)).tolist()
    fa, fb = features(policy64, head, a), features(policy64, head, b)
    alone = head.ttt_forward(torch.tensor([b[1:]]), fb[None, :8], torch.arange(8)[None], torch.ones(1, 8).long(), 2)
    packed_ids = torch.tensor([a[1:] + b[1:]])
    packed_h = torch.cat([fa[:6], fb[:8]])[None]
    positions = torch.cat([torch.arange(6), torch.arange(8)])[None]
    seq_ids = torch.tensor([[1] * 6 + [2] * 8])
    packed = head.ttt_forward(packed_ids, packed_h, positions, seq_ids, 2)
    torch.testing.assert_close(packed[0][0, 6:], alone[0][0])
    torch.testing.assert_close(packed[1][0, 6:12], alone[1][0, :6])  # the last index's step 1 reads past b's end


@pytest.mark.parametrize("draft_vocab_size", [None, 64])
def test_draft_session_equals_cached_inference(policy64, draft_vocab_size):
    """The lean drafting path (`_DraftSession`) == `Eagle3Model.forward` through the ragged cache, for a chain and for
    a tree (each node attends to its own ancestors only), over a cache with holes."""
    from trl_tlt.drafters.eagle3.lean import _DraftSession, _LeanHead

    head = make_head(policy64, draft_vocab_size)
    lean_head = _LeanHead(head)
    # LlamaRMSNorm computes in float32 whatever the input; the lean path's fused norm keeps float64.
    close = {"atol": 1e-5, "rtol": 1e-5}
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (7, 4)]
    hidden = torch.randn(2, 7, 64, generator=g, dtype=torch.float64)

    def runner_with_hole():
        runner = RaggedKVModel(head, output_hidden_states=True)
        runner.prefill(prompts, hidden_states=hidden)
        step = torch.tensor([[5, 6], [7, 8]])
        runner.extend(step, torch.ones(2, 2, dtype=torch.bool), hidden_states=hidden[:, :2])
        runner.truncate(runner.lengths - 1)  # a hole in each row
        return runner

    # Committing ragged positions (the flush of the policy's accepted tokens) == runner.extend.
    runner, lean = runner_with_hole(), runner_with_hole()
    ids, valid = torch.tensor([[9, 10, 11], [12, 13, 0]]), torch.tensor([[True, True, True], [True, True, False]])
    pending = torch.randn(2, 3, 64, generator=g, dtype=torch.float64)
    reference = runner.extend(ids, valid, hidden_states=pending)
    logits, prenorm = _DraftSession.commit(lean_head, lean, ids, pending, valid)
    torch.testing.assert_close(logits, reference[[0, 1], [2, 1]], **close)
    torch.testing.assert_close(prenorm, runner.hidden_states[0][[0, 1], [2, 1]], **close)
    torch.testing.assert_close(lean.cache.layers[0].keys, runner.cache.layers[0].keys, **close)
    assert torch.equal(lean.attention_mask, runner.attention_mask) and torch.equal(lean.lengths, runner.lengths)

    tokens = torch.randint(3, 200, (2, 3), generator=g)
    h0 = torch.randn(2, 1, 64, generator=g, dtype=torch.float64)
    runner, session = runner_with_hole(), None
    session = _DraftSession(lean_head, runner, depth=3)
    h_ref = h_lean = h0
    for j in range(3):  # a chain: depth j + 1 fed with the previous step's pre-norm output
        logits_ref = runner.extend(tokens[:, j : j + 1], torch.ones(2, 1, dtype=torch.bool), hidden_states=h_ref)
        h_ref = runner.hidden_states[0]
        logits, h_lean = session.step(tokens[:, j : j + 1], h_lean, depth=j + 1)
        torch.testing.assert_close(logits, logits_ref, **close)
        torch.testing.assert_close(h_lean, h_ref, **close)

    # A tree: two root children (slots 0, 1), then two children of slot 1 (slots 2, 3).
    runner = runner_with_hole()
    session = _DraftSession(lean_head, runner, depth=2, width=2)
    base = runner.lengths[:, None]
    level1, level2 = tokens[:, :2], tokens[:, 1:]
    h1 = torch.randn(2, 2, 64, generator=g, dtype=torch.float64)
    eye = torch.eye(2, dtype=torch.bool).expand(2, 2, 2)
    ref1 = runner.extend_tree(level1, torch.ones(2, 2, dtype=torch.bool), base.expand(2, 2), eye, hidden_states=h1)
    lean1, _ = session.step(level1, h1, depth=1, visible=eye)
    torch.testing.assert_close(lean1, ref1, **close)
    visible = torch.tensor([[False, True, True, False], [False, True, False, True]]).expand(2, 2, 4)
    h2 = runner.hidden_states[0][:, 1:2].expand(2, 2, 64)
    ref2 = runner.extend_tree(
        level2, torch.ones(2, 2, dtype=torch.bool), base.expand(2, 2) + 1, visible, hidden_states=h2
    )
    lean2, _ = session.step(level2, h2, depth=2, visible=visible)
    torch.testing.assert_close(lean2, ref2, **close)


def test_lean_head_follows_weight_updates(policy64):
    """The drafter's fused inference weights are rebuilt when the head's weights change in place (online training)
    or are replaced, and reused otherwise."""
    head = make_head(policy64)
    drafter = Eagle3Drafter(head)
    lean = drafter._lean_head()
    assert drafter._lean_head() is lean
    with torch.no_grad():
        head.midlayer.self_attn.k_proj.weight.mul_(2.0)  # an optimizer step updates parameters in place
    updated = drafter._lean_head()
    assert updated is not lean
    rows = slice(head.midlayer.self_attn.q_proj.out_features, sum(updated.qkv_sizes[:1]))  # k's rows
    torch.testing.assert_close(updated.qkv_weight[rows], 2.0 * lean.qkv_weight[rows])
    head.midlayer.mlp.up_proj.weight = torch.nn.Parameter(head.midlayer.mlp.up_proj.weight.detach().clone() + 1)
    assert drafter._lean_head() is not updated


@pytest.mark.parametrize("draft_vocab_size", [None, 64])
def test_engine_greedy_equals_plain_decoding(policy64, tokenizer, draft_vocab_size):
    head = make_head(policy64, draft_vocab_size)
    prompts = [tokenizer.encode(t) for t in ("12+34=", "The quick brown", "Count: 1 2 3", "7")]
    params = SamplingParams(do_sample=False, max_new_tokens=20, eos_token_ids=(tokenizer.eos_token_id,))
    plain = SpeculativeEngine(policy64).generate(prompts, params)
    spec = SpeculativeEngine(policy64, drafter=Eagle3Drafter(head), num_speculative_tokens=3).generate(prompts, params)
    assert spec.completion_ids == plain.completion_ids
    assert spec.stats.num_drafts > 0


def test_save_load_round_trip_is_bit_exact(policy64, tmp_path):
    head = make_head(policy64, draft_vocab_size=64)
    head.save_pretrained(tmp_path / "d")
    loaded = Eagle3Model.from_pretrained(tmp_path / "d", policy64)
    for name, tensor in head.export_state_dict().items():
        assert torch.equal(tensor, loaded.export_state_dict()[name]), name
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 64
    assert "embed_tokens.weight" not in head.export_state_dict()
    head.save_pretrained(tmp_path / "s", engine="sglang")
    sglang = json.loads((tmp_path / "s" / "config.json").read_text())["eagle_config"]
    assert sglang["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in head.aux_layer_ids]


def test_incomplete_export_raises(policy64, tmp_path):
    head = make_head(policy64, draft_vocab_size=64)
    head.save_pretrained(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    del config["eagle_config"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        Eagle3Model.from_pretrained(tmp_path / "d", policy64)
    with pytest.raises(ValueError, match="repeat a layer"):
        Eagle3Model(eagle3_config(policy64.config, [1, 1, 3]), policy64.get_input_embeddings()).save_pretrained(
            tmp_path / "f"
        )
    head.register_buffer("d2t", None)
    with pytest.raises(ValueError, match="d2t"):
        head.save_pretrained(tmp_path / "e")
    assert not (tmp_path / "e").exists()


def test_frozen_copy_owns_its_weights_and_shares_the_embedding(policy64):
    head = Eagle3Model.for_policy(policy64)
    frozen = head.frozen_copy()
    assert frozen.embed_tokens is head.embed_tokens is policy64.get_input_embeddings()
    assert not any(p.requires_grad for p in frozen.parameters())
    with torch.no_grad():
        next(head.parameters()).add_(1.0)
    assert not torch.equal(next(head.parameters()), next(frozen.parameters()))
