"""Route diagnostics: do the hard routes of a checkpoint matter, and does LTM steer them?

The paper's second claim (routing on - off) needs routes that matter: a token's top-1 descent
(`PMNet.forward`, `group * K + p.argmax(-1)`) decides which slots it writes and reads below
the root. These measurements, on the validation stream only, say whether they do (issue 21):

    margin               per block: median of top-1 minus top-2 routing probability and the
                         mean largest probability over the K children, over every token of the
                         STM passes (near-ties: routes decided by noise)
    stm                  immediate STM recall (mean of seg{t}_stm), the Phase-1 metric
    stm_random_routes    the same with every top-1 choice replaced by a uniform random child
                         (the root group is visited by every token, so blocks >= 1 only)
    stm_one_path         the same with every token sent down one path (child 0 at every
                         block): routes without content. Learned routes that beat random ones
                         but not this are only consistent, not content-addressed
    stm_without_block    the same with block b's writes removed (its STM stays empty)
    stm_without_blocks_from  the same with the writes of blocks b .. n_blocks - 1 removed
    route_concentration  per block: the share of a segment's tokens in its most visited group
                         (100: the routes are collapsed onto one path)
    ltm_route_change     per block: fraction of segment-2 tokens whose child choice differs
                         between routing with L (Eq. 9) and without, after the first
                         consolidation (the checkpoint's condition's operator; identity for a
                         Phase-1 checkpoint)
    strict_route_change  per block: the same between the paper's routing off (the direct L
                         term removed; L from the blocks above still reaches a deeper router
                         through u) and strict routing off (no router sees L at all): what a
                         strict-off arm would change (block 0 has no u: always 0)
    updated_strict_off   a Phase-2 model: updated-LTM recall with no router seeing L, beside
                         its own routing (issue 39)
    updated_without_ltm_route  a Phase-2 model whose condition routes with L: updated-LTM
                         recall with L removed from the routing state of block b only, of
                         every block (which is routing off, checked against it);
                         `updated_ltm_by_family` / `updated_routing_off_by_family`: the
                         latter two per rule family (the pre-registration's claim 3 reads
                         ADD10's drop)
    order                can the final LTM tell which segment came last (issue 44)? The
                         final query's answers with the last two segments in their order and
                         swapped: `updated` (the last rule's answer), `stale` (the rule before
                         it), `order_change` (% of episodes whose answer changes when the two
                         are swapped) and `order_gain` = updated - (the swapped run's rate of
                         the same answer). The episodes are exchangeable in the two segments,
                         so order_gain <= order_change on every sample: an LTM that is the
                         same whichever segment came last cannot recall the update above the
                         stale rule, whatever its Consolidator (the symmetry bound)
    seg2_route_change_learned  a learned model: per block, % of the last segment's tokens
                         whose child choice differs between the L its Consolidator wrote and
                         the L forced identity writes (does C's output move later writes?)
    query_reach          per block, where the final query's tokens are routed: % in a group
                         written by the last segment only, by an earlier segment only, by
                         both, by none (does the query read what the update wrote?);
                         `query_reach_identity` the same under forced identity
    seg2_path_change     per block, % of the last segment's tokens whose path down to that
                         block (their group after its choice) differs from the first
                         segment's token at the same position: does the LTM of the earlier
                         segments send the update elsewhere than the memory it updates?
                         Under the checkpoint's own consolidation and under forced identity
                         (`seg2_path_change_identity`), over all positions and over the
                         positions whose whole prefix is the same in both segments (the
                         shared address: with KV and STM cleared, only L can move those)
    consolidator_gradient  a learned Consolidator: the norm of the gradient of the condition's
                         Phase-2 loss on its parameters, whole and through each use of L
                         alone (`ltm_gradient`: "routing", Eq. 9's direct term, the soft
                         write weights; "memory", M = S + L, reads and deeper routers), with
                         their cosine, and `mixed` = whole - routing - memory: the paths that
                         pass through both kinds of use (L1 routes segment 2's writes, whose
                         STM the second boundary consolidates into the L the query reads)

Each recall is a percentage of the same episodes; a difference of two of them is paired, so
its noise is smaller than the +-3 pp of one 1,000-episode stream (`agreement` gives the
fraction of episodes whose predicted digit did not change).

The interventions go through `PMNet.probe` (`RouteProbe`), which the model consults only when
it is set; training and evaluation never set it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pmnet import task
from pmnet.evaluate import episode_outcomes, evaluate
from pmnet.model import PMNet
from pmnet.runner import RunOptions, persistent_state

DIAGNOSE_SEED = 20_211  # the random-route draws (independent of every data stream)
#: validation episodes the Consolidator's gradient is read on (three backward passes each)
GRADIENT_EPISODES = 500


@dataclass
class Probe:
    """A `pmnet.model.RouteProbe`: random top-1 choices, removed writes, L removed from the
    routing state of some blocks, and (record=True) the routing probabilities' margins."""

    random_routes: bool = False
    one_path: bool = False  # every token descends to child 0: one shared path, no content
    drop_writes: frozenset[int] = frozenset()
    no_ltm_routing: frozenset[int] = frozenset()
    # False: L leaves the latent state u that deeper routers see too ("strict" routing off)
    routing_u_uses_ltm: bool = True
    seed: int = DIAGNOSE_SEED
    record: bool = False
    ltm_gradient: str | None = None  # "routing" / "memory": the one use of L with a gradient
    margins: dict[int, list[Tensor]] = field(default_factory=dict)  # top-1 minus top-2
    top: dict[int, list[Tensor]] = field(default_factory=dict)  # largest probability

    def __post_init__(self):
        self._gen: torch.Generator | None = None

    def routing_uses_ltm(self, block: int) -> bool:
        return block not in self.no_ltm_routing

    def on_write(self, block: int, delta: Tensor, p: Tensor) -> Tensor:
        if self.record:
            top2 = p.detach().float().topk(2, dim=-1).values  # (B, T, 2)
            self.margins.setdefault(block, []).append((top2[..., 0] - top2[..., 1]).flatten())
            self.top.setdefault(block, []).append(top2[..., 0].flatten())
        return torch.zeros_like(delta) if block in self.drop_writes else delta

    def choose(self, block: int, p: Tensor) -> Tensor:
        if self.one_path:
            return torch.zeros(p.shape[:-1], dtype=torch.long, device=p.device)
        if not self.random_routes:
            return p.argmax(-1)
        if self._gen is None or self._gen.device != p.device:
            self._gen = torch.Generator(device=p.device).manual_seed(self.seed)
        return torch.randint(p.shape[-1], p.shape[:-1], generator=self._gen, device=p.device)


