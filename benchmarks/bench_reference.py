"""This PMNet against the public reference PMNet (`swgoo/pmnet`) at the paper's shapes.

The reference's code stays outside this repository: pass the path of a checkout of it
(`git clone https://github.com/swgoo/pmnet`; it needs `transformers` and `einops`, e.g.
`pip install "transformers==4.57.6" einops`). Both models get the paper's sizes (12 layers,
hidden 384, FFN 1,024, 12 heads of 64, sliding window 128, attention dropout 0.1, memory
writes every 3 layers, branch 4, phase dim 32, 4 read heads, RoPE base 1e6, byte vocabulary
256, tied embeddings), batch `--batch` (64), in train mode with every parameter trainable.

One step, forward and backward (no optimiser; gradients are dropped outside the timing):

    ours       the memory episode of the paper: segment 1 (40 tokens) -> consolidate ->
               clear -> segment 2 (40) -> consolidate -> clear -> query (4 tokens), LTM
               routing on, cross-entropy on the query's last logits (`--compile`: that
               whole step through torch.compile, its cold compile reported apart)
    reference  the same 84 tokens in one forward (the reference has no context boundary:
               its memory runs through the whole sequence; its sliding window of 128 covers
               it), cross-entropy on the last position's logits

The same tokens, the same sizes, the same work per token up to our two consolidations and
the reference's attention over 84 instead of at most 40 keys (both small against the
projections and MLPs). fp32, and bf16 under `torch.autocast("cpu")` for both.

Each (model, dtype) runs in its own process; rounds alternate them, so read the ratios.

    .venv/bin/python benchmarks/bench_reference.py --reference /path/to/pmnet --threads 2

Writes benchmarks/results/reference-<YYYYmmdd-HHMMSS>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEG, QUERY = 40, 4


def reference_model(path: str):
    """The reference's PMNetForCausalLM at the paper's sizes (imported from `path`)."""
    pkg = types.ModuleType("pmnet_reference")
    pkg.__path__ = [path]
    sys.modules["pmnet_reference"] = pkg
    from pmnet_reference.configuration_pmnet import PMNetConfig
    from pmnet_reference.modeling_pmnet import PMNetForCausalLM

    cfg = PMNetConfig(
        vocab_size=256, hidden_size=384, intermediate_size=1024, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, head_dim=64, memory_size=32,
        num_memory=4, num_memory_read_heads=4, memory_write_period=3,
        tie_word_embeddings=True, rope_theta=1e6, use_sliding_window=True, sliding_window=128,
        layer_types=["sliding_attention"] * 12, attention_dropout=0.1, use_cache=False)
    cfg._attn_implementation = "sdpa"
    return PMNetForCausalLM(cfg)


def worker(args) -> int:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    B = args.batch
    tokens = torch.randint(0, 256, (B, 2 * SEG + QUERY), generator=g)
    target = torch.randint(0, 256, (B,), generator=g)
    dtype = {"fp32": None, "bf16": torch.bfloat16}[args.dtype]
    if args.model == "reference":
        model = reference_model(args.reference).train()

        def loss_fn():
            out = model(input_ids=tokens, use_cache=False, logits_to_keep=1).logits[:, -1]
            return F.cross_entropy(out.float(), target)
    else:
        sys.path.insert(0, str(REPO))
        from pmnet.config import ModelConfig
        from pmnet.model import PMNet

        model = PMNet(ModelConfig.from_name("paper")).train()

        def loss_fn():
            st = model.init_state(B)
            for s in (tokens[:, :SEG], tokens[:, SEG:2 * SEG]):
                _, st = model(s, st, ltm_routing=True, logits="none")
                st = model.consolidate(st, mode="learned").clear_context()
            out, _ = model(tokens[:, 2 * SEG:], st, ltm_routing=True, logits="last")
            return F.cross_entropy(out.float(), target)

        if args.compile:
            loss_fn = torch.compile(loss_fn)
    n_params = sum(p.numel() for p in model.parameters())

    def step():
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = loss_fn()
        loss.backward()
        model.zero_grad(set_to_none=True)

    t = time.perf_counter()
    step()
    first_s = time.perf_counter() - t
    step()
    print(json.dumps({"ready": True, "first_step_s": first_s, "params": n_params}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] != "time":
            break
        times = []
        for _ in range(cmd["n"]):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        print(json.dumps({"times": times}), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", required=True, help="path to a checkout of swgoo/pmnet")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--models", default="reference,ours,ours-compiled")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    ref = Path(args.reference)
    if not (ref / "modeling_pmnet.py").is_file():
        ap.error(f"--reference {ref}: no modeling_pmnet.py there (a checkout of swgoo/pmnet)")
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_model import code_version, machine
    from bench_step import Proc, save_result

    started = time.time()
    models = [m for m in args.models.split(",") if m]
    procs, ready, times = {}, {}, {}
    for dtype in [d for d in args.dtypes.split(",") if d]:
        for m in models:
            key = f"{m}/{dtype}"
            cmd = [sys.executable, __file__, "--worker", "--reference", str(ref.resolve()),
                   "--model", "reference" if m == "reference" else "ours", "--dtype", dtype,
                   "--batch", str(args.batch), "--threads", str(args.threads)]
            if m == "ours-compiled":
                cmd.append("--compile")
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
            procs[key] = Proc(key, cmd, env)
            ready[key] = procs[key].recv()
            times[key] = []
            print(f"  {key:22s} ready ({ready[key]['params']:,} parameters, first step "
                  f"{ready[key]['first_step_s']:.1f} s)", flush=True)
    for rnd in range(args.rounds):
        for key, p in procs.items():
            p.send({"cmd": "time", "n": args.iters})
            times[key] += p.recv()["times"]
        print(f"  round {rnd}: " + "  ".join(f"{k} {statistics.median(v):.2f} s"
                                             for k, v in times.items()), flush=True)
    for p in procs.values():
        p.close()
    summary = {}
    for key, ts in times.items():
        med = statistics.median(ts)
        summary[key] = {"median_s": med, "episodes_per_s": args.batch / med, **ready[key]}
    for key in summary:
        m, dtype = key.split("/")
        base = summary.get(f"reference/{dtype}")
        if base:
            summary[key]["speedup_vs_reference"] = base["median_s"] / summary[key]["median_s"]
    print(json.dumps({k: {kk: round(v, 3) if isinstance(v, float) else v
                          for kk, v in s.items()} for k, s in summary.items()}, indent=1))
    out = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "args": vars(args),
           "started": dt.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
           "wall_s": time.time() - started, "code": code_version(), "machine": machine("cpu"),
           "summary": summary, "times_s": times}
    if not args.no_save:
        save_result(out, "reference")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
