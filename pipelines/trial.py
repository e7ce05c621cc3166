"""One Stage-2 trial (condition x seed) as a Ray Tune function trainable.

The trial
1. verifies the shared Phase-1 checkpoint (its sha256 sidecar and the hash the driver
   recorded in Stage 1) before anything else, and refuses it with a clear error otherwise;
2. re-attaches to (or creates) its MLflow run, found by the tag `trial_key`;
3. trains with `pmnet.train.run_phase2`, continuing from `tune.get_checkpoint()` after a
   crash or a resume; a Lightning callback saves a checkpoint at every epoch end and sends
   it with the epoch's metrics through `tune.report(metrics, checkpoint=...)`;
4. copies result.json to `<run>/results/<condition>-s<seed>.json` and logs it to MLflow.

A trial whose result file already exists (finished before the driver died, so Tune did not
record it) is not trained again: it reports the stored result and ends.

Test hook: PMNET_TEST_FAULT_ONCE=<dir> makes each trial raise once, right after its first
reported epoch, unless `<dir>/<condition>-s<seed>` exists (the trial creates it first).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import socket
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from pipelines.layout import Layout, check_name, read_json, trial_key, trial_name, write_json
from pmnet.io import atomic_copy

FAULT_ENV = "PMNET_TEST_FAULT_ONCE"
SMALL_PRESETS = ("debug", "cpu")  # their selected checkpoint goes into MLflow as an artifact

log = logging.getLogger("pipelines.trial")


@dataclass(frozen=True)
class TrialContext:
    """What the driver hands every Stage-2 trial (pickled once by `tune.with_parameters`).

    root, name: the pipeline's storage root and name (`Layout(root, name)`).
    train_config: `TrainConfig.to_dict()` of the pipeline (read back with `from_dict`).
    phase1_sha256: the hash Stage 1 recorded; the trial refuses any other checkpoint.
    cpus_per_trial: the trial's CPU reservation, also its torch thread count.
    tracking_uri, experiment_id, parent_run_id: MLflow, or all None when tracking is off.
    """

    root: str
    name: str
    train_config: dict
    phase1_sha256: str
    cpus_per_trial: float = 1.0
    tracking_uri: str | None = None
    experiment_id: str | None = None
    parent_run_id: str | None = None

    def __post_init__(self):
        check_name(self.name)
        if not Path(self.root).is_absolute():
            raise ValueError(f"TrialContext.root must be absolute, got {self.root!r}")
        if not isinstance(self.train_config, dict) or "preset" not in self.train_config:
            raise ValueError("TrialContext.train_config must be a TrainConfig.to_dict()")
        if not (isinstance(self.phase1_sha256, str) and len(self.phase1_sha256) == 64):
            raise ValueError(f"TrialContext.phase1_sha256 must be a sha256 hex digest, got "
                             f"{self.phase1_sha256!r}")
        if self.cpus_per_trial <= 0:
            raise ValueError(f"TrialContext.cpus_per_trial must be > 0, got {self.cpus_per_trial}")
        if bool(self.tracking_uri) != bool(self.experiment_id):
            raise ValueError("TrialContext: tracking_uri and experiment_id go together")

    @property
    def layout(self) -> Layout:
        return Layout(self.root, self.name)

    @property
    def threads(self) -> int:
        return max(1, int(self.cpus_per_trial))

    @property
    def tracking(self) -> bool:
        return bool(self.tracking_uri and self.experiment_id)


class Phase1Refused(RuntimeError):
    """The Phase-1 checkpoint is missing, tampered with, or not the one Stage 1 produced."""


def quiet_training_logs() -> None:
    """Keep Lightning's banner lines and tips out of the trial logs."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", category=UserWarning, message=".*number of training batches")


def check_phase1(path: str | os.PathLike, expected_sha256: str | None) -> str:
    """verify_phase1 plus the hash recorded by Stage 1; Phase1Refused with the reason."""
    from pmnet.train import verify_phase1

    try:
        digest = verify_phase1(path)
    except ValueError as e:
        raise Phase1Refused(f"refusing the Phase-1 checkpoint: {e}") from e
    if expected_sha256 and digest != expected_sha256:
        raise Phase1Refused(
            f"refusing the Phase-1 checkpoint {path}: its sha256 {digest[:12]}... is not the "
            f"{expected_sha256[:12]}... that Stage 1 recorded for this pipeline")
    return digest


def _fault_marker(condition: str, seed: int) -> Path | None:
    root = os.environ.get(FAULT_ENV)
    return Path(root) / trial_name(condition, seed) if root else None


def _scalar_metrics(metrics: dict) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        try:
            out[k] = float(v.item() if hasattr(v, "item") else v)
        except (TypeError, ValueError):
            continue
    return out