@contextlib.contextmanager
def probing(model: PMNet, probe: Probe):
    """Run `model` with `probe` set; always removed afterwards."""
    if model.probe is not None:
        raise RuntimeError("the model already has a probe set")
    model.probe = probe
    try:
        yield probe
    finally:
        model.probe = None


@dataclass(frozen=True)
class Recall:
    """A recall (percent) and, for an intervention, its paired change against the plain run."""

    recall: float
    drop: float | None = None  # plain - intervened, percentage points (positive: it hurt)
    agreement: float | None = None  # % of episodes whose predicted digit is unchanged


@dataclass(frozen=True)
class OrderDiagnostics:
    """The final query's answers with the last two segments in order and swapped (percent
    of episodes). `order_gain <= order_change` holds on every sample (see `order_test`)."""

    updated: float  # answers = the last rule at the final query (updated-LTM recall)
    stale: float  # answers = the rule before it
    swapped_stale: float  # swapped run: answers = the (true) last rule, now the stale one
    order_change: float  # answers that change when the two segments are swapped
    episodes: int

    @property
    def order_gain(self) -> float:
        """updated - swapped_stale: recall of the update that depends on the order."""
        return self.updated - self.swapped_stale


@dataclass(frozen=True)
class QueryReach:
    """Where the final query's tokens are routed in one block: % of query tokens in a group
    written by the last segment only, by earlier segments only, by both, by none."""

    last_only: float
    earlier_only: float
    both: float
    neither: float


@dataclass(frozen=True)
class PathChange:
    """Per block, % of the last segment's tokens whose path to that block differs from the
    first segment's token at the same position: over every position (`all`) and over the
    positions whose whole prefix is the same in both segments (`shared_prefix`)."""

    all: list[float]
    shared_prefix: list[float]
    shared_prefix_share: float  # % of positions whose prefix is the same in both segments


@dataclass(frozen=True)
class GradientSplit:
    """The gradient of a Phase-2 loss on the Consolidator's parameters (L2 norms, over
    `episodes` validation episodes): whole; through paths whose every use of L is a routing
    use (Eq. 9's direct term); through paths whose every use is a memory use (M = S + L);
    `mixed`, the rest (whole - routing - memory: paths through both kinds, exactly); and the
    cosine of the routing and memory gradients."""

    total: float
    routing: float
    memory: float
    mixed: float
    cosine: float
    episodes: int

    @property
    def routing_share(self) -> float:
        """|routing| / (|routing| + |memory|), in %: how much of the single-kind gradient
        comes through routing."""
        den = self.routing + self.memory
        return 100 * self.routing / den if den > 0 else float("nan")


