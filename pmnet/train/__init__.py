"""Training for every phase with Lightning (Sections 4.4, 5.2, 6; Appendix "Hyperparameters").

Phase 0 (optional warm start): PMNet's copy-paste task; the paper starts from "a PMNet
    copy-task checkpoint" that cannot be downloaded, so we train our own when a preset asks.
Phase 1 (STM pretraining): same-segment rule induction from routed STM: process the
    demonstrations, clear the KV cache, answer the held-out query; the Consolidator is frozen.
    Output: one checkpoint `phase1.pt` (weights-only loadable) with its sha256 beside it.
Phase 2 (consolidation training): the two-segment protocol from that checkpoint, for one of
    the conditions of Table "Parameter-isolation conditions" (`CONDITIONS`) or one of the
    consolidation-operator conditions beyond the paper (`OPERATOR_CONDITIONS`: the operator
    is created fresh at its identity start, `init_operator`, and trained alone); `segments`
    > 2 trains on memory episodes of that many segments, and `ltm_graph` chooses full or
    truncated backpropagation through the boundaries (issue 11; docs/choices.md).

One LightningModule per phase wraps the plain `PMNet`; the loop, clipping, precision,
checkpointing and early stopping are Lightning's. Metrics are named `train/...`,
`val/...`, `test/...`.

Where each part lives:
    config.py          TrainConfig, built from a preset of `pmnet.config.PRESETS`, and
                       `--set` overrides
    data.py            the episode streams as Lightning data (`EpisodeData`, `CopyBatches`)
    compiled_steps.py  `compile_step` (torch.compile, CUDA graphs), the shared compile cache
    modules.py         the LightningModules: `Phase0Module`, `Phase1Module`, `Phase2Module`
    checkpoints.py     Lightning's best / last checkpoints, written atomically
    pause.py           stopping Phase 1 at an epoch boundary (deadline, SIGTERM)
    watchdog.py        stopping a phase that is not learning (`NotLearningError`, issue 62)
    phases.py          `run_phase0` (with copy_probe.py), `run_phase1`, `run_phase2`,
                       `warm_compile` and the trainer they share

Choices the paper leaves open (see docs/choices.md):
- weight decay applies to matrices and embeddings (dim >= 2), not to biases, norms, the
  Consolidator's unit-phasor bias; the slot embeddings (3-D) are decayed like embeddings;
- the cosine decay runs to zero over the maximum budget (max_epochs x steps per epoch);
- Phase 1 uses segment 1 of each generated episode; its training stream is the task's
  train stream at seed `phase1_seed + 1_000_000`, distinct from every Phase-2 seed;
- frozen parameters keep requires_grad=False, are left out of the optimiser, and their
  modules stay in train mode (attention dropout is not switched off by freezing).
"""

from pmnet.conditions import (
    ALL_CONDITIONS,
    CONDITIONS,
    OPERATOR_CONDITIONS,
    PAPER_SEEDS,
    Condition,
    get_condition,
    seed_problem,
)
from pmnet.gpu.cap import GpuMemoryCap, memory_cap_bytes, memory_cap_fraction
from pmnet.model import PMNet
from pmnet.model_files import (
    MODEL_FORMAT,
    PHASE1_FORMAT,
    load_model_file,
    save_model_file,
    sha256_file,
    verify_phase1,
    write_sha256,
)
from pmnet.operators import OPERATORS
from pmnet.train.checkpoints import (
    AtomicCheckpointIO,
    LastCheckpoint,
    checkpoint_epoch,
    checkpoint_origin,
)
from pmnet.train.compiled_steps import (
    compile_step,
    fresh_compile_state,
    release_compiled_steps,
    use_compile_cache,
)
from pmnet.train.config import (
    ACCELERATORS,
    COMPILE_STEPS,
    LIST_FIELDS,
    PRECISIONS,
    TrainConfig,
    parse_overrides,
)
from pmnet.train.data import CopyBatches, EpisodeData, EpochBatches
from pmnet.train.modules import (
    VAL_LOGGED,
    Phase0Module,
    Phase1Module,
    Phase2Module,
    freeze_to_subset,
)
from pmnet.train.pause import Phase1Paused, PhasePaused, StopAtEpochEnd
from pmnet.train.phases import (
    RESULT_KEYS,
    ROUTES_FILE,
    device_name,
    evaluation_inference_mode,
    init_baseline,
    init_consolidator,
    init_operator,
    init_phase2,
    phase1_route_diagnostics,
    run_phase0,
    run_phase1,
    run_phase2,
    trained_on,
    warm_compile,
)
from pmnet.train.watchdog import (
    NOT_LEARNING_EXIT,
    NotLearning,
    NotLearningError,
    not_learning,
)

__all__ = [
    # the conditions and the model, as training uses them
    "ALL_CONDITIONS", "CONDITIONS", "OPERATOR_CONDITIONS", "PAPER_SEEDS", "Condition",
    "get_condition", "seed_problem", "OPERATORS", "PMNet",
    # config.py
    "ACCELERATORS", "COMPILE_STEPS", "LIST_FIELDS", "PRECISIONS", "TrainConfig",
    "parse_overrides",
    # data.py, compiled_steps.py, modules.py
    "CopyBatches", "EpisodeData", "EpochBatches", "compile_step", "use_compile_cache",
    "fresh_compile_state", "release_compiled_steps",
    # pmnet/gpu/cap.py (issue 36; re-exported here)
    "GpuMemoryCap", "memory_cap_bytes", "memory_cap_fraction",
    "VAL_LOGGED", "Phase0Module", "Phase1Module", "Phase2Module", "freeze_to_subset",
    # pmnet/model_files.py (re-exported here), checkpoints.py
    "MODEL_FORMAT", "PHASE1_FORMAT", "load_model_file", "save_model_file", "sha256_file",
    "verify_phase1", "write_sha256", "AtomicCheckpointIO", "LastCheckpoint", "checkpoint_epoch",
    "checkpoint_origin",
    # pause.py (issue 52: a Phase 1 in pieces)
    "Phase1Paused", "PhasePaused", "StopAtEpochEnd",
    # watchdog.py (issue 62: a phase that is not learning stops)
    "NOT_LEARNING_EXIT", "NotLearning", "NotLearningError", "not_learning",
    # phases.py
    "RESULT_KEYS", "ROUTES_FILE", "device_name", "evaluation_inference_mode",
    "init_consolidator", "init_operator",
    "init_baseline", "init_phase2",
    "phase1_route_diagnostics", "run_phase0", "run_phase1", "run_phase2", "trained_on",
    "warm_compile",
]
