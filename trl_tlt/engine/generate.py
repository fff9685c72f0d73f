"""Batched, lossless speculative generation for any Hugging Face causal LM (CPU and CUDA).

The engine is the contract of TRL's `_generate_single_turn`: ragged prompt ids in; completion ids (EOS kept,
nothing after it) and the log-probability of each sampled token under the processed distribution out.

One decode step, for the B active rows:

    k      = speculation.choose(B)                      # 0 = plain decoding
    drafts = drafter.propose(ctx, k)                     # (B, k) + q, per-row draft lengths
    logits = policy([last_token, d_1..d_k])              # one forward scores all k+1 positions
    n, x   = verify_drafts(processed(logits), drafts, q) # accept a prefix, emit a corrected/bonus token
    cache keeps last_token, d_1..d_n;  rows emit d_1..d_n, x;  finished rows leave the batch

Rows that end (EOS or budget) are dropped at once, so the long tail runs at its real batch size. A policy sharded
across processes (FSDP, ZeRO-3) keeps the ranks in lockstep as `generate(synced_gpus=True)` does (`sharding.py`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import transformers
from packaging.version import Version
from transformers import PreTrainedModel
from transformers.utils import logging

from .draft import DRAFT_SOURCES, DraftContext, Drafter, checked_draft
from .features import FeatureRecorder
from .kv_cache import RaggedKVModel
from .rejection_sampler import verify_drafts
from .sampling import SamplingParams, process_logits, upcast_logits
from .sharding import (
    WEIGHT_NAMES,
    Lockstep,
    PolicyWeights,
    copying_policy_weights,
    needs_lockstep,
    policy_is_sharded,
)
from .speculation import (
    Arm,
    FixedSpeculation,
    SpeculationPolicy,
    tree_arm,  # noqa: F401  (its old import path, deprecated)
)
from .stats import GenerationStats
from .tree import checked_tree, depths_from_ancestors, verify_tree


logger = logging.get_logger(__name__)


@dataclass
class GenerationOutput:
    """`features`: with `generate(record_layers=...)`, per row the policy's hidden states at those layers for each
    forwarded position, (len(prompt) + len(completion) - 1, len(record_layers), H) in host memory; else None.
    `policy_weights`: the whole copies of the policy's embedding and LM head taken for a sharded policy; else None."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    stats: GenerationStats
    features: list[torch.Tensor] | None = None
    policy_weights: PolicyWeights | None = None