@dataclass(frozen=True)
class RouteDiagnostics:
    checkpoint: str
    kind: str  # "phase1" or "phase2"
    condition: str | None
    episodes: int
    n_blocks: int
    margin_median: list[float]  # per block
    top_prob_mean: list[float]  # per block
    stm: Recall
    stm_random_routes: Recall
    stm_one_path: Recall
    stm_without_block: list[Recall]  # per block
    stm_without_blocks_from: list[Recall | None]  # per block b: blocks b.. removed (b >= 1)
    ltm_route_change: list[float]  # per block, % of segment-2 tokens
    route_concentration: list[float]  # per block, % of tokens in the most visited group
    strict_route_change: list[float] | None = None  # per block, off vs strict off
    updated_ltm: Recall | None = None  # Phase-2 model routing with L
    updated_without_ltm_route: list[Recall] | None = None  # per block
    updated_routing_off: Recall | None = None  # L removed from every block
    # the same two per rule family (`task.FAMILIES`): the pre-registered mechanism claim
    # reads ADD10's (docs/preregistration.md, claim 3)
    updated_ltm_by_family: dict[str, Recall] | None = None
    updated_routing_off_by_family: dict[str, Recall] | None = None
    updated_strict_off: Recall | None = None  # no router sees L (direct or through u)
    order: OrderDiagnostics | None = None  # the symmetry bound (issue 44)
    seg2_route_change_learned: list[float] | None = None  # per block, learned vs identity L
    query_reach: list[QueryReach] | None = None  # per block
    query_reach_identity: list[QueryReach] | None = None  # per block, forced identity
    seg2_path_change: PathChange | None = None  # the checkpoint's own consolidation
    seg2_path_change_identity: PathChange | None = None  # forced identity
    consolidator_gradient: GradientSplit | None = None  # a learned Consolidator

    @property
    def random_route_drop(self) -> float:
        return float(self.stm_random_routes.drop)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.order is not None:
            d["order"]["order_gain"] = self.order.order_gain
        if self.consolidator_gradient is not None:
            d["consolidator_gradient"]["routing_share"] = self.consolidator_gradient.routing_share
        return d


# -----------------------------------------------------------------------------------------
# measurements
# -----------------------------------------------------------------------------------------


def _stm_predictions(model: PMNet, stream, batch_size: int) -> tuple[Tensor, Tensor]:
    """Predicted digits and hits (N, T) of every segment's immediate STM query."""
    device = next(model.parameters()).device
    n_seg = stream.seg_tokens.shape[1]
    preds = []
    for i in range(0, len(stream), batch_size):
        out = episode_outcomes(model, stream[i:i + batch_size].to(device),
                               consolidation="identity", ltm_routing=False, ltm=False)
        preds.append(torch.stack([out[f"pred/seg{t}_stm"] for t in range(1, n_seg + 1)],
                                 1).cpu())
    pred = torch.cat(preds)
    return pred, pred == stream.target_digit


def _updated_predictions(model: PMNet, stream, batch_size: int, consolidation: str,
                         ltm_routing: bool) -> tuple[Tensor, Tensor]:
    device = next(model.parameters()).device
    preds = []
    for i in range(0, len(stream), batch_size):
        out = episode_outcomes(model, stream[i:i + batch_size].to(device),
                               consolidation=consolidation, ltm_routing=ltm_routing,
                               full=False, stm=False)
        preds.append(out["pred/updated_ltm"].cpu())
    pred = torch.cat(preds)
    return pred, pred == stream.target_digit[:, -1]


def _recall(hits: Tensor, base: tuple[Tensor, Tensor] | None = None,
            pred: Tensor | None = None) -> Recall:
    r = 100 * hits.float().mean().item()
    if base is None:
        return Recall(r)
    base_pred, base_hits = base
    return Recall(r, drop=100 * base_hits.float().mean().item() - r,
                  agreement=100 * (pred == base_pred).float().mean().item())


def _with(model: PMNet, probe: Probe, fn, *args):
    was = model.training
    model.eval()
    try:
        with probing(model, probe), torch.no_grad():
            return fn(model, *args)
    finally:
        model.train(was)


def _before_last(model: PMNet, seg: Tensor, consolidation: str, ltm_routing: bool):
    """The state the last segment of `seg` (B, T, L) starts from: every earlier segment
    processed (with or without L's direct routing term) and consolidated."""
    state = model.init_state(seg.shape[0], device=seg.device)
    for d in range(seg.shape[1] - 1):
        _, state = model(seg[:, d], state, ltm_routing=ltm_routing, logits="none")
        state = model.consolidate(state, mode=consolidation).clear_context()
    return state