def make_report_callback(*, trial_dir: Path, condition: str, seed: int, select: str,
                         tracker, run_id: str | None, skip_steps: set[int],
                         resume_final: bool = False):
    """The Lightning callback that reports each epoch to Tune (and MLflow)."""
    from lightning.pytorch.callbacks import Checkpoint
    from ray import tune

    class TuneReport(Checkpoint):
        """At each epoch end: save a full Lightning checkpoint, `tune.report` the epoch's
        metrics with it, and log the metrics to the trial's MLflow run at step=epoch.

        It is a `Checkpoint` callback placed last, so Lightning calls it after EarlyStopping
        and ModelCheckpoint have updated their state for the epoch (both act at train epoch
        end when validation runs every epoch): the saved state is the one an uninterrupted
        run carries into the next epoch, so a resumed trial selects the same checkpoint.
        """

        def __init__(self):
            self.best = float("-inf")

        def setup(self, trainer, pl_module, stage):
            cbs = trainer.callbacks
            if self in cbs:
                cbs.remove(self)
                cbs.append(self)

        def state_dict(self):
            return {"best": self.best}

        def load_state_dict(self, state_dict):
            self.best = float(state_dict.get("best", self.best))

        def on_train_start(self, trainer, pl_module):
            if resume_final:  # the last epoch was already reported: go straight to testing
                trainer.should_stop = True

        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.sanity_checking:
                return
            epoch = int(trainer.current_epoch)
            metrics = _scalar_metrics(trainer.callback_metrics)
            metrics = {k: v for k, v in metrics.items() if not k.startswith("test/")}
            sel = metrics.get(f"val/{select}")
            if sel is not None and sel > self.best:
                self.best = sel
            metrics["epoch"] = epoch
            if self.best > float("-inf"):
                metrics["best/select"] = self.best
            if tracker is not None and run_id is not None and epoch not in skip_steps:
                try:
                    tracker.log_metrics(run_id, metrics, step=epoch)
                except Exception as e:  # tracking trouble must not kill training
                    log.warning("MLflow metric logging failed at epoch %d: %s", epoch, e)
            final = bool(trainer.should_stop) or epoch + 1 >= int(trainer.max_epochs or 0)
            base = Path(trial_dir) / ".tune_ckpt"
            base.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=base) as tmp:
                trainer.save_checkpoint(str(Path(tmp) / "checkpoint.ckpt"))
                write_json(Path(tmp) / "meta.json", {"epoch": epoch, "final": final,
                                                     "condition": condition, "seed": seed})
                tune.report({**metrics, "condition": condition, "seed": seed},
                            checkpoint=tune.Checkpoint.from_directory(tmp))
            marker = _fault_marker(condition, seed)
            if marker is not None and not marker.exists():
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(f"fault injected after epoch {epoch}\n")
                raise RuntimeError(f"{FAULT_ENV}: injected fault after epoch {epoch} "
                                   f"of {trial_name(condition, seed)}")

    return TuneReport()


def copy_atomic(src: Path, dst: Path) -> Path:
    """Byte-identical copy that appears at `dst` in one step."""
    return atomic_copy(src, dst)


