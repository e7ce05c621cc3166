"""Task-matched baselines (beyond the paper; issue 23): other ways to carry a segment across
the context boundary, on the same PMNet backbone, episodes, runner and evaluator.

The paper's Limitations: "the synthetic task lacks a task-matched external architecture
baseline." Each baseline is a *lifecycle*, the `consolidation` of its condition
(`pmnet.conditions.BASELINE_CONDITIONS`), which `pmnet.runner` runs in place of
consolidate-then-clear. What crosses a boundary, and what is cleared:

    mode             KV cache  STM      LTM          carried state (MemoryState.carry)
    ---------------  --------  -------  -----------  -------------------------------------
    (PMNet)          cleared   cleared  L + C(S)     -
    no_reset         kept      kept     never used   -          (upper bound: no boundary)
    memory_tokens    cleared   cleared  never used   M memory embeddings (B, M, H)
    recurrent_state  cleared   cleared  never used   a GRU state (B, G)
    no_memory        cleared   cleared  never used   -          (floor: nothing crosses)

"Never used": LTM stays at the zero phase vector, so M = S in every read and the direct L
term of Eq. 9 is zero (routing on and off are the same model).

memory_tokens (in the manner of the Recurrent Memory Transformer, Bulatov et al. 2022):
    a segment is processed as [mem ; segment tokens ; mem] (the read copy before, the write
    copy after, as in RMT); the new memory is W_w h_write + b_w, the last layer's normed
    hidden states at the M write positions mapped back to embedding space. A query reads
    [mem ; query tokens]. Before the first segment mem = mem_0, learned. Parameters:
    M H + H^2 + H.
recurrent_state:
    after a segment, h_seg = mean of the last layer's normed hidden states over the segment's
    positions, and c+ = GRUCell(h_seg, c) (c_0 = 0); every later chunk (segment or query)
    reads one prefix embedding W_r c + b_r. Parameters: 3 (H G + G^2 + 2 G) + G H + H.

Both are trained end to end through the boundary (the loss of the final query reaches the
first segment's write through the carried state) with the backbone frozen, like the
Consolidator-only arm. `add_baseline(model, mode)` creates the module (a Phase-1 checkpoint
has none); `segment`, `query` and `boundary` are the three steps the runner calls.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from pmnet.config import ModelConfig
from pmnet.model import MemoryState, PMNet
from pmnet.operators import OPERATORS, add_operator

#: The baselines' lifecycles, the `consolidation` of their conditions.
BASELINE_MODES: tuple[str, ...] = ("no_reset", "memory_tokens", "recurrent_state",
                                   "no_memory")
#: The lifecycles that carry a state of their own (and have parameters).
CARRIED_MODES: tuple[str, ...] = ("memory_tokens", "recurrent_state")


def memory_tokens_count(cfg: ModelConfig) -> int:
    """M, the memory tokens of the `memory_tokens` baseline: the branching factor K (4 in
    both presets), as many as the children of one routed group."""
    return cfg.branch


def recurrent_width(cfg: ModelConfig) -> int:
    """G, the width of the `recurrent_state` GRU: the Consolidator's hidden width d_c."""
    return cfg.consolidator_hidden


class MemoryTokens(nn.Module):
    """M learned memory embeddings, read before and written after each segment."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        M, H = memory_tokens_count(cfg), cfg.hidden
        self.mem0 = nn.Parameter(torch.randn(M, H) * cfg.init_std)  # (M, H)
        self.write = nn.Linear(H, H)  # normed hidden state -> embedding space
        nn.init.normal_(self.write.weight, 0.0, cfg.init_std)
        nn.init.zeros_(self.write.bias)

    def initial(self, batch_size: int) -> Tensor:
        return self.mem0.expand(batch_size, -1, -1)  # (B, M, H)

    def prefix(self, carry: Tensor) -> Tensor:
        return carry  # (B, M, H): the read copy

    def suffix(self, carry: Tensor) -> Tensor | None:
        return carry  # (B, M, H): the write copy

    def update(self, carry: Tensor, hidden: Tensor, n_prefix: int) -> Tensor:
        """The new memory from the hidden states (B, M + T + M, H) of a segment."""
        return self.write(hidden[:, -carry.shape[1]:])


class RecurrentState(nn.Module):
    """A GRU cell over the mean hidden state of each segment, read as one prefix embedding."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, G = cfg.hidden, recurrent_width(cfg)
        self.cell = nn.GRUCell(H, G)
        self.read = nn.Linear(G, H)
        for w in (self.cell.weight_ih, self.cell.weight_hh, self.read.weight):
            nn.init.normal_(w, 0.0, cfg.init_std)
        for b in (self.cell.bias_ih, self.cell.bias_hh, self.read.bias):
            nn.init.zeros_(b)

    def initial(self, batch_size: int) -> Tensor:
        return self.read.weight.new_zeros(batch_size, self.cell.hidden_size)  # (B, G)

    def prefix(self, carry: Tensor) -> Tensor:
        return self.read(carry)[:, None]  # (B, 1, H)

    def suffix(self, carry: Tensor) -> Tensor | None:
        return None

    def update(self, carry: Tensor, hidden: Tensor, n_prefix: int) -> Tensor:
        """c+ = GRUCell(mean of the segment's hidden states (B, 1 + T, H), c)."""
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            pooled = hidden[:, n_prefix:].float().mean(1)
            return self.cell(pooled, carry.float())


