"""Route diagnostics (validation, n episodes) of kept per-epoch Lightning checkpoints of a
Phase-1 run: STM recall and the drop with random routes and with one path."""
import json, sys, glob, torch
sys.path.insert(0, "/work/main")
from pmnet import task
from pmnet.diagnose import Probe, stm_recall
from pmnet.model import PMNet
from pmnet.train import TrainConfig
torch.set_num_threads(1)
run, want, n = sys.argv[1], {int(e) for e in sys.argv[2].split(",")}, int(sys.argv[3])
cfg = TrainConfig.from_name("cpu")
stream = task.validation_stream(n)
out = {}
for f in sorted(glob.glob(f"{run}/kept/*.ckpt")):
    ck = torch.load(f, map_location="cpu", weights_only=False)
    ep = int(ck["epoch"]) - 1  # Lightning's epoch counter after the epoch ended -> 0-based index of the epoch done
    if ck["epoch"] not in want and ep not in want:
        continue
    state = {k.removeprefix("model."): v for k, v in ck["state_dict"].items() if k.startswith("model.")}
    m = PMNet(cfg.model); m.load_state_dict(state); m.eval()
    base = stm_recall(m, stream)
    rnd = stm_recall(m, stream, Probe(random_routes=True))
    one = stm_recall(m, stream, Probe(one_path=True))
    out[int(ck["epoch"])] = {"stm": base, "random_drop": base - rnd, "one_path_drop": base - one}
    print(ck["epoch"], f"stm {base:.1f} random {base-rnd:+.1f} one-path {base-one:+.1f}", flush=True)
json.dump(out, open(f"{run}/peeks-{n}.json", "w"), indent=1)