@dataclass
class _Run:
    """The state of one `generate` call: the policy's cache, the drafters' view (`ctx`), what each row emitted."""

    policy: RaggedKVModel
    ctx: DraftContext
    completions: list[list[int]]
    logprobs: list[list[float]]
    seen: torch.Tensor | None  # (B, V) tokens each row has seen (for the repetition penalty)
    eos: torch.Tensor
    vocab: int
    stats: GenerationStats
    started: dict[str, Drafter] = field(default_factory=dict)
    recorder: FeatureRecorder | None = None

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices into the active rows), in the cache, the context and the started drafters."""
        self.policy.select(rows)
        self.ctx.row_ids = self.ctx.row_ids[rows]
        self.seen = None if self.seen is None else self.seen[rows]
        for drafter in self.started.values():
            drafter.select(rows)


# Whether `generate`'s repetition penalty counts a row's left padding as seen: transformers < 5.23 penalises every id of
# its input, padding included; from 5.23 it skips each row's leading padding (`prompt_ignore_length`, read from the
# attention mask). Pre-releases count as their release (5.23.0.dev0 as 5.23.0).
GENERATE_PENALISES_PADDING = Version(Version(transformers.__version__).base_version) < Version("5.23.0")


def _prompt_tokens(
    prompts: list[list[int]], vocab: int, device, padded_width: int | None, pad_token_id: int
) -> torch.Tensor:
    """(B, V) the tokens each row has seen before its completion, for the repetition penalty: its prompt, and the pad
    token where `generate` would have left-padded the row and counts that padding (`GENERATE_PENALISES_PADDING`).
    Ids the LM head does not score (an embedding larger than it) cannot be penalised: left out, as `generate` does."""
    seen = torch.zeros((len(prompts), vocab), dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        ids = torch.tensor(prompt, dtype=torch.long, device=device)
        seen[row, ids[ids < vocab]] = True
        pads = GENERATE_PENALISES_PADDING and padded_width is not None and len(prompt) < padded_width
        if pads and pad_token_id < vocab:
            seen[row, pad_token_id] = True
    return seen


def group_ids_from_prompts(prompts: list[list[int]]) -> list[int]:
    """Rows with identical prompts (GRPO's `num_generations` copies) share a group id."""
    ids: dict[tuple[int, ...], int] = {}
    return [ids.setdefault(tuple(p), len(ids)) for p in prompts]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeculativeEngine:
    """Generate with a Hugging Face causal LM, speculating with `drafter`.

    Args:
        model: The policy (any causal LM with full attention), in eval mode.
        drafter: Proposes draft tokens: one `Drafter`, or several by name for an adaptive `speculation` policy;
            None = no speculation (the engine is then a plain batched decoder that drops finished rows).
        num_speculative_tokens: k for the default fixed policy (single drafter).
        speculation: Chooses (drafter name, k) per decode step (overrides `num_speculative_tokens`).
        pad_token_id: Filler id for padded positions (never attended to).

    Example:
        >>> engine = SpeculativeEngine(model, drafter=NgramDrafter(), num_speculative_tokens=4)
        >>> out = engine.generate(prompt_ids, SamplingParams(max_new_tokens=128, eos_token_ids=(eos,)))
        >>> out.completion_ids, out.logprobs, out.stats.mean_acceptance_length
    """

    def __init__(
        self,
        model: PreTrainedModel,
        drafter: Drafter | dict[str, Drafter] | None = None,
        num_speculative_tokens: int = 4,
        speculation: SpeculationPolicy | None = None,
        pad_token_id: int | None = None,
    ):
        self.model = model
        if drafter is None:
            self.drafters: dict[str, Drafter] = {}
        elif isinstance(drafter, Drafter):
            self.drafters = {"default": drafter}
        else:
            self.drafters = dict(drafter)
        if speculation is None:
            if len(self.drafters) > 1:
                raise ValueError("Several drafters need a `speculation` policy (e.g. BanditSpeculation) to choose.")
            name = next(iter(self.drafters), None)
            speculation = FixedSpeculation(num_speculative_tokens if name else 0, name)
        self.speculation = speculation
        self.pad_token_id = pad_token_id if pad_token_id is not None else (model.config.pad_token_id or 0)

    def _check_prompts(self, prompts: list[list[int]], params: SamplingParams) -> None:
        if not prompts:
            raise ValueError("`prompts` is empty: pass at least one prompt.")
        context = getattr(self.model.config, "max_position_embeddings", None)
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"Prompt {i} is empty: every prompt needs at least one token (e.g. a BOS token).")
            if context is not None and len(prompt) + params.max_new_tokens > context:
                # As `generate` does: go on (rotary positions extrapolate; learned ones fail in the model's forward).
                logger.warning_once(
                    f"A prompt of {len(prompt)} tokens plus max_new_tokens={params.max_new_tokens} exceeds the model's "
                    f"max_position_embeddings ({context}); generation may degrade past it (as with `generate`)."
                )

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
        group_ids: list[int] | None = None,
        padded_width: int | None = None,
        record_layers: list[int] | None = None,
        record_max_bytes: int | None = None,
        synced: bool | None = None,
        copy_policy_weights: bool | tuple[str, ...] | None = None,
    ) -> GenerationOutput:
        """Complete every prompt. Returns completion ids, their processed logprobs and `GenerationStats`.

        `padded_width`: sample as `generate` does on these prompts left-padded to this width with `pad_token_id`
        (GRPOTrainer's batch): under the repetition penalty a shorter row has seen the pad token where `generate`
        counts its padding (transformers < 5.23, `GENERATE_PENALISES_PADDING`). None: unpadded.
        `record_layers`: also return the policy's hidden states at these layers (`LayerTap` ids) for every position
        its forwards computed (`GenerationOutput.features`, what drafter training reads), at most `record_max_bytes`
        of them (`FeatureRecorder`). Nothing sampled changes.
        `synced`: keep every process of the default group forwarding until all are done, as `generate`'s
        `synced_gpus` (None: when the policy is sharded across processes, `needs_lockstep`). `copy_policy_weights`:
        copy the policy's embedding and LM head whole during the prefill, for the drafters and the output
        (`PolicyWeights`; None: when the policy is sharded, `policy_is_sharded`; a tuple: only those `PolicyWeights`
        fields, e.g. `("input_embedding",)` for an EAGLE-3 head's drafting alone).
        """
        self._check_prompts(prompts, params)
        start = time.perf_counter()
        device = self.model.device
        batch = len(prompts)
        policy = self._policy_runner(record_layers)
        recorder = FeatureRecorder(record_layers, batch, max_bytes=record_max_bytes) if record_layers else None
        synced = needs_lockstep(self.model) if synced is None else synced
        lockstep = Lockstep(self.model, self.pad_token_id) if synced else None
        if copy_policy_weights is None:
            copy_policy_weights = policy_is_sharded(self.model)
        copied = WEIGHT_NAMES if copy_policy_weights is True else tuple(copy_policy_weights or ())

        # Prefill, then the first token.
        with copying_policy_weights(self.model, copied) if copied else contextlib.nullcontext() as copies:
            last_logits = policy.prefill(prompts, self.pad_token_id)[:, None]  # (B, 1, V)
        weights = PolicyWeights(**copies) if copied else None
        if recorder is not None:
            recorder.record(policy.hidden_states, torch.arange(batch, device=device), policy.attention_mask)
        run = _Run(
            policy=policy,
            ctx=DraftContext(
                sequences=[list(p) for p in prompts],
                row_ids=torch.arange(batch, device=device),
                group_ids=group_ids if group_ids is not None else group_ids_from_prompts(prompts),
                params=params,
                generator=generator,
                prompt_lengths=[len(p) for p in prompts],
                policy_weights=weights,
            ),
            completions=[[] for _ in prompts],
            logprobs=[[] for _ in prompts],
            seen=_prompt_tokens(prompts, last_logits.size(-1), device, padded_width, self.pad_token_id)
            if params.uses_repetition_penalty
            else None,
            eos=torch.tensor(params.eos_token_ids or [-1], device=device),
            vocab=last_logits.size(-1),
            stats=GenerationStats(num_prompts=batch),
            recorder=recorder,
        )
        keep = self._first_token(run, last_logits)
        run.stats.prefill_s = time.perf_counter() - start
        # Drafters start lazily, at their first use; those that read the policy's hidden states start now and
        # see every forward (the states of earlier positions are gone once the next forward runs).
        for name, drafter in self.drafters.items():
            if getattr(drafter, "needs_hidden_states", False):
                self._start_drafter(run, name)
        self._decode(run, keep, lockstep)
        features = None
        if recorder is not None:  # a row's last token was never forwarded
            features = recorder.rows([len(p) + len(c) - 1 for p, c in zip(prompts, run.completions, strict=True)])
        run.stats.total_s = time.perf_counter() - start
        run.stats.lockstep = synced
        run.stats.num_placeholder_forwards = 0 if lockstep is None else lockstep.placeholder_forwards
        return GenerationOutput(run.completions, run.logprobs, run.stats, features, weights)

    @staticmethod
    def _first_token(run: _Run, last_logits: torch.Tensor) -> torch.Tensor:
        """The token after each prompt, from the prefill's logits (a verification with no drafts); the rows going on."""
        batch, device, params = last_logits.size(0), last_logits.device, run.ctx.params
        no_drafts = (
            torch.zeros((batch, 0), dtype=torch.long, device=device),
            torch.zeros(batch, dtype=torch.long, device=device),
        )
        seen = None if run.seen is None else run.seen[:, None]
        logp = process_logits(upcast_logits(last_logits), params, seen)
        _, next_tokens, emitted_lp = verify_drafts(logp, *no_drafts, None, params.do_sample, run.ctx.generator)
        _sync(device)
        keep, num_emitted = SpeculativeEngine._emit(run, *no_drafts, next_tokens, emitted_lp)
        run.stats.num_emitted_tokens += num_emitted
        return keep

    def _decode(self, run: _Run, keep: torch.Tensor, lockstep: Lockstep | None) -> None:
        """Decode steps until every row is done; under `lockstep`, until every rank's are (a rank whose rows are done
        runs placeholder forwards meanwhile: the other ranks' forwards gather the parameters it holds)."""
        if lockstep is not None:  # generate's first check, which consumes the prefill: the same collectives as it
            lockstep.any_rank_unfinished(True)
        while True:
            if not keep.all():
                if run.recorder is not None:
                    run.recorder.finished(run.ctx.row_ids[~keep])
                run.select(keep.nonzero().squeeze(1))
                keep = keep[keep]
            unfinished = run.ctx.row_ids.numel() > 0
            if lockstep is None and not unfinished:
                return
            if lockstep is not None and not lockstep.any_rank_unfinished(unfinished):
                return
            if unfinished:
                keep = self._decode_step(run)
            else:
                lockstep.placeholder_forward()

    def _policy_runner(self, record_layers: list[int] | None) -> RaggedKVModel:
        """The policy's ragged runner, keeping the hidden states of the layers the drafters read (`Drafter.
        hidden_layers`) and those recorded: only these (`LayerTap`), or every layer for a drafter that asks for
        them all."""
        layers, every = set(record_layers or ()), False
        for drafter in self.drafters.values():
            if getattr(drafter, "needs_hidden_states", False):
                wanted = getattr(drafter, "hidden_layers", None)
                every |= wanted is None
                layers |= set(wanted or ())
        return RaggedKVModel(self.model, output_hidden_states=every, hidden_layers=None if every else sorted(layers))

    def _start_drafter(self, run: _Run, name: str) -> None:
        if name not in self.drafters:
            raise ValueError(f"The speculation policy chose drafter {name!r}; known: {sorted(self.drafters)}.")
        run.ctx.hidden_states = run.policy.hidden_states
        self.drafters[name].start(run.ctx)
        run.started[name] = self.drafters[name]

    def _decode_step(self, run: _Run) -> torch.Tensor:
        """One decode step of the active rows: choose an arm, draft, verify in one policy forward, emit. Returns the
        mask of rows still going."""
        device, params, stats = run.ctx.row_ids.device, run.ctx.params, run.stats
        active = run.ctx.row_ids.numel()
        step_start = time.perf_counter()
        arm = self.speculation.choose(active)
        name, k = arm.drafter, arm.k
        if k > 0 and name not in run.started:
            self._start_drafter(run, name)
        rows = run.ctx.row_ids.tolist()
        remaining = torch.tensor([params.max_new_tokens - len(run.completions[r]) for r in rows], device=device)
        last = torch.tensor([run.ctx.sequences[r][-1] for r in rows], device=device)[:, None]
        draft_ids, draft_probs, source, num_drafts, valid_rows, tree = self._draft(
            run.started[name] if k > 0 else None, arm, run.ctx, run.vocab, remaining
        )
        if k > 0:
            stats.num_invalid_drafts += int((~valid_rows).sum())
            _sync(device)
            stats.draft_s += time.perf_counter() - step_start

        verify_start = time.perf_counter()
        generator = run.ctx.generator
        if tree is not None:
            draft_ids, num_accepted, next_tokens, emitted_lp = self._verify_tree(
                run.policy, *tree, last, run.seen, params, generator
            )
        else:
            num_accepted, next_tokens, emitted_lp = self._verify_chain(
                run.policy, last, draft_ids, num_drafts, draft_probs, source, run.seen, params, generator
            )
        run.ctx.hidden_states = run.policy.hidden_states
        if run.recorder is not None:  # the positions the cache keeps: the last token and the accepted drafts
            kept = torch.arange(draft_ids.size(1) + 1, device=device)[None] <= num_accepted[:, None]
            run.recorder.record(run.ctx.hidden_states, run.ctx.row_ids, kept)
        keep, emitted = self._emit(run, draft_ids, num_accepted, next_tokens, emitted_lp)
        for drafter in run.started.values():
            drafter.accept(run.ctx, num_accepted)
        stats.verify_s += time.perf_counter() - verify_start

        step_seconds = time.perf_counter() - step_start
        stats.observe_step(active, k, name, tree is not None, emitted, num_drafts, num_accepted, step_seconds, source)
        self.speculation.update(active, arm, emitted, step_seconds)
        return keep

    @staticmethod
    def _draft(drafter: Drafter | None, arm: Arm, ctx: DraftContext, vocab: int, remaining: torch.Tensor):
        """This step's draft from `drafter` for `arm`, checked and cut to the token budget (`remaining` per row):
        (draft_ids, draft_probs, source, num_drafts, valid_rows, tree) with source the chain's `Draft.source` (None:
        all learned) and tree = (DraftTree, ancestors, depths) for a tree arm, else None; no drafter (k = 0): no
        drafts."""
        active, device = remaining.numel(), remaining.device
        if drafter is None:
            empty = torch.zeros((active, 0), dtype=torch.long, device=device)
            return empty, None, None, torch.zeros(active, dtype=torch.long, device=device), None, None
        k = arm.k
        if arm.is_tree:
            if not hasattr(drafter, "propose_tree"):
                raise ValueError(
                    f"The speculation policy chose a tree arm {arm} but drafter {arm.drafter!r} "
                    f"({type(drafter).__name__}) drafts chains only; use chain arms (Arm(name, k)) for it."
                )
            tree, ancestors, valid_rows = checked_tree(drafter.propose_tree(ctx, k, arm.topk, arm.verify), vocab, k)
            # Never draft past the budget: a path of depth d emits d + 1 tokens.
            depths = depths_from_ancestors(ancestors)
            tree.valid &= depths <= (remaining - 1)[:, None]
            return None, None, None, tree.valid.sum(dim=1), valid_rows, (tree, ancestors, depths)
        draft = drafter.propose(ctx, k)
        draft_ids, draft_probs, source, num_kept, cut = checked_draft(draft, vocab)
        # Never draft past the budget: the step emits num_drafts + 1 tokens at most.
        num_drafts = torch.minimum(num_kept, remaining - 1)
        # Verify only as many positions as the longest draft needs (a drafter may stop short of k).
        longest = int(num_drafts.max())
        draft_ids = draft_ids[:, :longest]
        source = None if source is None else source[:, :longest]
        draft_probs = None if draft_probs is None else draft_probs[:, :longest]
        return draft_ids, draft_probs, source, num_drafts, ~cut, None

    @staticmethod
    def _verify_chain(policy, last, draft_ids, num_drafts, draft_probs, source, seen, params, generator):
        """One policy forward over each row's last token and its chain draft; the accepted prefix stays in the cache.
        Returns (num_accepted, next_tokens, emitted_lp) as `verify_drafts`."""
        width = draft_ids.size(1) + 1
        valid = torch.arange(width, device=draft_ids.device)[None, :] < (num_drafts + 1)[:, None]  # (B, width)
        lengths_before = policy.lengths
        logits = policy.extend(torch.cat([last, draft_ids], dim=1), valid)  # (B, width, V)
        step_seen = None if seen is None else _seen_per_position(seen, draft_ids)
        logp = process_logits(upcast_logits(logits), params, step_seen)
        one_hot = None if source is None else source != DRAFT_SOURCES.index("learned")
        num_accepted, next_tokens, emitted_lp = verify_drafts(
            logp, draft_ids, num_drafts, draft_probs, params.do_sample, generator, one_hot
        )
        policy.truncate(lengths_before + 1 + num_accepted)
        return num_accepted, next_tokens, emitted_lp

    @staticmethod
    def _verify_tree(policy, tree, ancestors, depths, last, seen, params, generator):
        """One policy forward over [root, nodes] with tree attention, the walk (`verify_tree`), and the cache and
        hidden states reduced to the accepted path. Returns the path's tokens (B, D), num_accepted, the next tokens
        and the emitted logprobs, as `verify_drafts` does for a chain."""
        batch = last.size(0)
        valid = torch.cat([torch.ones_like(last, dtype=torch.bool), tree.valid], dim=1)
        max_depth = int(depths.masked_fill(~tree.valid, 0).max()) if tree.valid.numel() else 0
        positions = policy.lengths[:, None] + torch.cat([torch.zeros_like(last), depths], dim=1)
        tokens = torch.cat([last, tree.token_ids], dim=1)
        logits = policy.extend_tree(tokens, valid, positions, ancestors)  # (B, N+1, V)
        step_seen = None
        if seen is not None:  # tokens seen before a node: the context and its path (root included)
            one_hot = torch.zeros((*tokens.shape, seen.size(1)), device=seen.device).scatter_(
                2, tokens[..., None], 1.0
            )
            step_seen = seen[:, None, :] | (ancestors.float() @ one_hot > 0)
        logp = process_logits(upcast_logits(logits), params, step_seen)
        path, num_accepted, next_tokens, emitted_lp = verify_tree(
            logp, tree, depths, max_depth, params.do_sample, generator
        )
        depth = path.size(1)
        on_path = torch.arange(depth, device=path.device)[None] < num_accepted[:, None]
        order = torch.cat([torch.zeros_like(last), torch.where(on_path, path, 0)], dim=1)  # (B, D+1) kept indices
        keep = torch.zeros_like(valid).scatter_(1, order, True)
        policy.keep_last(keep)
        if policy.hidden_states is not None:  # the accepted path first, as after a chain step
            states = policy.hidden_states
            layers = states.keys() if isinstance(states, dict) else range(len(states))
            gathered = {i: states[i].gather(1, order[..., None].expand(batch, -1, states[i].size(-1))) for i in layers}
            policy.hidden_states = gathered if isinstance(states, dict) else tuple(gathered.values())
        return tokens.gather(1, order)[:, 1:], num_accepted, next_tokens, emitted_lp

    @staticmethod
    def _emit(run: _Run, draft_ids, num_accepted, next_tokens, emitted_lp):
        """Append each active row's d_1..d_n, x (cut after the first EOS).

        Returns the mask of rows still going and the number of tokens emitted.
        """
        # (B, k+1): accepted drafts, then the next token at index n.
        tokens = torch.cat([draft_ids, next_tokens[:, None]], dim=1).scatter(
            1, num_accepted[:, None], next_tokens[:, None]
        )
        counts = num_accepted + 1
        ctx, seen, limit = run.ctx, run.seen, run.ctx.params.max_new_tokens
        is_eos = torch.isin(tokens, run.eos) & (
            torch.arange(tokens.size(1), device=tokens.device)[None] < counts[:, None]
        )
        first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, counts)
        counts = torch.minimum(counts, first_eos)
        if seen is not None:
            keep_pos = torch.arange(tokens.size(1), device=tokens.device)[None] < counts[:, None]
            seen.scatter_(1, torch.where(keep_pos, tokens, tokens[:, :1]), True)
        tokens_l, counts_l, lp_l = tokens.tolist(), counts.tolist(), emitted_lp.tolist()
        ended = is_eos.any(1).tolist()
        keep = []
        for i, row in enumerate(ctx.row_ids.tolist()):
            new = tokens_l[i][: counts_l[i]]
            ctx.sequences[row].extend(new)
            run.completions[row].extend(new)
            run.logprobs[row].extend(lp_l[i][: counts_l[i]])
            keep.append(not ended[i] and len(run.completions[row]) < limit)
        return torch.tensor(keep, dtype=torch.bool, device=num_accepted.device), sum(counts_l)


def _seen_per_position(seen: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """(B, k+1, V): tokens seen before position j = context plus drafts d_1..d_{j-1} (for the repetition penalty)."""
    batch, k = draft_ids.shape
    out = seen[:, None, :].repeat(1, k + 1, 1)
    for j in range(k):
        out[:, j + 1 :].scatter_(2, draft_ids[:, j, None, None].expand(batch, k - j, 1), True)
    return out
