"""Recipe search for the Consolidator-only arms of the `cpu` preset (issue 9), kept out of the
library: a plain PyTorch loop (no Lightning, no early stopping) that trains only the
Consolidator from a Phase-1 checkpoint and reports the VALIDATION stream every `every` steps.
The fixed test stream is never touched here: recipes were chosen on these numbers, and the
pipeline's test-stream figures come afterwards.

    .venv/bin/python experiments/consolidator_probe.py runs/p1/phase1.pt out.json \
        routing=1 lr=3e-3 std=0.18 steps=2000

Keys (key=value): routing (1 on / 0 off), std (W_g/W_u init, drawn from `seed`), lr, wd
(weight decay of the Consolidator's matrices), steps, bs (batch), seed (data stream and init,
paired with the pipeline's Phase-2 seeds), every (validation interval), hidden (Consolidator
width; 0 keeps the checkpoint's), warm (warmup steps), sched (cosine | const), digits (1: loss
over the 10 digit ids only), aux (weight of an initial-LTM query loss), threads, nval.
Writes OUT (the arguments, identity recall and the validation curve) and OUT.cons.pt (the
trained Consolidator's state dict).
"""

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pmnet import task  # noqa: E402
from pmnet.evaluate import digit_prediction, evaluate  # noqa: E402
from pmnet.model import Consolidator  # noqa: E402
from pmnet.runner import RunOptions, run_episodes  # noqa: E402
from pmnet.train import load_model_file  # noqa: E402

DEFAULTS = dict(routing=1, std=0.18, lr=1e-2, wd=0.0, steps=1200, bs=64, seed=42, every=200,
                hidden=0, warm=50, sched="cosine", digits=0, aux=0.0, threads=1, nval=1000)


def parse(argv: list[str]) -> dict:
    a = dict(DEFAULTS)
    for kv in argv:
        key, value = kv.split("=", 1)
        if key not in a:
            raise SystemExit(f"unknown key {key!r}; known: {', '.join(a)}")
        a[key] = value if isinstance(a[key], str) else type(a[key])(value)
    return a


def main(ckpt: str, out: str, a: dict) -> dict:
    torch.set_num_threads(a["threads"])
    m, _ = load_model_file(ckpt)
    if a["hidden"]:
        m.cfg = dataclasses.replace(m.cfg, consolidator_hidden=a["hidden"])
        m.consolidator = Consolidator(m.cfg)
    torch.manual_seed(a["seed"])
    m.consolidator.reinit(a["std"], torch.Generator().manual_seed(a["seed"]))
    for n, p in m.named_parameters():
        p.requires_grad_(n.startswith("consolidator."))
    m.train()
    params = list(m.consolidator.parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": a["wd"]},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=a["lr"], betas=(0.9, 0.95))
    steps, warm = a["steps"], a["warm"]

    def factor(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        if a["sched"] == "const":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warm) / max(1, steps - warm))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    routing = bool(a["routing"])
    queries = ("updated_ltm", "initial_ltm") if a["aux"] else ("updated_ltm",)
    opts = RunOptions("learned", routing, queries=queries)
    val = task.validation_stream(a["nval"])
    digits = torch.tensor(task.DIGIT_TOKENS)

    def validate() -> tuple:
        r = evaluate(m, val, consolidation="learned", ltm_routing=routing, batch_size=500,
                     full=False, stm=False)
        res = (round(r["updated_ltm"], 1), round(r["updated_ltm_add10"], 1),
               round(r["updated_ltm_affine10"], 1))
        if a["aux"]:
            with torch.no_grad():
                lg = run_episodes(m, val[:500], RunOptions("learned", routing,
                                                           queries=("initial_ltm",)))
            pred = digit_prediction(lg["initial_ltm"])
            res += (round(100 * (pred == val.target_digit[:500, 0]).float().mean().item(), 1),)
        return res

    ident = evaluate(m, val, consolidation="identity", ltm_routing=routing, batch_size=500,
                     full=False, stm=False)
    log = {"args": a, "identity": round(ident["updated_ltm"], 1), "curve": []}
    print("identity", log["identity"], "start", validate(), flush=True)
    per_epoch = 6400 // a["bs"]
    t0, losses = time.time(), []
    for s in range(steps):
        epoch, i = divmod(s, per_epoch)
        if i == 0:
            episodes = task.train_episodes(a["seed"], epoch, per_epoch * a["bs"])
        b = episodes[i * a["bs"]:(i + 1) * a["bs"]]
        res = run_episodes(m, b, opts)
        logits = res["updated_ltm"].float()
        if a["digits"]:
            loss = F.cross_entropy(logits[:, digits], b.target_digit[:, 1])
        else:
            loss = F.cross_entropy(logits, b.target[:, 1])
        if a["aux"]:
            loss = loss + a["aux"] * F.cross_entropy(res["initial_ltm"].float(), b.target[:, 0])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (s + 1) % a["every"] == 0:
            row = {"step": s + 1, "loss": round(sum(losses) / len(losses), 3),
                   "val": validate(), "t": round(time.time() - t0)}
            losses = []
            log["curve"].append(row)
            print(row, flush=True)
    Path(out).write_text(json.dumps(log))
    torch.save(m.consolidator.state_dict(), f"{out}.cons.pt")
    return log


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2], parse(sys.argv[3:]))