def _append_attempt(trial_dir: Path, record: dict) -> None:
    trial_dir.mkdir(parents=True, exist_ok=True)
    with open(trial_dir / "attempts.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def _result_matches(path: Path, digest: str, cfg) -> dict | None:
    res = read_json(path)
    if not isinstance(res, dict):
        return None
    if res.get("phase1_sha256") != digest or res.get("preset") != cfg.preset:
        return None
    return res


def train_trial(config: dict, ctx: TrialContext) -> None:
    """The Tune trainable. `config`: {"condition", "seed"}; `ctx`: set by the driver."""
    t_enter = time.time()
    from ray import tune

    quiet_training_logs()
    from pipelines.tracking import Tracker
    from pmnet.train import TrainConfig, get_condition

    t_imported = time.time()

    condition, seed = str(config["condition"]), int(config["seed"])
    layout = ctx.layout
    tdir = layout.trial_dir(condition, seed)
    cfg = TrainConfig.from_dict(ctx.train_config)
    if not cfg.threads:
        cfg = dataclasses.replace(cfg, threads=ctx.threads)
    cond = get_condition(condition)
    key = trial_key(layout.name, condition, seed)

    trial_info = {"condition": condition, "seed": seed, "trial_key": key,
                  "tracking_uri": ctx.tracking_uri}
    result_path = layout.result_path(condition, seed)
    tracker = run_id = None
    try:
        # 1. the Phase-1 checkpoint, before anything else
        digest = check_phase1(layout.phase1_ckpt, ctx.phase1_sha256)

        # 2. MLflow: one run per trial, re-attached on retries and resumes
        skip_steps: set[int] = set()
        if ctx.tracking:
            tracker = Tracker(ctx.tracking_uri)
            known = read_json(tdir / "trial.json", {}) or {}
            run_id, created = tracker.attach_run(
                ctx.experiment_id, key, run_name=trial_name(condition, seed),
                parent_run_id=ctx.parent_run_id, run_id=known.get("mlflow_run_id"),
                tags={"trial_key": key, "pipeline": layout.name, "stage": "phase2",
                      "condition": condition, "seed": seed, "phase1_sha256": digest,
                      "preset": cfg.preset, "select_metric": cond.select})
            trial_info["mlflow_run_id"] = run_id
            tracker.log_params_once(run_id, {**cfg.flat(), "condition": condition,
                                             "seed": seed})
            if not created:
                skip_steps = tracker.logged_steps(run_id, "epoch")
        setup = {"imports_s": t_imported - t_enter, "setup_s": time.time() - t_enter}
        write_json(tdir / "trial.json", {**(read_json(tdir / "trial.json", {}) or {}),
                                         **trial_info, "state": "RUNNING"})

        # 3. + 4. train (or reuse a finished result) and record
        final = _train_and_record(layout, cfg, cond, condition, seed, digest, tracker,
                                  run_id, skip_steps, result_path, setup)
    except BaseException as e:
        write_json(tdir / "trial.json", {**(read_json(tdir / "trial.json", {}) or {}),
                                         **trial_info, "state": "ERROR",
                                         "error": f"{type(e).__name__}: {e}"[:2000]})
        if tracker is not None and run_id is not None:
            try:
                tracker.set_tags(run_id, {"last_error": f"{type(e).__name__}: {e}"[:5000]})
                tracker.finish(run_id, "FAILED")
            except Exception as e2:  # keep the original error
                log.warning("could not mark MLflow run %s failed: %s", run_id, e2)
        raise
    write_json(tdir / "trial.json", {**(read_json(tdir / "trial.json", {}) or {}),
                                     **trial_info, "state": "FINISHED",
                                     "result": str(result_path)})
    shutil.rmtree(tdir / ".tune_ckpt", ignore_errors=True)
    tune.report({k: (float("nan") if v is None else v) for k, v in final.items()}
                | {"condition": condition, "seed": seed})


def _train_and_record(layout, cfg, cond, condition, seed, digest, tracker, run_id,
                      skip_steps, result_path, setup) -> dict:
    from ray import tune

    from pmnet.train import run_phase2

    tdir = layout.trial_dir(condition, seed)
    # 3. already finished (driver died before Tune recorded it)? then report, don't retrain
    done = _result_matches(result_path, digest, cfg)
    ckpt = tune.get_checkpoint()
    attempt = {"time": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
               "node_id": _node_id(),
               "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
               "resume_from": None, "kind": "reuse" if done else "train", **setup}
    if done is None:
        with (ckpt.as_directory() if ckpt else _nulldir()) as ckdir:
            resume_from, meta = None, {}
            if ckdir is not None and (Path(ckdir) / "checkpoint.ckpt").is_file():
                resume_from = str(Path(ckdir) / "checkpoint.ckpt")
                meta = read_json(Path(ckdir) / "meta.json", {}) or {}
                attempt["resume_from"] = resume_from
                attempt["resume_epoch"] = meta.get("epoch")
            _append_attempt(tdir, attempt)
            cb = make_report_callback(trial_dir=tdir, condition=condition, seed=seed,
                                      select=cond.select, tracker=tracker, run_id=run_id,
                                      skip_steps=skip_steps,
                                      resume_final=bool(meta.get("final")))
            result = run_phase2(cfg, condition=condition, seed=seed,
                                phase1_ckpt=layout.phase1_ckpt, out_dir=tdir, callbacks=[cb],
                                resume_from=resume_from, progress=False)
        copy_atomic(tdir / "result.json", result_path)
    else:
        _append_attempt(tdir, attempt)
        result = done

    # 4. the result into MLflow, the final metrics into Tune
    test = {f"test/{k}": v for k, v in (result.get("test") or {}).items()
            if isinstance(v, (int, float))}
    val_sel = (result.get("val") or {}).get(cond.select)
    final = {"test/updated_ltm": test.get("test/updated_ltm"),
             "best/select": val_sel, "train_time_s": result.get("train_time_s"),
             "best_epoch": result.get("best_epoch"), "finished": 1}
    if tracker is not None:
        tracker.log_metrics(run_id, {**test, "train_time_s": result.get("train_time_s") or 0,
                                     "trainable_params": result.get("trainable_params") or 0},
                            step=int(result.get("best_epoch") or 0))
        tracker.log_artifact(run_id, result_path, "result")
        best_model = result.get("best_model")
        if best_model and Path(best_model).is_file():
            if cfg.preset in SMALL_PRESETS:
                tracker.log_artifact(run_id, best_model, "checkpoint")
            tracker.set_tags(run_id, {"best_model_path": best_model})
        tracker.finish(run_id, "FINISHED")
    return final


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:
        return None


class _nulldir:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def trial_dirname(trial) -> str:
    """Tune trial directory name: `<condition>-s<seed>` (module level: picklable)."""
    return trial_name(trial.config["condition"], trial.config["seed"])


def trial_str(trial) -> str:
    return trial_name(trial.config["condition"], trial.config["seed"])

