"""LTM that outlives the process: a round trip through a file (in this process and in a new
one) answers the final queries bit for bit as the LTM never saved; another model's file, a
corrupted, truncated or foreign file is refused with a clear error."""

import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pmnet import task
from pmnet.cli import main as cli_main
from pmnet.config import ModelConfig
from pmnet.model import PMNet
from pmnet.persist import (
    LTM_FORMAT,
    LTMFileError,
    answer_final,
    consolidate_batch,
    load_ltm,
    model_fingerprint,
    save_ltm,
    score_final,
)
from pmnet.runner import RunOptions, run_episodes
from pmnet.train import MODEL_FORMAT, save_model_file

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = PMNet(ModelConfig.from_name("debug"))
    with torch.no_grad():  # a Consolidator off the identity, so learned != raw accumulation
        m.consolidator.w_d.weight.normal_(0, 0.3)
    return m.eval()


@pytest.fixture(scope="module")
def stream():
    return task.test_stream(40)


def test_restored_ltm_answers_bit_for_bit_like_the_ltm_never_saved(model, stream, tmp_path):
    opts = RunOptions("learned", True)
    with torch.no_grad():
        direct = run_episodes(model, stream, opts)["updated_ltm"]
    state = consolidate_batch(model, stream, opts)
    path = tmp_path / "ltm.pt"
    digest = save_ltm(path, model, state, segments=2, meta={"stream": "test", "n": 40})
    saved = load_ltm(path, model)
    assert saved.n_episodes == 40 and saved.meta["n"] == 40 and len(digest) == 64
    assert all(torch.equal(a, b) for a, b in zip(saved.ltm, state.ltm))
    restored = answer_final(model, stream, saved.state(model), ltm_routing=True)
    assert torch.equal(restored, direct)
    # score_final: recall over the digit ids and the logits' fingerprint, equal for both
    score = score_final(restored, stream)
    assert score == score_final(direct, stream)
    pred = direct[:, list(task.DIGIT_TOKENS)].argmax(-1)
    assert score["updated_ltm"] == pytest.approx(
        100 * (pred == stream.target_digit[:, 1]).float().mean().item())
    assert score["logits_sha256"] == hashlib.sha256(direct.float().numpy().tobytes()).hexdigest()
    # and the file is loadable without unpickling code
    payload = torch.load(path, weights_only=True)
    assert payload["format"] == LTM_FORMAT and payload["model_sha256"] == model_fingerprint(model)


