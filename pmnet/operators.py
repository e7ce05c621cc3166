"""The alternative consolidation operators (beyond the paper; issue 11).

The paper compares the Consolidator (Eq. 6-8, `pmnet.model.Consolidator`) only with identity
accumulation; its Limitations name the untested alternatives: "we do not compare alternative
learned overwrite, EMA, linear, or gated recurrent operators". Each is a module here (a
subclass of `ConsolidationOperator`, registered by name in `OPERATORS`) that replaces
L + C_psi(S) in the boundary update (Eq. 8) for occupied groups:

    op = add_operator(model, "gru")              # created fresh at its identity start
    state = model.consolidate(state, mode="gru")  # L+ = f(S, L), wrapped

A Phase-1 model has none (`model.operators` is empty, its state dict is the paper's):
Phase 2 adds the one its condition names (`pmnet.train.init_operator`). `PMNet` knows only
the operators a model holds; this module names and builds them, so the model imports
nothing from here. Equations, parameter counts and choices: docs/design.md and
docs/choices.md, "Consolidation operators".
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pmnet.config import ModelConfig
from pmnet.model import PAPER_MODES, Consolidator, PMNet, angle_diff, wrap


def rotation_angle(w_c: Tensor, w_s: Tensor, c: Tensor, s: Tensor) -> Tensor:
    """angle(w) - angle(z) for complex w = w_c + i w_s and unit z = c + i s, as
    atan2(Im(w conj z), Re(w conj z)) in (-pi, pi]. Exactly 0 when w == z bitwise
    (w_s c - w_c s is then x - x), which makes the operators' identity starts exact."""
    return torch.atan2(w_s * c - w_c * s, w_c * c + w_s * s)


class ConsolidationOperator(nn.Module):
    """A slot-local boundary operator L+ = f(S, L), shared across blocks, groups and slots,
    used in Eq. 8 in place of L + C_psi(S) for occupied groups.

    Every operator is written as the identity update plus a rotation:
    L+ = wrap(L + S + delta(S, L)), where delta is the operator's own maths taken relative to
    L + S (each subclass states f). At its identity start delta is exactly +-0, so L+ equals
    `consolidate(mode="identity")` bit for bit. `reset(std, generator)` draws the random
    matrices from N(0, std) and then sets the parameters that make the start exact.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.P = cfg.phase_dim

    def delta(self, S: Tensor, L: Tensor) -> Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def reset(self, std: float, generator: torch.Generator | None = None) -> None:
        raise NotImplementedError

    def forward(self, S: Tensor, L: Tensor) -> Tensor:
        """S, L: (..., P) phases -> L+: (..., P) in [0, 2pi)."""
        with torch.autocast(device_type=S.device.type, enabled=False):
            S, L = S.float(), L.float()
            return wrap(L + S + self.delta(S, L))


def _normal_(w: Tensor, std: float, generator: torch.Generator | None) -> None:
    w.copy_(torch.randn(w.shape, generator=generator) * std)


class EMAOperator(ConsolidationOperator):
    """`ema`: L+ = L + alpha * angle_diff((L + S) - L) = L + alpha * angle_diff(S), wrapped.

    An exponential moving average of the LTM phase toward the accumulated target L + S, with
    a learned per-dimension rate alpha (P parameters). alpha = 1 is the identity operator
    L + S, alpha = 0 keeps L, 0 < alpha < 1 moves part of the shortest arc.
    delta = (alpha - 1) * angle_diff(S). Start: alpha = 1.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.alpha = nn.Parameter(torch.ones(cfg.phase_dim))

    @torch.no_grad()
    def reset(self, std: float, generator: torch.Generator | None = None) -> None:
        self.alpha.fill_(1.0)

    def delta(self, S: Tensor, L: Tensor) -> Tensor:
        return (self.alpha - 1.0) * angle_diff(S)


class OverwriteOperator(ConsolidationOperator):
    """`overwrite`: a learned gate that replaces the accumulated state by a candidate.

    U = L + S (the identity update), C(S) a candidate of the Consolidator's form (Eq. 6-7,
    its own parameters), g = gamma * sigmoid(W_a [cos S; sin S; cos L; sin L] + b_a):
        L+ = U + g * angle_diff(C(S) - U), wrapped.
    g = 0 accumulates (identity), g = 1 replaces L by C(S) alone. Per-dimension gate (P) and
    per-dimension strength gamma (P). Start: gamma = 0 (exact identity), C(S) = S.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        P = cfg.phase_dim
        self.candidate = Consolidator(cfg)
        self.gate = nn.Linear(4 * P, P)
        self.gamma = nn.Parameter(torch.zeros(P))
        self.reset(cfg.init_std)

    @torch.no_grad()
    def reset(self, std: float, generator: torch.Generator | None = None) -> None:
        for w in (self.candidate.w_g.weight, self.candidate.w_u.weight, self.gate.weight):
            _normal_(w, std, generator)
        self.candidate.reset_identity()
        self.gate.bias.zero_()
        self.gamma.zero_()

    def delta(self, S: Tensor, L: Tensor) -> Tensor:
        U = L + S
        x = torch.cat([torch.cos(S), torch.sin(S), torch.cos(L), torch.sin(L)], dim=-1)
        g = self.gamma * torch.sigmoid(self.gate(x))  # (..., P)
        return g * angle_diff(self.candidate(S) - U)


class LinearOperator(ConsolidationOperator):
    """`linear`: C(S) = atan2 of a linear map of z = [cos S; sin S]; L+ = L + C(S), wrapped.

    w = (I + A) z + b (2P -> 2P, no gate, no nonlinearity), C(S) = atan2(w_sin, w_cos);
    4P^2 + 2P parameters. Computed as delta = angle(w) - S = angle(w conj z), so A = 0, b = 0
    (the start) give C(S) = S and L+ = L + S exactly.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.map = nn.Linear(2 * cfg.phase_dim, 2 * cfg.phase_dim)
        self.reset(cfg.init_std)

    @torch.no_grad()
    def reset(self, std: float, generator: torch.Generator | None = None) -> None:
        nn.init.zeros_(self.map.weight)
        nn.init.zeros_(self.map.bias)

    def delta(self, S: Tensor, L: Tensor) -> Tensor:
        c, s = torch.cos(S), torch.sin(S)
        z = torch.cat([c, s], dim=-1)
        w = z + self.map(z)  # (I + A) z + b
        return rotation_angle(w[..., : self.P], w[..., self.P :], c, s)


