"""Experiment grids in tune_spaces/: shapes, derivation, validation (fast, no Ray runtime)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pmnet.train import ALL_CONDITIONS, CONDITIONS, TrainConfig
from pmnet.trial_id import TrialId
from tune_spaces import (
    PAPER_CONDITIONS,
    PAPER_SEEDS,
    SPACES,
    Space,
    SpaceError,
    Variant,
    default,
    get_space,
    paper,
    tiny,
)


def test_paper_grid_is_six_conditions_by_five_seeds():
    sp = paper(TrainConfig.from_name("paper"))
    assert sp.conditions == PAPER_CONDITIONS == tuple(CONDITIONS)
    assert sp.seeds == PAPER_SEEDS == (42, 43, 44, 45, 46)
    assert sp.n_trials == 30 and len(set(sp.trials)) == 30
    assert sp.size == "6 conditions x 5 seeds = 30 trials"
    sp.validate(CONDITIONS)


@pytest.mark.parametrize("preset", ["debug", "cpu", "paper"])
def test_default_grid_comes_from_the_preset(preset):
    cfg = TrainConfig.from_name(preset)
    sp = default(cfg)
    assert sp.conditions == tuple(cfg.conditions)
    assert sp.seeds == tuple(cfg.seeds)
    assert sp.resources() == {"cpu": 1.0}
    gpu = default(cfg, gpu=True)
    assert 0 < gpu.gpus_per_trial <= 1 and gpu.resources()["gpu"] == gpu.gpus_per_trial
    sp.validate(CONDITIONS)


def test_tiny_grid_derives_from_default():
    cfg = TrainConfig.from_name("debug")
    sp = tiny(cfg)
    assert sp.name == "tiny" and sp.n_trials == 4
    assert sp.seeds == tuple(cfg.seeds)[:2]
    assert sp.cpus_per_trial == default(cfg).cpus_per_trial
    assert sp.trials == [TrialId("learned_full", 42), TrialId("consolidator_only", 42),
                         TrialId("learned_full", 43), TrialId("consolidator_only", 43)]
    assert [t.name for t in sp.trials][:2] == ["learned_full-s42", "consolidator_only-s42"]


def test_registry_and_derive():
    assert set(SPACES) >= {"default", "paper", "tiny"}
    assert get_space("paper") is paper
    with pytest.raises(SpaceError, match="unknown grid 'nope'"):
        get_space("nope")
    sp = default(TrainConfig.from_name("debug")).derive(seeds=[7, 8, 9], conditions="learned_full")
    assert sp.seeds == (7, 8, 9) and sp.conditions == ("learned_full",)
    assert Space.from_dict(sp.to_dict()) == sp


def test_param_space_is_a_full_grid():
    from ray.tune.search.variant_generator import generate_variants

    sp = tiny(TrainConfig.from_name("debug"))
    variants = [cfg for _, cfg in generate_variants(sp.param_space())]
    assert [TrialId.from_config(v) for v in variants] == sp.trials
    assert set(sp.param_space()) == {"condition", "seed"}  # no variant key: configs as before


@pytest.mark.parametrize("changes, message", [
    ({"conditions": ("learned_full", "no_such_condition")}, "unknown condition"),
    ({"conditions": ()}, "condition list is empty"),
    ({"conditions": ("learned_full", "learned_full")}, "listed twice"),
    ({"seeds": ()}, "seed list is empty"),
    ({"seeds": (42, -1)}, "non-negative integers"),
    ({"seeds": (42, True)}, "non-negative integers"),
    ({"seeds": (42, 42)}, "listed twice"),
    ({"gpus_per_trial": 1.5}, "fraction of one GPU"),
    ({"gpus_per_trial": -0.1}, "fraction of one GPU"),
    ({"gpus_per_trial": float("nan")}, "finite number"),
    ({"cpus_per_trial": 0}, "cpus_per_trial must be > 0"),
    ({"max_failures": -1}, "max_failures"),
    ({"max_concurrent": 1.5}, "max_concurrent"),
    ({"phase1_seeds": (0, -1)}, "Phase-1 seeds must be non-negative integers"),
    ({"phase1_seeds": (0, 0)}, r"Phase-1 seed\(s\) listed twice: \[0\]"),
])
def test_bad_spaces_fail_with_a_clear_message(changes, message):
    sp = tiny(TrainConfig.from_name("debug")).derive(**changes)
    with pytest.raises(SpaceError, match=message):
        sp.validate(CONDITIONS)


@pytest.mark.parametrize("preset", ["debug", "cpu", "paper"])
def test_operators_grid_is_the_consolidator_and_four_operators_by_the_presets_seeds(preset):
    from pmnet.conditions import ALL_CONDITIONS, OPERATOR_CONDITIONS
    from tune_spaces import OPERATOR_GRID_CONDITIONS, operators

    cfg = TrainConfig.from_name(preset)
    sp = get_space("operators")(cfg)
    assert get_space("operators") is operators and sp.name == "operators"
    assert sp.conditions == OPERATOR_GRID_CONDITIONS == (
        "consolidator_only", "operator_ema", "operator_overwrite", "operator_linear",
        "operator_gru")
    assert set(sp.conditions[1:]) == set(OPERATOR_CONDITIONS)
    k = max(1, len(cfg.phase1_seeds))  # nested under the preset's Phase-1 checkpoints
    assert sp.seeds == tuple(cfg.seeds) and sp.n_trials == 5 * len(cfg.seeds) * k
    assert sp.phase1_seeds == default(cfg).phase1_seeds
    assert sp.resources() == default(cfg).resources()
    sp.validate(ALL_CONDITIONS)
    with pytest.raises(SpaceError, match="unknown condition"):  # not among the paper's six
        sp.validate(CONDITIONS)
    # the paper's grid is unchanged by the operator conditions
    assert paper(cfg).conditions == PAPER_CONDITIONS == tuple(CONDITIONS)
    assert len(PAPER_CONDITIONS) == 6


def test_the_pipeline_accepts_the_operators_grid():
    from pipelines.plan import build_space

    sp = build_space(TrainConfig.from_name("debug"), grid="operators")
    assert sp.name == "operators" and "operator_gru" in sp.conditions
    assert build_space(TrainConfig.from_name("debug"), grid="operators",
                       conditions="operator_ema").conditions == ("operator_ema",)


# -- variants ----------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["debug", "cpu", "paper"])
def test_segments_grid_is_the_consolidator_by_t_and_gradient_mode_by_the_presets_seeds(preset):
    from pmnet.conditions import ALL_CONDITIONS
    from tune_spaces import SEGMENT_COUNTS, SEGMENT_GRAPHS, segment_variants, segments

    # one Phase-1 checkpoint (the nesting under a preset's checkpoints is tested below)
    cfg = dataclasses.replace(TrainConfig.from_name(preset), phase1_seeds=())
    sp = get_space("segments")(cfg)
    assert get_space("segments") is segments and sp.name == "segments"
    assert (SEGMENT_COUNTS, SEGMENT_GRAPHS) == ((2, 4, 8), ("full", "truncated"))
    assert sp.conditions == ("consolidator_only",) and sp.seeds == tuple(cfg.seeds)
    assert sp.variant_names == ["T2-full", "T2-truncated", "T4-full", "T4-truncated",
                                "T8-full", "T8-truncated"]
    assert sp.variant("T4-truncated").as_dict() == {"segments": 4, "ltm_graph": "truncated"}
    assert sp.variants == segment_variants()
    assert sp.n_trials == 6 * len(cfg.seeds) == len(set(sp.trials))
    assert sp.size == f"1 conditions x 6 variants x {len(cfg.seeds)} seeds = {sp.n_trials} trials"
    assert sp.resources() == default(cfg).resources()
    sp.validate(ALL_CONDITIONS, cfg)
    for v in sp.variants:  # each variant's TrainConfig: the preset's with T and the mode
        got = v.apply(cfg)
        assert (got.segments, got.ltm_graph) == (v.as_dict()["segments"],
                                                 v.as_dict()["ltm_graph"])
        assert got.phase1_lr == cfg.phase1_lr and got.model == cfg.model
    # derive another grid from the same constants
    assert [v.name for v in segment_variants((3,), ("full",))] == ["T3-full"]
    assert "linear" in segments.__doc__


def test_variant_trials_and_their_tune_configs():
    from ray.tune.search.variant_generator import generate_variants

    from tune_spaces import segments

    sp = segments(TrainConfig.from_name("debug"))
    assert sp.trials[:3] == [TrialId("consolidator_only", 42, "T2-full"),
                             TrialId("consolidator_only", 43, "T2-full"),
                             TrialId("consolidator_only", 42, "T2-truncated")]
    assert sp.trials[0].name == "consolidator_only-T2-full-s42"
    got = [TrialId.from_config(c) for _, c in generate_variants(sp.param_space())]
    assert got == sp.trials  # Tune expands the grid in the order `trials` says
    narrowed = sp.only_variants(["T8-full", "T2-full"])
    assert narrowed.variant_names == ["T2-full", "T8-full"] and narrowed.n_trials == 4
    with pytest.raises(SpaceError, match=r"unknown variant\(s\) \['T3-full'\]; known "
                                         r"variants: 'T2-full'"):
        sp.only_variants(["T3-full"])
    with pytest.raises(SpaceError, match="only the default variant"):
        default(TrainConfig.from_name("debug")).only_variants(["x"])


def test_spaces_round_trip_and_old_stored_spaces_have_the_default_variant():
    from tune_spaces import segments

    cfg = TrainConfig.from_name("debug")
    for sp in (segments(cfg), tiny(cfg), default(cfg).derive(variants=Variant("lr_hi",
                                                                            {"lr": 0.01}))):
        d = sp.to_dict()
        assert Space.from_dict(d) == sp
        assert Space.from_dict(json.loads(json.dumps(d))) == sp  # as stored in pipeline.json
    old = tiny(cfg).to_dict()
    del old["variants"]  # pipeline.json written before variants existed
    back = Space.from_dict(old)
    assert back == tiny(cfg) and back.variants == (Variant(),) and not back.has_variants
    assert [t.name for t in back.trials] == ["learned_full-s42", "consolidator_only-s42",
                                             "learned_full-s43", "consolidator_only-s43"]
    # overrides compare equal whatever order they were given in
    assert Variant("v", {"segments": 4, "lr": 0.1}) == Variant("v", {"lr": 0.1, "segments": 4})
    with pytest.raises(SpaceError, match="variant record"):
        Space.from_dict({**old, "variants": [{"name": "v", "sets": {}}]})


@pytest.mark.parametrize("variants, message", [
    ((Variant("bad", {"phase1_lr": 0.1}),),
     "variant 'bad' sets 'phase1_lr', which is not a Phase-2-only TrainConfig field"),
    ((Variant("bad", {"model.hidden": 8}),), "sets 'model.hidden', which is not a Phase-2"),
    ((Variant("bad", {"no_such_field": 1}),), "sets 'no_such_field', which is not a Phase-2"),
    ((Variant("bad", {"seeds": 1}),), "sets 'seeds', which the grid itself decides"),
    ((Variant("bad", {"segments": 9}),),
     r"variant bad \(segments=9\) gives an invalid training configuration: "
     r"TrainConfig.segments must be an integer in 2..8"),
    ((Variant("bad", {"ltm_graph": "sideways"}),), "TrainConfig.ltm_graph must be one of"),
    ((Variant("bad", {"lr": "fast"}),), "TrainConfig.lr must be a number"),
    ((Variant("T2", {"lr": 0.1}), Variant("t2", {"lr": 0.2})), r"listed twice .*\['T2', 't2'\]"),
    ((), "variant list is empty"),
    (("T2",), r"variants must be Variant\(name, overrides\)"),
])
def test_bad_variants_fail_with_a_clear_message_before_any_compute(variants, message):
    from pmnet.conditions import ALL_CONDITIONS

    cfg = TrainConfig.from_name("debug")
    sp = tiny(cfg).derive(variants=variants)
    with pytest.raises(SpaceError, match=message):
        sp.validate(ALL_CONDITIONS, cfg)


@pytest.mark.parametrize("args, message", [
    (("T4-s3", {}), "would read as a seed"),
    (("4T", {}), "starting with a letter"),
    (("", {"lr": 0.1}), "the default variant .* cannot set fields"),
    (("v", {"lr": [0.1]}), "lr must be a single JSON value"),
    (("v", {"lr": float("nan")}), "lr must be a single JSON value"),
    (("v", {1: 0.1}), "must be a string"),
    (("v", 3), "overrides must be a mapping"),
])
def test_bad_variant_records_are_refused_when_built(args, message):
    with pytest.raises(SpaceError, match=message):
        Variant(*args)


def test_the_pipeline_builds_the_segments_grid_and_refuses_set_fields_its_variants_set():
    from pipelines.layout import PipelineError
    from pipelines.plan import build_space

    cfg = TrainConfig.from_name("debug")
    sp = build_space(cfg, grid="segments", variants="T2-full,T8-truncated", seeds="42")
    assert sp.variant_names == ["T2-full", "T8-truncated"] and sp.n_trials == 2
    with pytest.raises(PipelineError, match="--set segments: grid 'segments' sets this field"):
        build_space(cfg, grid="segments", overrides={"segments": 4})
    # a --set that makes one variant's configuration invalid is refused before any compute
    bad = TrainConfig.from_name("debug", detach_ltm=True)
    with pytest.raises(SpaceError, match="variant T2-truncated .* cannot be combined"):
        build_space(bad, grid="segments")
    assert build_space(bad, grid="segments", variants="T2-full,T4-full").n_trials == 4


def test_cpu_default_grid_nests_both_arms_and_seeds_under_three_phase1_checkpoints():
    """Issue 21: the `cpu` preset's own grid has the checkpoint as its unit (K >= 3, both
    Consolidator-only arms x the seeds under each); the paper's keeps its one checkpoint."""
    cfg = TrainConfig.from_name("cpu")
    sp = default(cfg)
    assert len(sp.phase1_seeds) >= 3 and sp.phase1_seeds == cfg.phase1_seeds
    assert set(sp.conditions) == {"consolidator_only", "consolidator_only_routing_off"}
    assert sp.n_trials == len(sp.phase1_seeds) * 2 * len(cfg.seeds) == len(sp.trials)
    cells = {(t.phase1_seed, t.condition, t.seed) for t in sp.trials}
    assert cells == {(k, c, s) for k in cfg.phase1_seeds for c in sp.conditions
                     for s in cfg.seeds}  # both arms paired by seed within each checkpoint
    paper = default(TrainConfig.from_name("paper"))
    assert paper.phase1_seeds == () and paper.phase1_keys == [None]


