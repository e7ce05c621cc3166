"""Phase-1 training trajectory: the fused model (issue 20) against the literal model of
235df21 (tests/oracle/model_235df21.py), same weights, same batches, same numbers of
demonstrations, AdamW with the preset's settings, dropout off.

In float64 the two must follow one trajectory (rounding differences of ~1e-16 do not grow
to visible size in a few hundred steps); a wrong gradient would split them at O(1). In
float32 the same run shows how fast rounding alone separates them.

    PYTHONPATH=. .venv/bin/python experiments/phase1_trajectory_check.py --steps 300
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from pmnet import task
from pmnet import train as T
from pmnet.model import PMNet
from tests.oracle import model_235df21 as oracle


def stm_loss(model, context, query, target, k, aux_w):
    B = context.shape[0]
    state = model.init_state(B)
    demo_logits, state = model(context, state, ltm_routing=False, logits="all")
    state = state.clear_context()
    logits, _ = model(query, state, ltm_routing=False, logits="last")
    loss = F.cross_entropy(logits.float(), target)
    if k > 1 and aux_w > 0:
        pos = torch.arange(1, k) * task.DEMO_LEN + 3
        aux = F.cross_entropy(demo_logits[:, pos].flatten(0, 1), context[:, pos + 1].flatten())
        loss = loss + aux_w * aux
    return loss


def run(dtype, steps, preset):
    cfg = T.TrainConfig.from_name(preset)
    torch.manual_seed(0)
    new = PMNet(cfg.model)
    old = oracle.PMNet(cfg.model)
    old.load_state_dict(new.state_dict())
    models = [m.to(dtype).eval() for m in (new, old)]  # eval: no dropout, grads still flow
    opts = []
    for m in models:
        ps = [p for n, p in m.named_parameters() if not n.startswith("consolidator.")]
        for n, p in m.named_parameters():
            p.requires_grad_(not n.startswith("consolidator."))
        opts.append((ps, torch.optim.AdamW(ps, lr=cfg.phase1_lr, betas=tuple(cfg.betas))))
    B = cfg.batch_size
    eps = task.train_episodes(cfg.phase1_seed + 1_000_000, 0, steps * B)
    g = torch.Generator()
    rows = []
    for s in range(steps):
        g.manual_seed(1000 + s)
        k = int(torch.randint(1, task.N_DEMOS + 1, (1,), generator=g))
        b = eps[s * B:(s + 1) * B]
        context = b.seg_tokens[:, 0, : task.DEMO_LEN * k]
        query, target = b.query_tokens[:, 0], b.target[:, 0]
        losses = []
        for m, (ps, opt) in zip(models, opts):
            loss = stm_loss(m, context, query, target, k, cfg.phase1_aux_demo_loss)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ps, cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        diff = max((a - b).abs().max().item() / (b.abs().max().item() + 1e-30)
                   for a, b in zip(models[0].state_dict().values(),
                                   models[1].state_dict().values()) if a.is_floating_point())
        rows.append({"step": s, "k": k, "loss_fused": losses[0], "loss_literal": losses[1],
                     "param_rel_diff": diff})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = {}
    for name, dt in (("float64", torch.float64), ("float32", torch.float32)):
        rows = run(dt, a.steps, a.preset)
        out[name] = rows
        for r in rows[:: max(1, a.steps // 10)] + [rows[-1]]:
            print(f"{name} step {r['step']:4d} k={r['k']} loss fused {r['loss_fused']:.10f} "
                  f"literal {r['loss_literal']:.10f} params rel diff {r['param_rel_diff']:.2e}",
                  flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh)


if __name__ == "__main__":
    main()