class GRUOperator(ConsolidationOperator):
    """`gru`: a gated recurrent update on phasors; input x = [cos S; sin S], hidden
    h = [cos L; sin L], a = [cos(L + S); sin(L + S)] (the identity update as a phasor):
        r  = sigmoid(W_r x + U_r h + b_r)           reset gate   (2P)
        u  = sigmoid(W_u x + U_u h + b_u)           update gate  (2P)
        n  = tanh(W_n x + r * (U_n h) + b_n)        candidate residual
        h' = (1 - u) * a + u * (a + n) = a + u * n
        L+ = atan2(h'_sin, h'_cos) = L + S + angle(h' conj a), wrapped.
    A GRU whose carried state is the accumulated phasor a and whose candidate is a + n; the
    sum L + S is bilinear in the phasors, which no standard GRU candidate can produce, so
    the accumulation is built in and the GRU learns the departure from it.
    W_* (2P -> 2P, with bias) and U_* (2P -> 2P, no bias) for r, u, n: 24P^2 + 6P
    parameters. Start: W_n = U_n = b_n = 0 (n = 0, so h' = a exactly); W_r, U_r, W_u, U_u
    random, b_r = b_u = 0.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        P2 = 2 * cfg.phase_dim
        self.w_x = nn.Linear(P2, 3 * P2)  # [W_r; W_u; W_n] x + [b_r; b_u; b_n]
        self.w_h = nn.Linear(P2, 3 * P2, bias=False)  # [U_r; U_u; U_n] h
        self.reset(cfg.init_std)

    @torch.no_grad()
    def reset(self, std: float, generator: torch.Generator | None = None) -> None:
        P2 = 2 * self.P
        for w in (self.w_x.weight, self.w_h.weight):
            _normal_(w, std, generator)
            w[2 * P2 :].zero_()  # W_n, U_n = 0
        self.w_x.bias.zero_()

    def delta(self, S: Tensor, L: Tensor) -> Tensor:
        U = L + S
        x = torch.cat([torch.cos(S), torch.sin(S)], dim=-1)  # (..., 2P)
        h = torch.cat([torch.cos(L), torch.sin(L)], dim=-1)
        a_c, a_s = torch.cos(U), torch.sin(U)
        gx_r, gx_u, gx_n = self.w_x(x).chunk(3, dim=-1)
        gh_r, gh_u, gh_n = self.w_h(h).chunk(3, dim=-1)
        r = torch.sigmoid(gx_r + gh_r)
        u = torch.sigmoid(gx_u + gh_u)
        n = torch.tanh(gx_n + r * gh_n)
        h_new = torch.cat([a_c, a_s], dim=-1) + u * n
        return rotation_angle(h_new[..., : self.P], h_new[..., self.P :], a_c, a_s)


#: The alternative consolidation operators by name (the `mode` of `PMNet.consolidate`).
OPERATORS: dict[str, type[ConsolidationOperator]] = {
    "ema": EMAOperator,
    "overwrite": OverwriteOperator,
    "linear": LinearOperator,
    "gru": GRUOperator,
}

#: Every `mode` of `PMNet.consolidate`: the paper's two, then the alternative operators.
CONSOLIDATION_MODES: tuple[str, ...] = (*PAPER_MODES, *OPERATORS)


def operator_parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    """{operator name: its parameter count} for a config (built on the meta device)."""
    with torch.device("meta"):
        return {name: sum(p.numel() for p in cls(cfg).parameters())
                for name, cls in OPERATORS.items()}


def add_operator(model: PMNet, name: str) -> ConsolidationOperator:
    """Create the consolidation operator `name` (one of `OPERATORS`) in `model.operators`, at
    its identity start, on the model's device, so that `model.consolidate(mode=name)` can use
    it. Phase-1 checkpoints have no operator: Phase 2 creates it fresh. Returns the existing
    one if the model has it already. The global RNG is left as it was (the module's default
    initialisation draws from a forked copy), so adding an operator changes no other
    randomness of a run; `operator.reset(std, generator)` sets a seeded start."""
    if name not in OPERATORS:
        raise ValueError(f"unknown consolidation operator {name!r}; known: "
                         f"{', '.join(OPERATORS)}")
    if not model.cfg.use_memory:
        raise ValueError("add_operator() needs a model built with use_memory=True")
    if name not in model.operators:
        with torch.random.fork_rng(devices=[]):
            op = OPERATORS[name](model.cfg)
        model.operators[name] = op.to(model.embed.weight.device)
    return model.operators[name]
