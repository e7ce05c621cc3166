"""LTM that outlives the process (issue 11, part 4), measured on a trained model, kept out of
the library: the final queries of a stream answered three ways and compared bit for bit.

    .venv/bin/python experiments/ltm_restart.py MODEL OUT_DIR [condition=consolidator_only] \
        [n=2000] [segments=2] [other=ANOTHER_MODEL]

1. In this process, never saved: the persistent trajectory up to the last boundary
   (`persist.consolidate_batch`), then the final queries (`persist.answer_final`).
2. `pmnet ltm save MODEL --out OUT_DIR/ltm.pt` in a new process.
3. `pmnet ltm answer MODEL --ltm OUT_DIR/ltm.pt` in another new process.
4. The refusals, each in a new process that must exit 2 with its message: the file with
   `other` (another model; skipped if not given), a copy with one byte flipped, and a copy
   cut in half.

Writes OUT_DIR/summary.json (recall and the sha256 of the float32 logits of 1 and 3, wall
time of each step, file size, the refusals' exit codes and messages) and exits 1 unless
the restored answers equal the never-saved ones bit for bit and every refusal happened.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pmnet import task  # noqa: E402
from pmnet.persist import answer_final, consolidate_batch, score_final  # noqa: E402
from pmnet.runner import RunOptions  # noqa: E402
from pmnet.train import get_condition, load_model_file  # noqa: E402

DEFAULTS = dict(condition="consolidator_only", n=2000, segments=2, other="")
PMNET = [sys.executable, "-m", "pmnet.cli"]


def _cli(*args: str) -> tuple[int, str, str, float]:
    t = time.time()
    proc = subprocess.run([*PMNET, *args], capture_output=True, text=True)
    return proc.returncode, proc.stdout, proc.stderr, time.time() - t


def _refusal(name: str, model: str, ltm: Path) -> dict:
    code, _, err, wall = _cli("ltm", "answer", model, "--ltm", str(ltm))
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return {"case": name, "exit": code, "message": lines[-1] if lines else "",
            "refused": code == 2, "wall_s": round(wall, 2)}


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    model_file, out = argv[0], Path(argv[1])
    opts = dict(DEFAULTS)
    for kv in argv[2:]:
        key, _, value = kv.partition("=")
        if key not in opts:
            raise SystemExit(f"unknown key {key!r}; known: {sorted(opts)}")
        opts[key] = type(DEFAULTS[key])(value)
    cond = get_condition(opts["condition"])  # bad input fails before any compute
    out.mkdir(parents=True, exist_ok=True)
    ltm_file = out / "ltm.pt"

    t = time.time()  # 1. never saved, in this process
    model, _ = load_model_file(model_file)
    stream = task.test_stream(opts["n"], segments=opts["segments"])
    state = consolidate_batch(model, stream, RunOptions(cond.consolidation, cond.ltm_routing))
    logits = answer_final(model, stream, state, ltm_routing=cond.ltm_routing)
    live = {**score_final(logits, stream), "wall_s": round(time.time() - t, 2)}

    code, stdout, err, wall = _cli("ltm", "save", model_file, "--out", str(ltm_file),
                                   "--condition", cond.name, "--stream", "test",
                                   "--n", str(opts["n"]), "--segments", str(opts["segments"]))
    if code != 0:
        raise SystemExit(f"ltm save failed ({code}): {err[-2000:]}")
    saved = {**json.loads(stdout), "wall_s": round(wall, 2), "bytes": ltm_file.stat().st_size}

    code, stdout, err, wall = _cli("ltm", "answer", model_file, "--ltm", str(ltm_file))
    if code != 0:
        raise SystemExit(f"ltm answer failed ({code}): {err[-2000:]}")
    restored = {**json.loads(stdout), "wall_s": round(wall, 2)}

    data = ltm_file.read_bytes()
    flipped, cut = out / "ltm-flipped.pt", out / "ltm-cut.pt"
    middle = len(data) // 2
    flipped.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:])
    cut.write_bytes(data[:middle])
    refusals = [_refusal("one byte flipped", model_file, flipped),
                _refusal("cut in half", model_file, cut)]
    if opts["other"]:
        refusals.insert(0, _refusal(f"another model ({opts['other']})", opts["other"],
                                    ltm_file))
    flipped.unlink()
    cut.unlink()

    same = (restored["logits_sha256"] == live["logits_sha256"]
            and restored["updated_ltm"] == live["updated_ltm"])
    summary = {"model": model_file, **opts, "never_saved": live, "save": saved,
               "restored_in_a_new_process": restored, "bit_for_bit": same,
               "refusals": refusals, "torch_threads": __import__("torch").get_num_threads()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0 if same and all(r["refused"] for r in refusals) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
