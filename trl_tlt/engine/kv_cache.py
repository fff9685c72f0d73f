"""A Hugging Face causal LM with a batched KV cache in which every row keeps its own valid positions.

Speculative decoding appends k+1 positions per row per step but keeps only 1 + accepted of them, a different
number in each row. Instead of moving the cache, rejected positions become holes: masked out in the 2-D
attention mask, skipped by the position ids (a row's position id = number of valid tokens before it). So the
model sees exactly the same tokens at the same positions as plain decoding. When holes pile up the cache is
compacted with one gather, and finished rows are dropped with `select` so the tail runs at its real width.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` that appends in place: its keys and values are views of buffers with spare room, so a forward
    writes its new positions instead of copying the whole cache (`DynamicLayer` concatenates at every forward, which
    costs O(cache length) per layer per decode step). The buffers grow by half when full, and are adopted afresh
    after anything replaced the tensors (a batch selection, a compaction)."""

    growth = 1.5
    min_room = 64

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.size(-2)
        keys, values = self.reserve(new, like=(key_states, value_states))
        keys[:, :, length : length + new], values[:, :, length : length + new] = key_states, value_states
        self.keys, self.values = keys[:, :, : length + new], values[:, :, : length + new]
        return self.keys, self.values

    def reserve(self, new: int, like: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Make room for `new` more positions; returns the key and value buffers (B, heads, capacity, d), whose
        first `get_seq_length()` positions are the cache (the rest is free: a caller may write scratch there, which
        the next `update` overwrites). `like`: tensors giving the shapes when the cache is still empty."""
        length = self.get_seq_length()
        room = getattr(self, "_room", None)
        if room is not None and not (_is_prefix_view(self.keys, room[0]) and _is_prefix_view(self.values, room[1])):
            room = None  # the tensors were replaced (a batch selection, a compaction): adopt them
        if room is None or length + new > room[0].size(-2):
            capacity = max(int(self.growth * (length + new)), length + new + self.min_room)
            like = (self.keys, self.values) if length else like
            room = tuple(x.new_empty((*x.shape[:2], capacity, x.size(-1))) for x in like)
            if length:
                room[0][:, :, :length], room[1][:, :, :length] = self.keys, self.values
                self.keys, self.values = room[0][:, :, :length], room[1][:, :, :length]
            self._room = room
        return room


def _is_prefix_view(x: torch.Tensor, buffer: torch.Tensor) -> bool:
    """x is buffer[:, :, :n] for some n (it starts at the buffer's storage and has its batch size and strides)."""
    return (
        x.dim() == 4
        and x.data_ptr() == buffer.data_ptr()
        and x.shape[:2] == buffer.shape[:2]
        and (x.stride() == buffer.stride())
    )


def new_cache(config) -> DynamicCache:
    """A `DynamicCache` for `config` whose full-attention layers append in place (`GrowingLayer`)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class LayerTap:
    """Keeps the hidden states of a few of the policy's layers through a forward, where `output_hidden_states` keeps
    every layer's (on a 30-layer policy, 31 copies of the batch's hidden states where an EAGLE-3 head reads 4).

    Layer ids are Hugging Face's `hidden_states` indices (and vLLM's): id i < L is the input of decoder layer i, id L
    (`num_hidden_layers`) the final norm's output, the states the LM head reads. Forward hooks on the decoder's
    `layers` and `norm` capture them; a model without both (`supported` False) is read through `output_hidden_states`
    instead (every layer computed, only `layers` kept).
    """

    def __init__(self, model: PreTrainedModel, layers: Sequence[int]):
        self.layers = tuple(sorted(set(layers)))
        num_layers = model.config.get_text_config().num_hidden_layers
        if any(not 0 <= i <= num_layers for i in self.layers):
            raise ValueError(f"Layer ids must be in [0, {num_layers}] (num_hidden_layers), got {list(self.layers)}.")
        try:
            decoder = model.get_decoder()
        except (AttributeError, NotImplementedError):  # no decoder to hook: `output_hidden_states` instead
            decoder = None
        self._blocks = getattr(decoder, "layers", None)
        self._norm = getattr(decoder, "norm", None)
        self.num_layers = num_layers
        self.supported = (
            isinstance(self._blocks, torch.nn.ModuleList)
            and len(self._blocks) == num_layers
            and isinstance(self._norm, torch.nn.Module)
            and self._matches(model)
        )

    _checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> whether its hooks give its states

    @classmethod
    def checked(cls, model: PreTrainedModel) -> bool:
        """Whether `model`'s one-time check (`_matches`, two short forwards at construction) has run."""
        return model in cls._checked

    @torch.no_grad()
    def _matches(self, model: PreTrainedModel) -> bool:
        """Whether the hooks see what `output_hidden_states` reports, on one short forward (once per model): a model
        whose decoder adds to the stream outside its layers, or a kernel that writes the stream in place, fails it
        and is read through `output_hidden_states`."""
        if model not in self._checked:
            every = tuple(range(self.num_layers + 1))
            ids = torch.arange(6, device=model.device)[None] % model.config.get_text_config().vocab_size
            training = model.training  # in eval mode: dropout would make the two forwards differ
            model.eval()
            try:
                reference = model(input_ids=ids, output_hidden_states=True, logits_to_keep=1).hidden_states
                with self.capture(every) as states:
                    model(input_ids=ids, logits_to_keep=1)
            finally:
                model.train(training)
            self._checked[model] = len(reference) == len(every) and all(
                i in states and torch.allclose(states[i], reference[i], rtol=1e-4, atol=1e-5) for i in every
            )
        return self._checked[model]

    @contextlib.contextmanager
    def capture(self, layers: Sequence[int] | None = None):
        """Within it, the model's forwards fill the yielded dict {layer id: (B, n, H)} of `layers` (default: the tap's),
        hooks removed on exit."""
        states: dict[int, torch.Tensor] = {}
        handles = []

        def keep_input(i):
            def hook(module, args, kwargs):
                states[i] = args[0] if args else kwargs["hidden_states"]

            return hook

        try:
            for i in self.layers if layers is None else layers:
                if i < self.num_layers:
                    handles.append(self._blocks[i].register_forward_pre_hook(keep_input(i), with_kwargs=True))
                else:
                    handles.append(self._norm.register_forward_hook(lambda m, a, out, i=i: states.__setitem__(i, out)))
            yield states
        finally:
            for handle in handles:
                handle.remove()