def test_phase1_variance_grid_nests_the_presets_grid_under_each_phase1_seed():
    from ray.tune.search.variant_generator import generate_variants

    from tune_spaces import phase1_variance
    from tune_spaces.grids import PHASE1_VARIANCE_SEEDS

    cfg = dataclasses.replace(TrainConfig.from_name("cpu"), phase1_seeds=())  # the paper's K=1
    base, sp = default(cfg), phase1_variance(cfg)
    assert sp.phase1_seeds == PHASE1_VARIANCE_SEEDS and len(PHASE1_VARIANCE_SEEDS) >= 2
    assert (sp.conditions, sp.seeds) == (base.conditions, base.seeds)
    assert sp.n_trials == base.n_trials * len(PHASE1_VARIANCE_SEEDS) == len(sp.trials)
    assert sp.size == (f"2 conditions x {len(cfg.seeds)} seeds x {len(PHASE1_VARIANCE_SEEDS)} "
                       f"Phase-1 checkpoints = {sp.n_trials} trials")
    assert {t.phase1_seed for t in sp.trials} == set(PHASE1_VARIANCE_SEEDS)
    assert len({t.name for t in sp.trials}) == sp.n_trials  # every trial its own directory
    assert sp.trials[0].name == "consolidator_only-p0-s42"
    got = [TrialId.from_config(c) for _, c in generate_variants(sp.param_space())]
    assert got == sp.trials  # Tune expands the grid in the order `trials` says
    assert Space.from_dict(json.loads(json.dumps(sp.to_dict()))) == sp
    old = base.to_dict()
    del old["phase1_seeds"]  # a pipeline.json written before Phase-1 seeds existed
    assert Space.from_dict(old) == base and base.phase1_keys == [None]
    assert all(t.phase1_seed is None for t in base.trials)