@torch.no_grad()
def _route_change(model: PMNet, stream, batch_size: int, two_runs) -> list[float]:
    """Per block, % of the last segment's tokens whose child choice differs between the two
    runs `two_runs(seg)` returns (each a state's `routes`; routes[b + 1] % K is the child
    block b chose)."""
    device = next(model.parameters()).device
    K, nb = model.cfg.branch, model.cfg.n_blocks
    changed = torch.zeros(nb, dtype=torch.float64)
    count = 0
    for i in range(0, len(stream), batch_size):
        a, b = two_runs(stream[i:i + batch_size].to(device).seg_tokens)
        for blk in range(nb):
            changed[blk] += ((a[blk + 1] % K) != (b[blk + 1] % K)).sum().item()
        count += a[0].numel()
    return [100 * c / count for c in changed.tolist()]


def ltm_route_change(model: PMNet, stream, consolidation: str, batch_size: int,
                     strict: bool = False) -> list[float]:
    """Per block, % of the last segment's tokens whose child choice differs between routing
    with and without L, after every earlier segment was processed and consolidated.
    `strict`: between routing without the direct L term (the paper's off) and routing with
    no L at all (L also out of the u deeper routers see)."""
    if strict:
        return _strict_route_change(model, stream, consolidation, batch_size)

    def on_off(seg: Tensor):
        state = _before_last(model, seg, consolidation, True)
        return tuple(model(seg[:, -1], state, ltm_routing=r, logits="none")[1].routes
                     for r in (True, False))

    return _route_change(model, stream, batch_size, on_off)


def _strict_route_change(model: PMNet, stream, consolidation: str,
                         batch_size: int) -> list[float]:
    probe = model.probe

    def off_strict(seg: Tensor):
        state = _before_last(model, seg, consolidation, False)
        _, off = model(seg[:, -1], state, ltm_routing=False, logits="none")
        model.probe = dataclasses.replace(probe if probe is not None else Probe(),
                                          routing_u_uses_ltm=False)
        try:
            _, strict = model(seg[:, -1], state, ltm_routing=False, logits="none")
        finally:
            model.probe = probe
        return off.routes, strict.routes

    return _route_change(model, stream, batch_size, off_strict)


@torch.no_grad()
def route_concentration(model: PMNet, stream, batch_size: int) -> list[float]:
    """Per block, the mean over episodes of the share (%) of the first segment's tokens that
    visit the episode's most visited group (block 0: 100, one group; 100 at a deeper block:
    every token takes one path, the routes are collapsed; 100/K^b: spread evenly)."""
    device = next(model.parameters()).device
    nb = model.cfg.n_blocks
    share = torch.zeros(nb, dtype=torch.float64)
    count = 0
    for i in range(0, len(stream), batch_size):
        seg = stream[i:i + batch_size].to(device).seg_tokens[:, 0]
        _, state = model(seg, model.init_state(seg.shape[0], device=device), ltm_routing=False,
                         logits="none")
        T = seg.shape[1]
        for b in range(nb):
            G = model.cfg.n_groups(b)
            hist = torch.zeros(seg.shape[0], G, device=device).scatter_add_(
                1, state.routes[b], torch.ones_like(state.routes[b], dtype=torch.float))
            share[b] += (hist.max(1).values / T).sum().item()
        count += seg.shape[0]
    return [100 * v / count for v in share.tolist()]



def swap_last_segments(batch):
    """The same episodes with the demonstrations of their last two segments swapped; the
    queries and every other field unchanged (so the final query's "update" is now the rule
    of the segment before the last)."""
    T = batch.seg_tokens.shape[1]
    if T < 2:
        raise ValueError("swapping segments needs episodes of at least 2 segments")
    order = list(range(T))
    order[-2], order[-1] = order[-1], order[-2]
    return dataclasses.replace(batch, seg_tokens=batch.seg_tokens[:, order])