class RaggedKVModel:
    """Runs `model` over ragged batches, keeping a `DynamicCache` with per-row holes.

    Args:
        model: Any Hugging Face causal LM with full attention (sliding-window caches are rejected).
        output_hidden_states: Keep the hidden states of every layer from each forward (`hidden_states`, a tuple).
        hidden_layers: Keep only these layers' (`LayerTap` ids): `hidden_states` is then {layer id: (B, n, H)}.

    Example:
        >>> runner = RaggedKVModel(model)
        >>> last_logits = runner.prefill([[1, 2, 3], [4, 5]])          # (2, V)
        >>> logits = runner.extend(torch.tensor([[6, 7], [8, 0]]), torch.tensor([[1, 1], [1, 0]]).bool())
        >>> runner.truncate(runner.lengths - 1)                          # drop the last valid token of each row
    """

    def __init__(
        self, model: PreTrainedModel, output_hidden_states: bool = False, hidden_layers: Sequence[int] | None = None
    ):
        self.model = model
        self.tap = LayerTap(model, hidden_layers) if hidden_layers else None
        self.output_hidden_states = output_hidden_states or (self.tap is not None and not self.tap.supported)
        self.device = model.device
        self.cache: DynamicCache | None = None
        self.attention_mask: torch.Tensor | None = None  # (B, T) bool, True = valid position
        self.lengths: torch.Tensor | None = None  # (B,) valid tokens per row
        self.hidden_states: tuple[torch.Tensor, ...] | dict[int, torch.Tensor] | None = None

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logits_to_keep: int = 0,
        attention_mask: torch.Tensor | None = None,
        **model_kwargs,
    ):
        tapped = self.tap is not None and self.tap.supported
        with self.tap.capture() if tapped else contextlib.nullcontext() as states:
            out = self.model(
                input_ids=input_ids,
                attention_mask=self.attention_mask.long() if attention_mask is None else attention_mask,
                position_ids=position_ids,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                output_hidden_states=self.output_hidden_states,
                **model_kwargs,
            )
        self.cache = out.past_key_values
        if tapped:
            self.hidden_states = states
        elif self.tap is not None:
            self.hidden_states = {i: out.hidden_states[i] for i in self.tap.layers}
        else:
            self.hidden_states = out.hidden_states if self.output_hidden_states else None
        for layer in self.cache.layers:
            if type(layer) not in (DynamicLayer, GrowingLayer):
                raise NotImplementedError(
                    f"{type(self.model).__name__} uses a {type(layer).__name__} cache; the speculative engine supports "
                    "full-attention models only. Generate without trl-tlt's engine for this model."
                )
        return out.logits

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], pad_token_id: int = 0, **model_kwargs) -> torch.Tensor:
        """Start a batch from ragged prompts (left-padded, as `generate` does). Returns last-position logits (B, V).

        `model_kwargs` go to the model's forward (already laid out like the left-padded batch).
        """
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = True
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        self.cache = new_cache(self.model.config)
        self.attention_mask = mask
        self.lengths = mask.sum(dim=1)
        position_ids = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
        return self._forward(input_ids, position_ids, logits_to_keep=1, **model_kwargs)[:, -1]

    @torch.no_grad()
    def extend(self, input_ids: torch.Tensor, valid: torch.Tensor, **model_kwargs) -> torch.Tensor:
        """Append n positions to every row; `valid` (B, n) marks real tokens (invalid ones become holes).

        Returns logits (B, n, V); rows' invalid positions produce garbage logits and become holes.
        """
        position_ids = self.lengths[:, None] + valid.long().cumsum(dim=1) - 1  # (B, n)
        position_ids = position_ids.clamp(min=0)
        self.attention_mask = torch.cat([self.attention_mask, valid], dim=1)
        self.lengths = self.lengths + valid.sum(dim=1)
        return self._forward(input_ids, position_ids, **model_kwargs)

    @torch.no_grad()
    def extend_tree(
        self,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        position_ids: torch.Tensor,
        visible: torch.Tensor,
        **model_kwargs,
    ) -> torch.Tensor:
        """Append n positions that attend by `visible` among the last m cache slots (tree attention).

        Args:
            input_ids: (B, n) tokens; `valid` (B, n) marks real ones (the others become holes).
            position_ids: (B, n) their positions (a tree node's: its root's + its depth).
            visible: (B, n, m), m >= n: which of the last m slots (the n new ones last) each new position sees; older
                slots are seen as the 2-D mask says. Every position must see itself.

        Returns logits (B, n, V). The new slots count as valid until `keep_last` says otherwise.
        """
        batch, n = input_ids.shape
        m = visible.size(2)
        self.attention_mask = torch.cat([self.attention_mask, valid], dim=1)
        self.lengths = self.lengths + valid.sum(dim=1)
        older = self.attention_mask[:, None, : self.attention_mask.size(1) - m].expand(batch, n, -1)
        allowed = torch.cat([older, visible], dim=2)[:, None]  # (B, 1, n, T)
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )
        return self._forward(input_ids, position_ids, attention_mask=mask, **model_kwargs)

    def keep_last(self, keep: torch.Tensor) -> None:
        """Of the last n = keep.size(1) slots, keep only those marked (the rest become holes)."""
        n = keep.size(1)
        self.attention_mask = torch.cat([self.attention_mask[:, :-n], self.attention_mask[:, -n:] & keep], dim=1)
        self.lengths = self.attention_mask.sum(dim=1)
        self._maybe_compact()

    def truncate(self, lengths: torch.Tensor) -> None:
        """Keep only the first `lengths[b]` valid tokens of each row (the rest become holes)."""
        count = self.attention_mask.long().cumsum(dim=1)
        self.attention_mask = self.attention_mask & (count <= lengths[:, None])
        self.lengths = torch.minimum(self.lengths, lengths)
        self._maybe_compact()

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices into the current batch), e.g. to drop finished sequences."""
        self.cache.batch_select_indices(rows)
        self.attention_mask = self.attention_mask[rows]
        self.lengths = self.lengths[rows]
        self._maybe_compact()

    def _maybe_compact(self, min_holes: int = 32) -> None:
        """Gather every row's valid positions to the front once holes make up over a third of the cache."""
        total = self.attention_mask.size(1)
        longest = int(self.lengths.max()) if self.lengths.numel() else 0
        if total - longest < max(min_holes, total // 3):
            return
        # Stable sort puts each row's valid positions first, in order.
        order = torch.sort((~self.attention_mask).to(torch.int8), dim=1, stable=True).indices[:, :longest]  # (B, T')
        for layer in self.cache.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.size(1), -1, layer.keys.size(-1))
            layer.keys = layer.keys.gather(2, index)
            layer.values = layer.values.gather(2, index)
        self.attention_mask = torch.arange(longest, device=self.device)[None, :] < self.lengths[:, None]