def test_the_pipeline_nests_any_grid_with_phase1_seeds_and_refuses_a_single_phase1_seed(
        tmp_path):
    from pipelines import plan as planning
    from pipelines.layout import PipelineError
    from pipelines.phase1 import phase1_config_hash

    plan = planning.plan_new(root=tmp_path / "runs", name="p", preset="debug", grid="tiny",
                             phase1_seeds="1,2")
    assert plan.space.phase1_seeds == (1, 2)
    slots = plan.phase1_slots
    assert [s.seed for s in slots] == [1, 2] and [s.cfg.phase1_seed for s in slots] == [1, 2]
    assert [s.dir.name for s in slots] == ["phase1-p1s1", "phase1-p1s2"]
    assert phase1_config_hash(slots[0].cfg) != phase1_config_hash(slots[1].cfg)
    with pytest.raises(PipelineError, match="--set phase1_seed: grid 'tiny' trains one"):
        planning.plan_new(root=tmp_path / "runs", name="q", preset="debug", grid="tiny",
                          phase1_seeds="1,2", overrides={"phase1_seed": 3})
    assert not (tmp_path / "runs" / "q").exists()


def test_seeds_beyond_numpys_range_are_refused():
    from pmnet.conditions import MAX_SEED

    cfg = TrainConfig.from_name("debug")
    base = default(cfg)
    base.derive(seeds=(MAX_SEED,)).validate(ALL_CONDITIONS, cfg)
    with pytest.raises(SpaceError, match="seed 4294967296 is outside"):
        base.derive(seeds=(42, MAX_SEED + 1)).validate(ALL_CONDITIONS, cfg)
    with pytest.raises(SpaceError, match="Phase-1 seed 4294967296 is outside"):
        base.derive(phase1_seeds=(0, MAX_SEED + 1)).validate(ALL_CONDITIONS, cfg)