def order_test(model: PMNet, stream, consolidation: str, ltm_routing: bool,
               batch_size: int) -> OrderDiagnostics:
    """The symmetry bound: final-query answers in order and with the last two segments
    swapped. Because episodes are exchangeable in those two segments, the recall of the
    update above the stale rule that a model can show is at most the share of answers that
    change with the order: updated - swapped_stale <= order_change, exactly, per sample
    (with a = the last rule's answer, p and p_s the two runs' answers: mean([p = a] -
    [p_s = a]) <= mean([p != p_s]), since the bracket is positive only where p != p_s).
    Exchangeability makes swapped_stale an unbiased estimate of the stale rate, so without
    order information (order_change = 0) the update is answered no more often than the
    stale rule."""
    pred, _ = _updated_predictions(model, stream, batch_size, consolidation, ltm_routing)
    pred_s, _ = _updated_predictions(model, swap_last_segments(stream), batch_size,
                                     consolidation, ltm_routing)
    answers = stream.final_answers()  # (N, T): each rule's answer at the final query

    def pct(x: Tensor) -> float:
        return 100 * x.float().mean().item()

    return OrderDiagnostics(updated=pct(pred == answers[:, -1]),
                            stale=pct(pred == answers[:, -2]),
                            swapped_stale=pct(pred_s == answers[:, -1]),
                            order_change=pct(pred != pred_s), episodes=len(stream))


def learned_route_change(model: PMNet, stream, ltm_routing: bool,
                         batch_size: int) -> list[float]:
    """Per block, % of the last segment's tokens whose child choice differs between the LTM
    the Consolidator wrote at the earlier boundaries and the LTM forced identity writes
    (same routing flag): how far C's output moves the writes that follow it."""

    def learned_identity(seg: Tensor):
        return tuple(model(seg[:, -1], _before_last(model, seg, mode, ltm_routing),
                           ltm_routing=ltm_routing, logits="none")[1].routes
                     for mode in ("learned", "identity"))

    return _route_change(model, stream, batch_size, learned_identity)


@torch.no_grad()
def query_reach(model: PMNet, stream, consolidation: str, ltm_routing: bool,
                batch_size: int) -> list[QueryReach]:
    """Per block, the share (%) of the final query's tokens routed to a group that the last
    segment wrote only, earlier segments only, both, or none (the model's own lifecycle)."""
    device = next(model.parameters()).device
    nb = model.cfg.n_blocks
    tally = torch.zeros(nb, 4, dtype=torch.float64)  # last only, earlier only, both, neither
    opts = RunOptions(consolidation, ltm_routing)
    for i in range(0, len(stream), batch_size):
        batch = stream[i:i + batch_size].to(device)
        occ: list[tuple[Tensor, ...]] = []  # each segment's occupancy before its boundary

        def keep(d: int, before, after, occ=occ) -> None:
            occ.append(before.occ)

        state = persistent_state(model, batch, opts, on_segment=keep)
        last = occ[-1]
        earlier = [torch.stack(o).any(0) for o in zip(*occ[:-1])]
        _, q = model(batch.query_tokens[:, -1], state, ltm_routing=ltm_routing, logits="none")
        for b in range(nb):
            g = q.routes[b]  # (B, Tq) the group each query token visits in block b
            in_last, in_earlier = last[b].gather(1, g), earlier[b].gather(1, g)
            for j, m in enumerate((in_last & ~in_earlier, ~in_last & in_earlier,
                                   in_last & in_earlier, ~in_last & ~in_earlier)):
                tally[b, j] += m.sum().item()
    tally = 100 * tally / tally.sum(1, keepdim=True)
    return [QueryReach(*row) for row in tally.tolist()]


@torch.no_grad()
def seg2_path_change(model: PMNet, stream, consolidation: str, ltm_routing: bool,
                     batch_size: int) -> PathChange:
    """Per block, % of the last segment's tokens whose group after that block's choice (the
    path from the root) differs from the first segment's token at the same position, the
    last segment run on the LTM `consolidation` left (the model's lifecycle)."""
    device = next(model.parameters()).device
    nb = model.cfg.n_blocks
    diff_all = torch.zeros(nb, dtype=torch.float64)
    diff_same = torch.zeros(nb, dtype=torch.float64)
    n_all = n_same = 0
    for i in range(0, len(stream), batch_size):
        seg = stream[i:i + batch_size].to(device).seg_tokens
        _, first = model(seg[:, 0], model.init_state(seg.shape[0], device=device),
                         ltm_routing=ltm_routing, logits="none")
        state = _before_last(model, seg, consolidation, ltm_routing)
        _, last = model(seg[:, -1], state, ltm_routing=ltm_routing, logits="none")
        # (B, T) the positions whose whole prefix is the same in both segments (the shared
        # address): with KV and STM cleared at the boundary, only L can move their paths
        same = (seg[:, 0] == seg[:, -1]).long().cumprod(1).bool()
        for b in range(nb):
            d = first.routes[b + 1] != last.routes[b + 1]
            diff_all[b] += d.sum().item()
            diff_same[b] += (d & same).sum().item()
        n_all += same.numel()
        n_same += int(same.sum().item())
    return PathChange(all=[100 * x / n_all for x in diff_all.tolist()],
                      shared_prefix=[100 * x / max(1, n_same) for x in diff_same.tolist()],
                      shared_prefix_share=100 * n_same / n_all)