def test_a_new_process_answers_the_same(model, tmp_path):
    model_file = tmp_path / "model.pt"
    save_model_file(model_file, model, fmt=MODEL_FORMAT, meta={})
    ltm_file = tmp_path / "ltm.pt"
    assert cli_main(["ltm", "save", str(model_file), "--out", str(ltm_file), "--n", "30",
                     "--condition", "consolidator_only"]) == 0
    out = subprocess.run([sys.executable, "-m", "pmnet.cli", "ltm", "answer", str(model_file),
                          "--ltm", str(ltm_file)], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    restored = json.loads(out.stdout)
    stream = task.test_stream(30)
    with torch.no_grad():
        logits = run_episodes(model, stream, RunOptions("learned", True))["updated_ltm"]
    assert restored["logits_sha256"] == hashlib.sha256(
        logits.float().contiguous().numpy().tobytes()).hexdigest()
    pred = logits[:, list(task.DIGIT_TOKENS)].argmax(-1)
    assert restored["updated_ltm"] == pytest.approx(
        100 * (pred == stream.target_digit[:, 1]).float().mean().item())


@pytest.fixture()
def saved(model, stream, tmp_path):
    path = tmp_path / "ltm.pt"
    save_ltm(path, model, consolidate_batch(model, stream, RunOptions("learned", True)),
             segments=2)
    return path


def test_another_models_file_is_refused(model, saved):
    other = PMNet(model.cfg)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        other.consolidator.w_d.bias[0] += 1e-3  # one weight differs
    with pytest.raises(LTMFileError, match="written by another model"):
        load_ltm(saved, other)
    bigger = PMNet(ModelConfig.from_name("debug", phase_dim=16))
    with pytest.raises(LTMFileError, match="another config"):
        load_ltm(saved, bigger)


def test_corrupted_truncated_and_foreign_files_are_refused(model, saved, tmp_path):
    data = saved.read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(LTMFileError, match="not a readable LTM file"):
        load_ltm(truncated, model)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00not a torch file" * 64)
    with pytest.raises(LTMFileError, match="not a readable LTM file"):
        load_ltm(garbage, model)
    # tensors edited after writing (the recorded content sha256 no longer matches)
    payload = torch.load(saved, weights_only=True)
    payload["ltm"][0][0, 0, 0, 0] += 0.5
    tampered = tmp_path / "tampered.pt"
    buf = io.BytesIO()
    torch.save(payload, buf)
    tampered.write_bytes(buf.getvalue())
    with pytest.raises(LTMFileError, match="do not match the content sha256"):
        load_ltm(tampered, model)
    # a model checkpoint is not an LTM file
    ckpt = tmp_path / "model.pt"
    save_model_file(ckpt, model, fmt=MODEL_FORMAT, meta={})
    with pytest.raises(LTMFileError, match="not a pmnet-ltm/v1 file"):
        load_ltm(ckpt, model)
    with pytest.raises(LTMFileError, match="not found"):
        load_ltm(tmp_path / "missing.pt", model)


def test_cli_refuses_another_models_file_with_exit_2(model, saved, tmp_path, capsys):
    other = PMNet(model.cfg)  # fresh weights
    model_file = tmp_path / "other.pt"
    save_model_file(model_file, other, fmt=MODEL_FORMAT, meta={})
    assert cli_main(["ltm", "answer", str(model_file), "--ltm", str(saved)]) == 2
    assert "written by another model" in capsys.readouterr().err


def test_t_segment_ltm_round_trip_through_the_cli(model, tmp_path, capsys, one_thread):
    """`ltm save --segments 3` stores T = 3; `answer` regenerates the 3-segment stream from
    the file and answers its final (segment-3) queries as the LTM never saved; another T is
    refused before any episode is run."""
    model_file = tmp_path / "model.pt"
    save_model_file(model_file, model, fmt=MODEL_FORMAT, meta={})
    ltm_file = tmp_path / "ltm3.pt"
    assert cli_main(["ltm", "save", str(model_file), "--out", str(ltm_file), "--n", "12",
                     "--segments", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["segments"] == 3
    assert load_ltm(ltm_file, model).segments == 3
    assert cli_main(["ltm", "answer", str(model_file), "--ltm", str(ltm_file)]) == 0
    answered = json.loads(capsys.readouterr().out)
    stream = task.test_stream(12, segments=3)
    with torch.no_grad():
        logits = run_episodes(model, stream, RunOptions("learned", True))["updated_ltm"]
    import hashlib

    assert answered["segments"] == 3 and answered["logits_sha256"] == hashlib.sha256(
        logits.float().contiguous().numpy().tobytes()).hexdigest()
    pred = logits[:, list(task.DIGIT_TOKENS)].argmax(-1)
    assert answered["updated_ltm"] == pytest.approx(
        100 * (pred == stream.target_digit[:, -1]).float().mean().item())
    assert cli_main(["ltm", "answer", str(model_file), "--ltm", str(ltm_file),
                     "--segments", "2"]) == 2
    assert "holds the LTM of 3-segment episodes, not of 2-segment" in capsys.readouterr().err


def test_segments_count_is_stored_checked_and_defaults_to_two(model, saved, tmp_path,
                                                             one_thread):
    assert load_ltm(saved, model).segments == 2
    with pytest.raises(LTMFileError, match="3-segment ones"):
        load_ltm(saved, model, segments=3)
    payload = torch.load(saved, weights_only=True)
    assert payload["segments"] == 2
    for value, name in ((None, "old.pt"), (9, "bad.pt")):
        if value is None:
            del payload["segments"]  # a file written before the field existed
        else:
            payload["segments"] = value
        buf = io.BytesIO()
        torch.save(payload, buf)
        (tmp_path / name).write_bytes(buf.getvalue())
    assert load_ltm(tmp_path / "old.pt", model).segments == 2
    with pytest.raises(LTMFileError, match="segments count 9 is not an int in 2..8"):
        load_ltm(tmp_path / "bad.pt", model)
    state = consolidate_batch(model, task.test_stream(4), RunOptions("learned", True))
    with pytest.raises(ValueError, match="segments must be an int in 2..8"):
        save_ltm(tmp_path / "x.pt", model, state, segments=1)
    assert not (tmp_path / "x.pt").exists()


def test_a_baseline_has_no_ltm_file_to_write(model, tmp_path, capsys):
    model_file = tmp_path / "model.pt"
    save_model_file(model_file, model, fmt=MODEL_FORMAT, meta={})
    out = tmp_path / "ltm.pt"
    rc = cli_main(["ltm", "save", str(model_file), "--out", str(out), "--n", "30",
                   "--condition", "baseline_memory_tokens"])
    assert rc != 0 and not out.exists()
    assert "baseline_memory_tokens is a baseline" in capsys.readouterr().err