def test_a_preset_that_names_phase1_seeds_nests_its_grids_under_them():
    cfg = TrainConfig.from_name("debug", phase1_seeds=(0, 1, 2))
    for grid in ("default", "paper", "tiny"):
        sp = get_space(grid)(cfg)
        assert sp.phase1_seeds == (0, 1, 2), grid
        assert sorted({t.phase1_seed for t in sp.trials}) == [0, 1, 2]
        assert sp.n_trials == 3 * len(sp.conditions) * len(sp.seeds)
    plain = TrainConfig.from_name("debug")
    assert plain.phase1_seeds == () and default(plain).phase1_keys == [None]
    assert TrainConfig.from_name("paper").phase1_seeds == ()  # the paper's one checkpoint


@pytest.mark.parametrize("bad", [(0, 0), (-1,), (True,), ("a",)])
def test_phase1_seeds_of_a_preset_are_checked(bad):
    with pytest.raises(ValueError, match="phase1_seeds"):
        TrainConfig.from_name("debug", phase1_seeds=bad)


def test_baselines_grid_pairs_every_baseline_with_both_references_under_one_checkpoint():
    from pmnet.conditions import BASELINE_CONDITIONS, BASELINE_REFERENCES
    from tune_spaces.grids import BASELINE_MIN_SEEDS

    cfg = TrainConfig.from_name("cpu")  # two seeds and three Phase-1 checkpoints by default
    sp = get_space("baselines")(cfg).validate(ALL_CONDITIONS, cfg)
    assert sp.conditions == (*BASELINE_REFERENCES, *BASELINE_CONDITIONS)
    assert sp.seeds[:2] == tuple(cfg.seeds) and len(sp.seeds) == BASELINE_MIN_SEEDS
    assert sp.phase1_seeds == ()  # one checkpoint: the baselines against the Consolidator
    assert len(sp.trials) == len(sp.conditions) * BASELINE_MIN_SEEDS
    paper = TrainConfig.from_name("paper")
    assert get_space("baselines")(paper).seeds == tuple(paper.seeds)  # five: kept