def consolidator_gradient(model: PMNet, stream, condition: str,
                          batch_size: int) -> GradientSplit:
    """The gradient of `condition`'s Phase-2 loss (`runner.phase2_losses`, training mode, one
    seed for any dropout) on the Consolidator's parameters over `stream`: whole, through
    paths using L for routing only and for memory only (`RouteProbe.ltm_gradient`: every
    other use detached), and the rest (`GradientSplit`)."""
    from pmnet.conditions import get_condition
    from pmnet.runner import phase2_losses

    cond = get_condition(condition)
    params = [p for n, p in model.named_parameters() if n.startswith("consolidator.")]
    device = next(model.parameters()).device
    was = model.training
    flags = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    grads = {}
    try:
        model.train()
        for path in (None, "routing", "memory"):
            total = [torch.zeros_like(p) for p in params]
            with probing(model, dataclasses.replace(Probe(), ltm_gradient=path)):
                for i in range(0, len(stream), batch_size):
                    batch = stream[i:i + batch_size].to(device)
                    torch.manual_seed(DIAGNOSE_SEED)
                    loss = phase2_losses(model, batch, cond)["loss"]
                    if not loss.requires_grad:  # no use of L this path keeps is in the loss
                        continue
                    g = torch.autograd.grad(loss * len(batch) / len(stream), params,
                                            allow_unused=True)
                    total = [t + (x if x is not None else 0) for t, x in zip(total, g)]
            grads[path] = torch.cat([t.flatten() for t in total]).double()
    finally:
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)
        model.train(was)
    whole, r, m = grads[None], grads["routing"], grads["memory"]
    norm = whole.norm().item()
    cos = (r @ m / (r.norm() * m.norm())).item() if r.norm() > 0 and m.norm() > 0 else 0.0
    return GradientSplit(total=norm, routing=r.norm().item(), memory=m.norm().item(),
                         mixed=(whole - r - m).norm().item(), cosine=cos, episodes=len(stream))


def diagnose(model: PMNet, stream, *, checkpoint: str = "", condition: str | None = None,
             consolidation: str = "identity", ltm_routing: bool = False,
             batch_size: int = 250) -> RouteDiagnostics:
    """Every route diagnostic of `model` on `stream` (see the module docstring).

    consolidation / ltm_routing: the checkpoint's condition (a Phase-1 checkpoint: identity,
    no Phase-2 condition). The Phase-2 measurements run when `condition` is given."""
    if not model.cfg.use_memory:
        raise ValueError("route diagnostics need a model with memory (use_memory=True)")
    nb = model.cfg.n_blocks
    plain = Probe(record=True)
    base = _with(model, plain, _stm_predictions, stream, batch_size)
    margins = [torch.cat(plain.margins[b]).median().item() for b in range(nb)]
    tops = [torch.cat(plain.top[b]).mean().item() for b in range(nb)]

    def stm_under(probe: Probe) -> Recall:
        pred, hits = _with(model, probe, _stm_predictions, stream, batch_size)
        return _recall(hits, base, pred)

    random_routes = stm_under(Probe(random_routes=True))
    one_path = stm_under(Probe(one_path=True))
    without = [stm_under(Probe(drop_writes=frozenset({b}))) for b in range(nb)]
    without_from = [None] + [stm_under(Probe(drop_writes=frozenset(range(b, nb))))
                             for b in range(1, nb)]
    changes = _with(model, Probe(), ltm_route_change, stream, consolidation, batch_size)
    concentration = _with(model, Probe(), route_concentration, stream, batch_size)
    strict_changes = _with(model, Probe(), ltm_route_change, stream, consolidation, batch_size,
                           True)
    out = dict(checkpoint=checkpoint, kind="phase2" if condition else "phase1",
               condition=condition, episodes=len(stream), n_blocks=nb, margin_median=margins,
               top_prob_mean=tops, stm=_recall(base[1]), stm_random_routes=random_routes,
               stm_one_path=one_path,
               stm_without_block=without, stm_without_blocks_from=without_from,
               ltm_route_change=changes, route_concentration=concentration,
               strict_route_change=strict_changes)
    out["order"] = _with(model, Probe(), order_test, stream, consolidation, ltm_routing,
                         batch_size)
    out["query_reach"] = _with(model, Probe(), query_reach, stream, consolidation,
                               ltm_routing, batch_size)
    out["seg2_path_change"] = _with(model, Probe(), seg2_path_change, stream, consolidation,
                                    ltm_routing, batch_size)
    if consolidation == "learned":
        out["seg2_route_change_learned"] = _with(model, Probe(), learned_route_change, stream,
                                                 ltm_routing, batch_size)
        out["seg2_path_change_identity"] = _with(model, Probe(), seg2_path_change, stream,
                                                 "identity", ltm_routing, batch_size)
        out["query_reach_identity"] = _with(model, Probe(), query_reach, stream, "identity",
                                            ltm_routing, batch_size)
        if condition is not None:
            out["consolidator_gradient"] = consolidator_gradient(
                model, stream[:min(len(stream), GRADIENT_EPISODES)], condition, batch_size)
    if condition is not None:
        own = _with(model, Probe(), _updated_predictions, stream, batch_size, consolidation,
                    ltm_routing)
        p_s, h_s = _with(model, Probe(routing_u_uses_ltm=False), _updated_predictions, stream,
                         batch_size, consolidation, False)
        out["updated_strict_off"] = _recall(h_s, own, p_s)
    if condition is not None and ltm_routing:
        def updated(probe: Probe, routing: bool = True):
            return _with(model, probe, _updated_predictions, stream, batch_size,
                         consolidation, routing)

        ub = updated(Probe())
        out["updated_ltm"] = _recall(ub[1])
        out["updated_without_ltm_route"] = [
            _recall(h, ub, p) for p, h in (updated(Probe(no_ltm_routing=frozenset({b})))
                                           for b in range(nb))]
        p_off, h_off = updated(Probe(no_ltm_routing=frozenset(range(nb))))
        out["updated_routing_off"] = _recall(h_off, ub, p_off)
        fams = {name: stream.family == i for i, name in enumerate(task.FAMILIES)
                if bool((stream.family == i).any())}
        out["updated_ltm_by_family"] = {name: _recall(ub[1][m]) for name, m in fams.items()}
        out["updated_routing_off_by_family"] = {
            name: _recall(h_off[m], (ub[0][m], ub[1][m]), p_off[m]) for name, m in fams.items()}
    return RouteDiagnostics(**out)