def unsupported_architecture(model: PreTrainedModel) -> str | None:
    """Why `RaggedKVModel` cannot run `model` (read from its config), or None.

    The ragged cache needs every layer to keep one key and value per position, addressed by the attention mask and
    position ids: sliding-window layers evict positions and state-space / linear-attention layers fold them into a
    state, so neither can leave a rejected draft behind as a hole.
    """
    config = model.config.get_text_config()
    layer_types = set(getattr(config, "layer_types", None) or []) - {"full_attention"}
    if layer_types:
        return (
            f"its layers include {sorted(layer_types)}; the engine's ragged cache needs full attention in every layer"
        )
    try:
        kinds = {type(layer).__name__ for layer in DynamicCache(config=config).layers} - {DynamicLayer.__name__}
    except Exception as error:  # a config DynamicCache cannot read is not one the engine can run
        return f"transformers cannot build a DynamicCache for its config ({type(error).__name__}: {error})"
    if kinds:
        return f"its cache has {sorted(kinds)} layers (sliding-window or state-space attention), not full attention"
    return None


@torch.no_grad()
def ragged_cache_mismatch(model: PreTrainedModel, pad_token_id: int = 0) -> str | None:
    """Check `RaggedKVModel` on `model` as speculation uses it; returns what went wrong, or None.

    Two ragged rows are prefilled, extended by a step whose last draft is rejected (a hole), then by one more token;
    the final logits must equal a plain forward over each row's kept tokens. Catches architectures whose cache or
    positions do not follow the attention mask (custom code, new cache types) before a rollout relies on them.
    """
    vocab = model.config.get_text_config().vocab_size
    tokens = torch.randint(0, min(vocab, 1000), (12,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [tokens[:5], tokens[5:7]]
    runner = RaggedKVModel(model)
    try:
        runner.prefill(prompts, pad_token_id)
        step = torch.tensor([tokens[7:10], tokens[9:12]], device=runner.device)
        runner.extend(step, torch.tensor([[True, True, True], [True, True, False]], device=runner.device))
        runner.truncate(runner.lengths - 1)  # the last valid position of each row is rejected: a hole
        last = torch.tensor([[tokens[0]], [tokens[1]]], device=runner.device)
        logits = runner.extend(last, torch.ones_like(last, dtype=torch.bool))[:, -1]
        kept = [prompts[0] + tokens[7:9] + [tokens[0]], prompts[1] + tokens[9:10] + [tokens[1]]]
        reference = torch.cat(
            [model(input_ids=torch.tensor([ids], device=runner.device)).logits[:, -1] for ids in kept]
        )
    except Exception as error:  # any failure of the cached path means the engine cannot run this model
        return f"the ragged cache failed on it ({type(error).__name__}: {error})"
    diff = (logits.float().log_softmax(-1) - reference.float().log_softmax(-1)).abs().max().item()
    tolerance = 5e-2 if logits.dtype in (torch.float16, torch.bfloat16) else 1e-3
    if not diff <= tolerance:
        return f"the ragged cache gives other logits than a plain forward (max |diff| {diff:.2g} > {tolerance:g})"
    return None