def test_checkpoints_grid_is_both_consolidator_arms_under_ten_checkpoints():
    """Issue 39: both Consolidator-only arms x two Phase-2 seeds x K = 10 Phase-1
    checkpoints, paired by seed within each checkpoint, at every preset."""
    from tune_spaces import CHECKPOINT_STUDY_SEEDS, checkpoints

    assert CHECKPOINT_STUDY_SEEDS == tuple(range(10))
    for preset in ("cpu", "paper", "debug"):
        cfg = TrainConfig.from_name(preset)
        sp = checkpoints(cfg)
        assert sp.name == "checkpoints"
        assert sp.conditions == ("consolidator_only", "consolidator_only_routing_off")
        assert sp.seeds == tuple(cfg.seeds)[:2] and sp.phase1_seeds == CHECKPOINT_STUDY_SEEDS
        assert sp.n_trials == 2 * 2 * 10 == len(sp.trials)
        assert {(t.phase1_seed, t.seed) for t in sp.trials if t.condition == sp.conditions[0]} \
            == {(t.phase1_seed, t.seed) for t in sp.trials if t.condition == sp.conditions[1]}
    assert get_space("checkpoints") is checkpoints


def test_checkpoint_channel_grid_is_every_routing_pair_under_five_checkpoints():
    """Issue 39, "can anything use the channel?": each arm with a routing-off twin, on and
    off, and the strict-off twins, x two Phase-2 seeds x the first 5 of the study's
    checkpoints, paired by seed."""
    from pmnet.conditions import ROUTING_PAIRS, STRICT_PAIRS
    from tune_spaces import CHECKPOINT_CHANNEL_SEEDS, CHECKPOINT_STUDY_SEEDS, checkpoint_channel

    assert CHECKPOINT_CHANNEL_SEEDS == CHECKPOINT_STUDY_SEEDS[:5] == (0, 1, 2, 3, 4)
    for preset in ("cpu", "paper", "debug"):
        cfg = TrainConfig.from_name(preset)
        sp = checkpoint_channel(cfg)
        assert sp.name == "checkpoint_channel"
        assert sp.conditions[:2] == ("consolidator_only", "consolidator_only_routing_off")
        assert set(sp.conditions) == ({c for pair in ROUTING_PAIRS.items() for c in pair}
                                      | set(STRICT_PAIRS.values()))
        assert sp.n_trials == 8 * 2 * 5 == len(sp.trials)
        for on, off in (*ROUTING_PAIRS.items(), *STRICT_PAIRS.items()):
            assert {(t.phase1_seed, t.seed) for t in sp.trials if t.condition == on} \
                == {(t.phase1_seed, t.seed) for t in sp.trials if t.condition == off}
    assert get_space("checkpoint_channel") is checkpoint_channel