def diagnose_file(path: str | Path, *, n: int = 1000, batch_size: int = 250,
                  segments: int = task.N_SEGMENTS,
                  condition: str | None = None) -> RouteDiagnostics:
    """Load a model file (phase1.pt or a Phase-2 best_model.pt) and diagnose it on the first
    `n` episodes of the validation stream (never the test stream).

    `condition` with a phase1.pt: read it as the start of that condition's Phase 2 (the
    Phase-1 Consolidator, an exact identity until trained: what training starts from); a
    Phase-2 file already names its condition, and another one is refused."""
    from pmnet.conditions import get_condition
    from pmnet.model_files import load_model_file

    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"the number of validation episodes must be a positive integer, "
                         f"got {n!r}")
    if not Path(path).is_file():
        raise ValueError(f"model file not found: {path}")
    if condition is not None:
        get_condition(condition)  # a clear error before the file is read
    model, payload = load_model_file(path)
    meta = payload.get("meta") or {}
    name = meta.get("condition") if isinstance(meta, dict) else None
    if condition is not None and name is not None and condition != name:
        raise ValueError(f"{path} is a Phase-2 model of condition {name!r}, not {condition!r}")
    name = name or condition
    stream = task.validation_stream(n, segments=segments)
    if name is None:
        return diagnose(model, stream, checkpoint=str(path), batch_size=batch_size)
    cond = get_condition(name)
    return diagnose(model, stream, checkpoint=str(path), condition=name,
                    consolidation=cond.consolidation, ltm_routing=cond.ltm_routing,
                    batch_size=batch_size)


def stm_recall(model: PMNet, stream, probe: Probe | None = None, batch_size: int = 250) -> float:
    """Mean immediate STM recall (the Phase-1 metric) with an optional probe."""
    with probing(model, probe or Probe()):
        return evaluate(model, stream, consolidation="identity", ltm_routing=False,
                        ltm=False, batch_size=batch_size)["mean_stm"]


def _pp(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}"


