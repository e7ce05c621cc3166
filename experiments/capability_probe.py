"""The capability diagnostics of issue 44 for a Consolidator trained by
`experiments/consolidator_probe.py` (which saves `OUT.cons.pt`), kept out of the library:
load the Phase-1 checkpoint, put the trained Consolidator in it, and run `pmnet.diagnose` on
the VALIDATION stream as the Consolidator-only condition of that routing flag.

    .venv/bin/python experiments/capability_probe.py PHASE1.pt CONS.pt OUT.json routing=1 \
        hidden=0 n=1000

hidden: the Consolidator width the probe trained (0: the checkpoint's). CONS may be
`identity` for the checkpoint's identity Consolidator (forced identity's LTM). Prints the
diagnostics table and writes OUT (`RouteDiagnostics.to_dict()` plus the arguments).
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pmnet import task  # noqa: E402
from pmnet.diagnose import diagnose, format_diagnostics  # noqa: E402
from pmnet.model import Consolidator  # noqa: E402
from pmnet.train import load_model_file  # noqa: E402

DEFAULTS = dict(routing=1, hidden=0, n=1000, threads=1)


@torch.no_grad()
def oracle_ceilings(m, stream, routing: bool, batch_size: int = 250) -> dict:
    """What this frozen backbone answers when LTM holds the update by construction (no
    Consolidator could do better by accumulating): `last_only`, LTM = segment 2's STM written
    from an empty memory (the first-mapping read of the update); `overwrite`, identity after
    segment 1, then segment 2's STM replaces LTM in the groups segment 2 wrote (an
    order-aware slot-local operator that sees the occupancy). Recall of the final query, %."""
    from pmnet.evaluate import digit_prediction

    hits = {"last_only": 0, "overwrite": 0}
    for i in range(0, len(stream), batch_size):
        b = stream[i:i + batch_size]
        seg, q = b.seg_tokens, b.query_tokens[:, -1]
        target = b.target_digit[:, -1]
        # last only: segment 2 alone, identity boundary, query
        st = m.init_state(seg.shape[0])
        _, st = m(seg[:, -1], st, ltm_routing=routing, logits="none")
        st = m.consolidate(st, mode="identity").clear_context()
        pred = digit_prediction(m(q, st, ltm_routing=routing, logits="last")[0])
        hits["last_only"] += (pred == target).sum().item()
        # overwrite: segment 1 -> identity; segment 2 -> its STM replaces L where written
        st = m.init_state(seg.shape[0])
        _, st = m(seg[:, 0], st, ltm_routing=routing, logits="none")
        st = m.consolidate(st, mode="identity").clear_context()
        _, st = m(seg[:, 1], st, ltm_routing=routing, logits="none")
        ltm = tuple(torch.where(o[:, :, None, None], s, l)
                    for s, o, l in zip(st.stm, st.occ, st.ltm))
        st = st.with_ltm(ltm).clear_context()
        pred = digit_prediction(m(q, st, ltm_routing=routing, logits="last")[0])
        hits["overwrite"] += (pred == target).sum().item()
    return {k: 100 * v / len(stream) for k, v in hits.items()}


def main(ckpt: str, cons: str, out: str, a: dict) -> dict:
    torch.set_num_threads(a["threads"])
    m, _ = load_model_file(ckpt)
    if a["hidden"]:
        m.cfg = dataclasses.replace(m.cfg, consolidator_hidden=a["hidden"])
        m.consolidator = Consolidator(m.cfg)
    mode = "identity" if cons == "identity" else "learned"
    if mode == "learned":
        m.consolidator.load_state_dict(torch.load(cons, weights_only=True))
    m.eval()
    routing = bool(a["routing"])
    condition = "consolidator_only" if routing else "consolidator_only_routing_off"
    stream = task.validation_stream(a["n"])
    d = diagnose(m, stream, checkpoint=f"{ckpt} + {cons}",
                 condition=condition, consolidation=mode, ltm_routing=routing)
    print(format_diagnostics(d), flush=True)
    extra = {}
    if mode == "identity":  # the backbone's ceilings, once per checkpoint
        extra["oracle"] = oracle_ceilings(m, stream, routing)
        print("oracle LTM (update by construction):", extra["oracle"], flush=True)
    Path(out).write_text(json.dumps({"args": a, "consolidator": cons, **d.to_dict(), **extra},
                                    indent=1))
    return d.to_dict()


if __name__ == "__main__":
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    args = dict(DEFAULTS)
    for kv in sys.argv[4:]:
        k, v = kv.split("=", 1)
        if k not in args:
            raise SystemExit(f"unknown key {k!r}; known: {', '.join(args)}")
        args[k] = int(v)
    main(sys.argv[1], sys.argv[2], sys.argv[3], args)