def test_the_add10_long_grid_is_both_consolidator_arms_in_one_valid_long_variant():
    from pmnet.train import TrainConfig
    from tune_spaces.grids import ADD10_LONG_RECIPE, add10_long

    cfg = TrainConfig.from_name("cpu")
    space = add10_long(cfg)
    assert space.conditions == ("consolidator_only", "consolidator_only_routing_off")
    assert space.seeds == (42,) and space.variant_names == ["add10-long"]
    assert set(space.diagnose) == set(space.conditions)
    import dataclasses

    trial_cfg = dataclasses.replace(cfg, **dict(space.variant("add10-long").overrides))
    assert trial_cfg.phase2_families == ("add10",)
    assert trial_cfg.select_metric("updated_ltm") == "updated_ltm_add10"
    # 640,000 episodes at most, validated every 500 steps of the preset's batch
    assert trial_cfg.episodes_per_epoch * trial_cfg.max_epochs == 640_000
    assert trial_cfg.steps_per_epoch == 500 and ADD10_LONG_RECIPE["patience"] == 6


def test_the_both_long_grid_is_add10_longs_recipe_on_both_families_routing_on_only():
    """Claim 4 of docs/preregistration.md: the decisive test's recipe, both rule families,
    the Consolidator alone with routing on; its units differ from add10_long's by name, so
    both grids fill one store."""
    import dataclasses

    from pmnet import task
    from pmnet.train import TrainConfig
    from tune_spaces.grids import ADD10_LONG_RECIPE, add10_long, both_long

    cfg = TrainConfig.from_name("medium")
    space = both_long(cfg)
    assert space.conditions == ("consolidator_only",) and space.seeds == (42,)
    assert space.variant_names == ["both-long"] and space.diagnose == space.conditions
    trial_cfg = dataclasses.replace(cfg, **dict(space.variant("both-long").overrides))
    assert trial_cfg.phase2_families == task.FAMILIES
    assert trial_cfg.select_metric("updated_ltm") == "updated_ltm"
    long_cfg = dataclasses.replace(cfg, **dict(add10_long(cfg).variant("add10-long").overrides))
    for key in set(ADD10_LONG_RECIPE) - {"phase2_families"}:
        assert getattr(trial_cfg, key) == getattr(long_cfg, key), key
    assert not {t.name for t in space.trials} & {t.name for t in add10_long(cfg).trials}