def format_diagnostics(d: RouteDiagnostics) -> str:
    """A plain-text table of `d` (what `pmnet diagnose` prints)."""
    lines = [f"{d.checkpoint}: {d.kind}" + (f" ({d.condition})" if d.condition else "")
             + f", {d.episodes} validation episodes",
             f"STM recall {d.stm.recall:.1f}%; random routes {d.stm_random_routes.recall:.1f}% "
             f"(drop {_pp(d.stm_random_routes.drop)} pp, "
             f"{d.stm_random_routes.agreement:.1f}% of answers unchanged); one path for "
             f"every token {d.stm_one_path.recall:.1f}% (drop {_pp(d.stm_one_path.drop)} pp)",
             "",
             f"{'block':>5} {'margin':>8} {'top p':>6} {'-writes b':>10} {'-writes b..':>12}"
             f" {'L changes':>10} {'top group':>10}"
             + (f" {'strict off':>10}" if d.strict_route_change else "")
             + (f" {'-L route b':>11}" if d.updated_ltm else "")]
    for b in range(d.n_blocks):
        frm = d.stm_without_blocks_from[b]
        row = (f"{b:>5} {d.margin_median[b]:>8.4f} {d.top_prob_mean[b]:>6.3f} "
               f"{_pp(d.stm_without_block[b].drop):>10} "
               f"{_pp(frm.drop if frm else None):>12} {d.ltm_route_change[b]:>9.1f}%"
               f" {d.route_concentration[b]:>9.1f}%")
        if d.strict_route_change:
            row += f" {d.strict_route_change[b]:>9.1f}%"
        if d.updated_without_ltm_route:
            row += f" {_pp(d.updated_without_ltm_route[b].drop):>11}"
        lines.append(row)
    lines.append("(drops in pp of STM recall: positive means the intervention hurt; margin: "
                 "median top-1 minus top-2 routing probability)")
    if d.updated_ltm is not None:
        lines.append(f"updated-LTM recall {d.updated_ltm.recall:.1f}%; L removed from every "
                     f"block's routing: {d.updated_routing_off.recall:.1f}% "
                     f"(drop {_pp(d.updated_routing_off.drop)} pp)")
        for fam, off in (d.updated_routing_off_by_family or {}).items():
            lines.append(f"  {fam}: {d.updated_ltm_by_family[fam].recall:.1f}%, L removed "
                         f"from every block {off.recall:.1f}% (drop {_pp(off.drop)} pp)")
    if d.order is not None:
        o = d.order
        lines.append(f"final query: update {o.updated:.1f}%, stale rule {o.stale:.1f}%; last two "
                     f"segments swapped: {o.order_change:.1f}% of answers change, order gain "
                     f"{o.order_gain:+.1f} pp (at most the change: the symmetry bound)")
    if d.query_reach is not None:
        lines.append("final query's tokens by block, % in groups written by the last segment "
                     "only / earlier only / both / none: " + "; ".join(
                         f"{b}: {r.last_only:.0f}/{r.earlier_only:.0f}/{r.both:.0f}/"
                         f"{r.neither:.0f}" for b, r in enumerate(d.query_reach)))
    if d.seg2_route_change_learned is not None:
        lines.append("last segment's routes changed by learned vs identity L, per block: "
                     + ", ".join(f"{x:.1f}%" for x in d.seg2_route_change_learned))
    for name, pc in (("own consolidation", d.seg2_path_change),
                     ("forced identity", d.seg2_path_change_identity)):
        if pc is not None:
            lines.append(f"last segment's path differs from the first segment's at the same "
                         f"position ({name}), per block: all "
                         + ", ".join(f"{x:.1f}%" for x in pc.all) + "; shared prefix ("
                         f"{pc.shared_prefix_share:.0f}% of positions) "
                         + ", ".join(f"{x:.1f}%" for x in pc.shared_prefix))
    if d.query_reach_identity is not None:
        lines.append("final query's tokens under forced identity, same columns: " + "; ".join(
            f"{b}: {r.last_only:.0f}/{r.earlier_only:.0f}/{r.both:.0f}/{r.neither:.0f}"
            for b, r in enumerate(d.query_reach_identity)))
    if d.consolidator_gradient is not None:
        g = d.consolidator_gradient
        lines.append(f"Consolidator gradient ({g.episodes} episodes): |whole| {g.total:.3g}, "
                     f"through routing (Eq. 9) {g.routing:.3g}, through memory (M = S + L) "
                     f"{g.memory:.3g}, through both {g.mixed:.3g} (routing "
                     f"{g.routing_share:.0f}% of the single-kind two; cosine {g.cosine:+.2f})")
    if d.updated_strict_off is not None:
        lines.append(f"updated-LTM recall with no router seeing L (strict routing off, L out "
                     f"of u too): {d.updated_strict_off.recall:.1f}% "
                     f"(drop {_pp(d.updated_strict_off.drop)} pp from its own routing)")
    return "\n".join(lines)
