"""The `pmnet` command line: info, episodes and clear errors."""

import json

import pytest

from pmnet.cli import main


def test_info_json_has_total_and_subsets(capsys):
    assert main(["info", "--preset", "paper", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["total"] == 29_946_816
    assert d["subsets"]["consolidator_only"] == 12_352
    assert set(d["subsets"]) == {"entire_model", "all_but_consolidator", "consolidator_only",
                                 "memory_consolidator"}


def test_info_table(capsys):
    assert main(["info", "--preset", "debug"]) == 0
    out = capsys.readouterr().out
    assert "consolidator_only" in out and "%" in out


def test_episodes_writes_json_lines(tmp_path, capsys):
    path = tmp_path / "e.jsonl"
    assert main(["episodes", "--n", "3", "--seed", "7", "--out", str(path)]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 3 and {"family", "address", "segments"} <= set(rows[0])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["info", "--preset", "giant"], "unknown model preset"),
        (["episodes", "--n", "0", "--seed", "1"], "zero episodes"),
        (["train", "phase2", "--preset", "debug", "--out", "x", "--condition", "nope",
          "--seed", "1", "--phase1", "x.pt"], "unknown condition"),
        (["train", "phase2", "--preset", "debug", "--out", "x", "--condition", "learned_full",
          "--seed", "1", "--phase1", "missing.pt"], "not found"),
        (["train", "phase1", "--preset", "debug", "--out", "x", "--set", "seeds=[]"],
         "seeds is empty"),
        (["train", "phase1", "--preset", "debug", "--out", "x", "--max-wall", "-1"],
         "--max-wall must be a positive number of seconds"),
        (["train", "phase2", "--preset", "debug", "--out", "x", "--max-wall", "60"],
         "train phase2 needs --condition, --seed and --phase1"),
    ],
)
def test_bad_input_exits_with_a_named_error(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_non_integer_seed_is_rejected_by_the_parser():
    with pytest.raises(SystemExit):
        main(["episodes", "--n", "3", "--seed", "abc"])


def test_info_lists_how_a_preset_departs_from_the_paper(capsys):
    import json

    from pmnet.train import TrainConfig

    assert main(["info", "--preset", "cpu", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert notes == list(TrainConfig.from_name("cpu").notes) and notes
    assert main(["info", "--preset", "cpu"]) == 0
    assert "departs from the paper" in capsys.readouterr().out
    assert main(["info", "--preset", "paper", "--json"]) == 0
    # the paper's own protocol but for the warm start it downloads, which ours trains
    paper_notes = json.loads(capsys.readouterr().out)["notes"]
    assert paper_notes == list(TrainConfig.from_name("paper").notes)
    assert len(paper_notes) == 1 and paper_notes[0].startswith("Phase 0")


def test_info_lists_the_consolidation_operators(capsys):
    assert main(["info", "--preset", "paper", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["operators"] == {"ema": 32, "overwrite": 16_512, "linear": 4_160, "gru": 24_768}
    assert main(["info", "--preset", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["operators"] == {
        "ema": 8, "overwrite": 1_824, "linear": 272, "gru": 1_584}  # phase dim 8 (issue 21)
    assert main(["info", "--preset", "cpu"]) == 0
    out = capsys.readouterr().out
    for name in ("ema", "overwrite", "linear", "gru"):
        assert f"operator {name}" in out


def test_episodes_take_a_segments_count(tmp_path):
    from pmnet import task

    path = tmp_path / "e.jsonl"
    assert main(["episodes", "--n", "3", "--seed", "7", "--segments", "4", "--out",
                 str(path)]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [len(r["segments"]) for r in rows] == [4, 4, 4]
    want = task.episode_records(task.make_episodes(3, 7, stream="train", segments=4))
    assert rows == json.loads(json.dumps(want))
    default = tmp_path / "d.jsonl"
    assert main(["episodes", "--n", "3", "--seed", "7", "--out", str(default)]) == 0
    assert all(len(json.loads(line)["segments"]) == 2
               for line in default.read_text().splitlines())


@pytest.mark.parametrize("value, message", [("1", "got 1"), ("9", "got 9"),
                                            ("three", "expected an integer")])
@pytest.mark.parametrize("command", [
    ["episodes", "--n", "3", "--seed", "7"],
    ["evaluate", "missing-model.pt"],
    ["ltm", "save", "missing-model.pt", "--out", "x.pt"],
    ["ltm", "answer", "missing-model.pt", "--ltm", "x.pt"],
])
def test_bad_segments_are_refused_before_any_work(command, value, message, capsys):
    with pytest.raises(SystemExit) as info:  # the parser refuses, before the model is read
        main([*command, "--segments", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --segments" in err and message in err and "missing-model" not in err


def test_evaluate_on_t_segment_episodes(tmp_path, capsys, one_thread):
    import torch

    from pmnet import task
    from pmnet.config import ModelConfig
    from pmnet.model import PMNet
    from pmnet.train import MODEL_FORMAT, save_model_file

    torch.manual_seed(0)
    model_file = tmp_path / "model.pt"
    save_model_file(model_file, PMNet(ModelConfig.from_name("debug")), fmt=MODEL_FORMAT,
                    meta={})
    assert main(["evaluate", str(model_file), "--n", "6", "--segments", "3"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["segments"] == 3
    assert metrics["stream_hash"] == task.content_hash(task.test_stream(6, segments=3))
    assert {"final_ltm_seg1", "final_ltm_seg3", "seg3_stm"} <= set(metrics)
    assert main(["evaluate", str(model_file), "--n", "6", "--test-seed", "77"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["stream_hash"] == task.content_hash(task.test_stream(6, seed=77))
    assert metrics["stream_hash"] != task.content_hash(task.test_stream(6))


def test_info_prints_each_conditions_gpu_memory_and_packing(capsys):
    """`pmnet info --gpu-mem G`: per condition the memory model's figures at the preset's
    batch, and how many trials share a G GiB card (never more than fit it)."""
    from pmnet.gpu.footprint import usable_bytes

    assert main(["info", "--preset", "debug", "--gpu-mem", "1.5", "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)["memory"]
    assert mem["batch_size"] == 16 and mem["precision"] == "bf16-mixed"
    usable = usable_bytes(int(1.5 * 2**30))
    assert len(mem["conditions"]) == 6
    for name, row in mem["conditions"].items():
        assert row["peak"] == sum(row[k] for k in ("activations", "weights", "gradients",
                                                    "optimizer", "context")), name
        assert row["trials_per_gpu"] * row["peak"] <= usable
        if row["trials_per_gpu"]:
            assert row["gpu_share"] * usable >= row["peak"]
    assert main(["info", "--preset", "debug", "--gpu-mem", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "GPU memory of one Phase-2 trial" in out and "learned_full_dual" in out
    assert "per 1.5 GiB GPU" in out


def test_info_lists_the_baselines_carried_memories(capsys):
    assert main(["info", "--preset", "cpu", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    # M H + H^2 + H with M = 4, H = 64; 3 (H G + G^2 + 2 G) + G H + H with G = 32
    assert d["baselines"] == {"no_reset": 0, "memory_tokens": 4_416,
                              "recurrent_state": 11_520, "no_memory": 0}
    assert main(["info", "--preset", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "baseline memory_tokens" in out and "baseline recurrent_state" in out
    assert "baseline no_reset" not in out  # no module of its own: it trains the whole model


def test_a_strict_off_model_meets_only_a_strict_off_condition(tmp_path, capsys, one_thread):
    """Issue 39: a strict-off model file (routers trained without L in u) evaluated under a
    condition whose routers see L is refused by name, before any compute; under its own
    condition it evaluates, and a strict-off condition makes any model's routers strict."""
    import torch

    from pmnet.config import ModelConfig
    from pmnet.model import PMNet
    from pmnet.train import MODEL_FORMAT, load_model_file, save_model_file

    torch.manual_seed(0)
    model = PMNet(ModelConfig.from_name("debug"))
    model.routing_u_uses_ltm = False
    model_file = tmp_path / "strict.pt"
    save_model_file(model_file, model, fmt=MODEL_FORMAT, meta={})
    assert load_model_file(model_file)[0].routing_u_uses_ltm is False
    args = ["evaluate", str(model_file), "--n", "4"]
    assert main([*args, "--condition", "consolidator_only_routing_off"]) == 2
    err = capsys.readouterr().err
    assert "strict routing-off model" in err and "consolidator_only_routing_off" in err
    assert main([*args, "--condition", "consolidator_only_strict_off"]) == 0
    assert 0 <= json.loads(capsys.readouterr().out)["updated_ltm"] <= 100


def test_train_phase1_max_wall_pauses_and_the_same_command_continues(tmp_path, capsys):
    """Issue 52: `--max-wall` pauses Phase 1 at an epoch end (one epoch per sitting at least);
    the same command continues from --out to the end."""
    argv = ["train", "phase1", "--preset", "debug", "--out", str(tmp_path),
            "--set", "phase1_max_epochs=2", "--set", "phase1_patience=2",
            "--set", "phase1_episodes_per_epoch=32", "--set", "val_episodes=16",
            "--set", "test_episodes=16", "--set", "eval_batch_size=16"]
    assert main([*argv, "--max-wall", "1e-9"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["paused"] is True and (out["epochs_done"], out["max_epochs"]) == (1, 2)
    assert out["reason"] == "max-wall" and not (tmp_path / "phase1.pt").exists()
    assert main(argv) == 0
    done = json.loads(capsys.readouterr().out)
    assert "sha256" in done and (tmp_path / "phase1.pt").is_file()