def test_the_confirmatory_grids_hold_back_a_checkpoint_below_the_preregistered_phase1_bar():
    """docs/preregistration.md: a confirmatory checkpoint needs validation ADD10 STM >= 99% at
    its selected epoch; `add10_long` and `both_long` carry that bar as their Phase-1 gate, and
    the gate reads the selected epoch's row, not the last one."""
    from pmnet.train import TrainConfig
    from tune_spaces.grids import CONFIRMATORY_PHASE1_GATE, Phase1Gate, add10_long, both_long

    cfg = TrainConfig.from_name("medium")
    for space in (add10_long(cfg), both_long(cfg)):
        assert space.phase1_gate == Phase1Gate("val/mean_stm_add10", 99.0)
    assert default(cfg).phase1_gate is None
    metrics = {"best_epoch": 1, "history": [
        {"epoch": 0, "val/mean_stm_add10": 50.0}, {"epoch": 1, "val/mean_stm_add10": 99.5},
        {"epoch": 2, "val/mean_stm_add10": 98.0}]}
    assert CONFIRMATORY_PHASE1_GATE.reading(metrics) == 99.5
    assert "98.00 < 99" in CONFIRMATORY_PHASE1_GATE.describe(98.0)


def test_a_phase1_gate_round_trips_and_a_bad_one_is_refused():
    import json

    import pytest

    from pmnet.train import ALL_CONDITIONS, TrainConfig
    from tune_spaces import SpaceError
    from tune_spaces.grids import Phase1Gate, add10_long

    cfg = TrainConfig.from_name("cpu")
    space = add10_long(cfg).derive(phase1_seeds=(3, 4))
    back = type(space).from_dict(json.loads(json.dumps(space.to_dict())))
    assert back == space and back.phase1_gate == space.phase1_gate
    ungated = space.derive(phase1_gate=None)
    assert "phase1_gate" not in ungated.to_dict()  # as a run recorded before gates existed
    assert type(space).from_dict(ungated.to_dict()) == ungated
    with pytest.raises(SpaceError, match="phase1_gate must be"):
        type(space).from_dict({**space.to_dict(), "phase1_gate": {"metric": "val/x"}})
    for bad, message in ((Phase1Gate("train/loss", 1.0), "phase1_gate must be a Phase1Gate"),
                         (("val/mean_stm", 99.0), "phase1_gate must be a Phase1Gate"),
                         (Phase1Gate("val/mean_stm", float("nan")),
                          "the Phase-1 gate must be a finite number")):
        with pytest.raises(SpaceError, match=message):
            space.derive(phase1_gate=bad).validate(ALL_CONDITIONS, cfg)