#: The modules of the baselines that carry a state.
CARRIERS: dict[str, type[nn.Module]] = {"memory_tokens": MemoryTokens,
                                        "recurrent_state": RecurrentState}


def _check_mode(mode: str) -> None:
    if mode not in BASELINE_MODES:
        raise ValueError(f"unknown baseline {mode!r}; known: {', '.join(BASELINE_MODES)}")


def add_baseline(model: PMNet, mode: str) -> nn.Module | None:
    """Create the carried memory of baseline `mode` in `model.baselines` (on the model's
    device; the global RNG is left as it was) and return it; None for the two lifecycles
    without parameters (no_reset, no_memory). Returns the existing one if the model has it."""
    _check_mode(mode)
    if mode not in CARRIERS:
        return None
    if mode not in model.baselines:
        with torch.random.fork_rng(devices=[]):
            module = CARRIERS[mode](model.cfg)
        model.baselines[mode] = module.to(model.embed.weight.device)
    return model.baselines[mode]


@torch.no_grad()
def reset_baseline(module: nn.Module, cfg: ModelConfig, generator: torch.Generator) -> None:
    """Draw a carried memory's start from `generator` (weights N(0, init_std), biases 0)."""
    for name, p in module.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=generator) * cfg.init_std)


def add_phase2_module(model: PMNet, consolidation: str) -> nn.Module | None:
    """The module a Phase-2 condition's `consolidation` needs beyond a Phase-1 model: its
    alternative operator (`pmnet.operators.add_operator`) or its baseline's carried memory;
    None for the paper's modes and the baselines without parameters."""
    if consolidation in OPERATORS:
        return add_operator(model, consolidation)
    if consolidation in BASELINE_MODES:
        return add_baseline(model, consolidation)
    return None


def baseline_parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    """{mode: its own parameter count} for every baseline (0 for the two without a module)."""
    with torch.device("meta"):
        return {mode: (sum(p.numel() for p in CARRIERS[mode](cfg).parameters())
                       if mode in CARRIERS else 0) for mode in BASELINE_MODES}


def _carrier(model: PMNet, mode: str) -> nn.Module:
    if mode not in model.baselines:
        raise ValueError(f"baseline {mode!r} needs pmnet.baselines.add_baseline(model, "
                         f"{mode!r}) first")
    return model.baselines[mode]


def _carry(module: nn.Module, state: MemoryState) -> Tensor:
    return state.carry if state.carry is not None else module.initial(state.batch_size)


def _embeds(model: PMNet, module: nn.Module, carry: Tensor, tokens: Tensor,
            write: bool) -> Tensor:
    """[read copy ; tokens ; write copy (a segment of a module that has one)] as input
    embeddings, in the residual stream's dtype (the embedding's, fp32), whatever autocast
    made the memory."""
    post = module.suffix(carry) if write else None
    parts = [module.prefix(carry), model._embed(tokens.long())] + ([post] if post is not None
                                                                    else [])
    return torch.cat([p.to(model.embed.weight.dtype) for p in parts], dim=1)


def segment(model: PMNet, mode: str, tokens: Tensor, state: MemoryState, *,
            ltm_routing: bool) -> MemoryState:
    """Process one segment's demonstrations (B, T) under baseline `mode`; returns the state
    before the boundary (a carried memory has already written its new state to `carry`)."""
    _check_mode(mode)
    if mode not in CARRIERS:
        return model(tokens, state, ltm_routing=ltm_routing, logits="none")[1]
    module = _carrier(model, mode)
    carry = _carry(module, state)
    hidden, state = model(None, state, ltm_routing=ltm_routing, logits="hidden",
                          embeds=_embeds(model, module, carry, tokens, write=True))
    return replace(state, carry=module.update(carry, hidden, module.prefix(carry).shape[1]))


def query(model: PMNet, mode: str, tokens: Tensor, state: MemoryState, *,
          ltm_routing: bool) -> Tensor:
    """Ask a query (B, T) of `state` under baseline `mode`: logits (B, V) at its last token."""
    _check_mode(mode)
    if mode not in CARRIERS:
        return model(tokens, state, ltm_routing=ltm_routing, logits="last")[0]
    module = _carrier(model, mode)
    embeds = _embeds(model, module, _carry(module, state), tokens, write=False)
    return model(None, state, ltm_routing=ltm_routing, logits="last", embeds=embeds)[0]


def boundary(model: PMNet, mode: str, state: MemoryState) -> MemoryState:
    """The context boundary of baseline `mode`: no_reset keeps everything; the others clear
    KV and STM (LTM is never written, a carried state survives)."""
    _check_mode(mode)
    return state if mode == "no_reset" else state.clear_context()
