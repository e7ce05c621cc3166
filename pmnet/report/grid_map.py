"""Which grids run each condition in the default variant (what the paper's tables
read), for the report's notes on what did not run (issue 35).

Generated from the grids (`tune_spaces.grids.report_grid_map`: each grid of `SPACES`
read at the paper preset; `default`, the preset's own grid, left out) by
`python -m tune_spaces.grid_map`; `pmnet` may not import `tune_spaces`, and
`test_the_report_grid_map_is_the_grids_own` fails when this copy is stale.
"""

GRIDS_RUNNING: dict[str, tuple[str, ...]] = {
    "learned_full": ("paper", "tiny", "core", "phase1_variance"),
    "identity_full": ("paper", "core", "phase1_variance"),
    "consolidator_only": (
        "paper",
        "tiny",
        "core",
        "operators",
        "phase1_variance",
        "baselines",
        "checkpoints",
        "checkpoint_channel",
        "ladder",
    ),
    "consolidator_only_routing_off": (
        "paper",
        "core",
        "phase1_variance",
        "checkpoints",
        "checkpoint_channel",
        "ladder",
    ),
    "memory_consolidator": ("paper", "core", "phase1_variance", "checkpoint_channel", "ladder"),
    "learned_full_dual": ("paper", "phase1_variance"),
    "operator_ema": ("operators",),
    "operator_overwrite": ("operators",),
    "operator_linear": ("operators",),
    "operator_gru": ("operators", "baselines", "checkpoint_channel"),
    "baseline_no_reset": ("baselines",),
    "baseline_memory_tokens": ("baselines",),
    "baseline_recurrent_state": ("baselines",),
    "baseline_no_memory": ("baselines",),
    "operator_gru_routing_off": ("checkpoint_channel", "ladder"),
    "memory_consolidator_routing_off": ("checkpoint_channel",),
    "consolidator_only_strict_off": ("checkpoint_channel",),
    "memory_consolidator_strict_off": ("checkpoint_channel",),
}
