"""The LightningModules, one per phase, around the plain `PMNet`.

`_PhaseModule` holds what the phases share (optimiser groups and schedule, device transfer,
the epoch's loss, RNG and history in checkpoints, evaluation through `pmnet.evaluate`);
each phase adds its step as one function (`Phase0Module.copy_loss`, `Phase1Module.stm_loss`,
`Phase2Module.objective` = `runner.phase2_losses`), which `step_fn` runs compiled or eagerly
as `TrainConfig.compile` says. Metrics are named `train/...`, `val/...`, `test/...`.
"""

from __future__ import annotations

import dataclasses
import math
import time

import lightning as L
import torch
import torch.nn.functional as F

from pmnet import task
from pmnet.conditions import Condition
from pmnet.evaluate import copy_logits, episode_outcomes, summarize
from pmnet.model import PMNet
from pmnet.runner import phase2_losses
from pmnet.train.compiled_steps import compile_step
from pmnet.train.config import TrainConfig


def freeze_to_subset(model: PMNet, subset: str) -> list[str]:
    """requires_grad only for the named subset; returns the trainable parameter names."""
    keep = {n for n, _ in model.trainable_subset(subset)}
    for n, p in model.named_parameters():
        p.requires_grad_(n in keep)
    return sorted(keep)


class _PhaseModule(L.LightningModule):
    """Shared optimiser, schedule, device transfer, RNG and history handling."""

    def __init__(self, cfg: TrainConfig, model: PMNet, lr: float):
        super().__init__()
        self.cfg, self.model, self.lr = cfg, model, lr
        self.history: list[dict] = []
        self._val_chunks: dict[str, list] = {}
        # the epoch's training losses, summed on the device (float64, the same sum as adding
        # Python floats) and read back once per epoch: no host sync in a training step
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._steps: dict[str, object] = {}  # step functions, compiled as the config says
        self._demos = task.N_DEMOS  # Phase 1: demonstrations of the current step
        self.test_metrics: dict[str, float] = {}
        # training time across attempts: a checkpoint carries the time spent up to it, so a
        # resumed run's train_time_s adds the earlier attempts (up to their last checkpoint);
        # run_phase1/run_phase2 set attempt_start to their own start, so that time includes
        # the attempt's Phase 0 and set-up, as the train_time_s they return does
        self.prior_time_s = 0.0
        self.attempt_start = time.time()

    def elapsed_s(self) -> float:
        """Seconds of training behind the current state: earlier attempts (as recorded in
        the checkpoint this attempt resumed from) plus this attempt so far."""
        return self.prior_time_s + (time.time() - self.attempt_start)

    def configure_optimizers(self):
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if not params:
            raise ValueError("no trainable parameters")
        cfg = self.cfg
        # the Consolidator, the alternative consolidation operators and the baselines'
        # carried memories (the modules a boundary uses): their own lr / decay
        boundary = ("consolidator.", "operators.", "baselines.")
        cons = [(n, p) for n, p in params if n.startswith(boundary)]
        rest = [(n, p) for n, p in params if not n.startswith(boundary)]
        c_lr = cfg.consolidator_lr or self.lr
        c_wd = cfg.weight_decay if cfg.consolidator_weight_decay is None \
            else cfg.consolidator_weight_decay
        groups = [
            {"params": [p for _, p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for _, p in rest if p.dim() < 2], "weight_decay": 0.0},
            {"params": [p for _, p in cons if p.dim() >= 2], "weight_decay": c_wd, "lr": c_lr},
            {"params": [p for _, p in cons if p.dim() < 2], "weight_decay": 0.0, "lr": c_lr},
        ]
        opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=self.lr,
                                betas=tuple(cfg.betas))
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warm = self.cfg.warmup_steps
        constant = self.lr_schedule == "constant"

        def schedule(step: int) -> float:  # linear warmup, then cosine decay to zero
            if step < warm:
                return (step + 1) / warm
            if constant:  # the long Phase-2 recipe: early stopping ends it, not the rate
                return 1.0
            progress = min(1.0, (step - warm) / max(1, total - warm))
            return 0.5 * (1.0 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    #: this phase's name in TrainConfig.compile (COMPILE_STEPS)
    phase: str = ""
    #: the rate's shape after warmup (TrainConfig.LR_SCHEDULES); Phase 2 takes the config's
    lr_schedule: str = "cosine"

    def step_fn(self, fn, *, train: bool):
        """`fn` as the steps run it: through `torch.compile` where `TrainConfig.compile` names
        this phase's training step (`train`) or "eval" (`compile_step`), made once per module
        and function."""
        name = fn.__name__
        if name not in self._steps:
            on = (self.phase if train else "eval") in self.cfg.compile
            self._steps[name] = compile_step(fn, self.device, self.cfg) if on else fn
        return self._steps[name]

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch.to(device, non_blocking=True)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        loss = outputs["loss"].detach().double()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_count += 1

    def on_save_checkpoint(self, checkpoint):
        checkpoint["pmnet_history"] = list(self.history)
        checkpoint["pmnet_train_time_s"] = self.elapsed_s()
        checkpoint["pmnet_rng"] = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":  # the device it trains on only (not every visible GPU)
            checkpoint["pmnet_rng"]["cuda"] = torch.cuda.get_rng_state(self.device)

    def on_load_checkpoint(self, checkpoint):
        if self._trainer is not None and self.trainer.state.fn != "fit":
            return  # loading the best weights for testing keeps the full history
        self.history = list(checkpoint.get("pmnet_history", []))
        self.prior_time_s = float(checkpoint.get("pmnet_train_time_s", 0.0))
        rng = checkpoint.get("pmnet_rng", {})
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        state = rng.get("cuda")
        if isinstance(state, (list, tuple)):  # written by get_rng_state_all (one per GPU)
            state = state[0] if state else None
        if state is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)

    # evaluation: per-episode outcomes of every batch, summarised once per epoch --------
    def _outcomes(self, batch, full: bool) -> dict:
        """Per-episode outcomes of one evaluation batch (validation: full=False)."""
        raise NotImplementedError

    def on_validation_epoch_start(self):
        self._val_chunks, self._val_batches = {}, []

    on_test_epoch_start = on_validation_epoch_start

    def _collect(self, batch, full: bool) -> None:
        for key, v in self.step_fn(self._outcomes, train=False)(batch, full).items():
            self._val_chunks.setdefault(key, []).append(v.cpu())
        self._val_batches.append(batch.to("cpu"))

    def validation_step(self, batch, batch_idx):
        self._collect(batch, full=False)

    def test_step(self, batch, batch_idx):
        self._collect(batch, full=True)

    def _metrics(self) -> dict[str, float]:
        stream = _concat_batches(self._val_batches)
        return summarize({k: torch.cat(v) for k, v in self._val_chunks.items()}, stream)

    def _record_epoch(self, metrics: dict[str, float]) -> None:
        row = {"epoch": int(self.current_epoch)}
        if self._loss_count:
            row["train/loss"] = float(self._loss_sum) / self._loss_count
            self._loss_sum, self._loss_count = None, 0
        row.update(metrics)
        self.history.append(row)


class Phase0Module(_PhaseModule):
    """PMNet copy-paste warm start: the payload must cross a cleared KV cache in memory."""

    phase = "phase0"

    def __init__(self, cfg: TrainConfig, model: PMNet, lr: float):
        super().__init__(cfg, model, lr)
        self.lr_schedule = cfg.phase0_lr_schedule

    def copy_loss(self, batch):
        logits = copy_logits(self.model, batch)  # the forward copy_accuracy reads
        return F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(),
                               ignore_index=task.IGNORE_INDEX)

    def training_step(self, batch, batch_idx):
        loss = self.step_fn(self.copy_loss, train=True)(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss


class Phase1Module(_PhaseModule):
    """STM rule induction: demonstrations -> clear KV -> held-out query (Consolidator frozen)."""

    phase = "phase1"

    def demos_at(self, step: int) -> int:
        """The number of demonstrations of training step `step`: N_DEMOS, or with the
        curriculum a draw from U{1..N_DEMOS} deterministic in (Phase-1 seed, step), so a
        resumed run draws what an uninterrupted one would."""
        if not self.cfg.phase1_curriculum:
            return task.N_DEMOS
        g = torch.Generator().manual_seed(self.cfg.phase1_seed * 7919 + step)
        return int(torch.randint(1, task.N_DEMOS + 1, (1,), generator=g))

    def on_train_batch_start(self, batch, batch_idx):
        # drawn here, on the host, before the step (the step itself reads nothing back)
        self._demos = self.demos_at(self.global_step)

    def training_step(self, batch, batch_idx):
        k = self._demos
        # a copy: the batch is a slice of the epoch's tensors, and a compiled step would
        # otherwise specialise on its (varying) offset into them
        context = batch.seg_tokens[:, 0, : task.DEMO_LEN * k].clone()  # (B, 5k)
        query, target = batch.query_tokens[:, 0], batch.target[:, 0]
        step = self.step_fn(self.stm_loss, train=True)
        if self.phase in self.cfg.compile:  # one compiled graph for every number of demos
            torch._dynamo.maybe_mark_dynamic(context, 1)
        loss, query_loss, aux_loss = step(context, query, target)
        self.log("train/query_loss", query_loss)
        if aux_loss is not None and k > 1:
            self.log("train/aux_loss", aux_loss)
        self.log("train/loss", loss, prog_bar=True)
        # a tensor made on the device (a fill, no copy): a Python number would make
        # Lightning's `log` build it with `torch.tensor(k, device=...)`, a host-to-device
        # copy that waits for the host in every step (issue 46)
        self.log("train/demos", torch.full((), float(k), device=loss.device))
        return loss

    def stm_loss(self, context, query, target):
        """(loss, query loss, auxiliary loss or None): the k demonstrations of `context`
        (B, 5k), clear the KV cache, the held-out query; with TrainConfig.phase1_aux_demo_loss
        plus that weight times the loss on the answers of demonstrations 2..k, predicted at
        their delimiters (0 when k = 1: then the loss is the query loss, exactly)."""
        B, n = context.shape
        k = n // task.DEMO_LEN
        aux = self.cfg.phase1_aux_demo_loss > 0
        state = self.model.init_state(B, device=context.device)
        demo_logits, state = self.model(context, state, ltm_routing=False,
                                        logits="all" if aux else "none")
        logits, _ = self.model(query, state.clear_kv(), ltm_routing=False, logits="last")
        query_loss = F.cross_entropy(logits.float(), target)
        if not aux:
            return query_loss, query_loss, None
        # demonstration d (0-based) spans positions 5d .. 5d + 4: its answer at 5d + 4 is
        # predicted at its delimiter 5d + 3; the mean over the B (k - 1) answers of d >= 1,
        # written without data-dependent or sliced shapes (every answer's loss, those of
        # d = 0 masked out, sum / count), so that every k, k = 1 (0 / 1) included, is the
        # same compiled graph
        V = demo_logits.shape[-1]
        pred = demo_logits.view(B, k, task.DEMO_LEN, V)[:, :, 3].float()  # (B, k, V)
        answers = context.view(B, k, task.DEMO_LEN)[:, :, 4]  # (B, k)
        per_answer = F.cross_entropy(pred.transpose(1, 2), answers, reduction="none")
        later = torch.arange(k, device=context.device) >= 1  # demonstrations 2..k
        aux_loss = (per_answer * later).sum() / max(B * (k - 1), 1)
        return query_loss + self.cfg.phase1_aux_demo_loss * aux_loss, query_loss, aux_loss

    def _outcomes(self, batch, full: bool) -> dict:
        return episode_outcomes(self.model, batch, consolidation="learned", ltm_routing=False,
                                ltm=False)

    def on_validation_epoch_end(self):
        if self.trainer.sanity_checking:
            return
        m = self._metrics()
        keep = {f"val/{k}": v for k, v in m.items() if not k.startswith("loss_")}
        self.log_dict(keep, prog_bar=False)
        self.log("val/mean_stm_pb", m["mean_stm"], prog_bar=True, logger=False)
        self._record_epoch(keep)

    def on_test_epoch_end(self):
        self.test_metrics = self._metrics()
        self.log_dict({f"test/{k}": v for k, v in self.test_metrics.items()})


VAL_LOGGED = ("updated_ltm", "seg1_stm", "seg2_stm", "mean_stm", "dual", "updated_ltm_add10",
              "updated_ltm_affine10", "updated_ltm_baseline", "loss_updated_ltm")


class Phase2Module(_PhaseModule):
    """Consolidation training for one condition: Eq. 10 (or Eq. 11 for the dual objective)."""

    phase = "phase2"

    def __init__(self, cfg: TrainConfig, model: PMNet, condition: Condition,
                 phase1_sha256: str | None = None):
        super().__init__(cfg, model, cfg.lr)
        self.condition = condition
        self.trainable = freeze_to_subset(model, condition.subset)
        self.lr_schedule = cfg.lr_schedule
        self.select = cfg.select_metric(condition.select)
        if self.select not in VAL_LOGGED:
            raise ValueError(f"condition {condition.name!r} selects on {self.select!r}, which "
                             f"validation does not log (phase2_families="
                             f"{','.join(cfg.phase2_families)}): train both families")
        # a compact checkpoint (issue 61): with the Phase-1 file's sha256 known, last.ckpt and
        # best.ckpt hold the trainable parameters only; the frozen ones are the Phase-1
        # file's, which the trial loaded (and verified) before training. A Consolidator-only
        # unit's progress is then ~0.2 MB, not the whole model twice, so a long Phase 2 can
        # pause into a committed store.
        self.phase1_sha256 = phase1_sha256
        self.strict_loading = phase1_sha256 is None

    def _frozen(self) -> set[str]:
        return {f"model.{n}" for n, p in self.model.named_parameters() if not p.requires_grad}

    def on_save_checkpoint(self, checkpoint):
        super().on_save_checkpoint(checkpoint)
        if self.phase1_sha256 is None:
            return
        frozen = self._frozen()
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items()
                                    if k not in frozen}
        checkpoint["pmnet_compact"] = {"phase1_sha256": self.phase1_sha256,
                                       "frozen": sorted(frozen)}

    def on_load_checkpoint(self, checkpoint):
        compact = checkpoint.get("pmnet_compact")
        if compact is not None:
            # the frozen weights come from the Phase-1 file this module was built on: it must
            # be the same file, and the missing keys exactly the frozen parameters
            if compact["phase1_sha256"] != self.phase1_sha256:
                raise ValueError(
                    f"checkpoint holds the trainable weights of a Phase 2 trained from Phase-1 "
                    f"file {compact['phase1_sha256'][:12]}, not this run's "
                    f"{str(self.phase1_sha256)[:12]}: it cannot continue here")
            held = set(checkpoint["state_dict"])
            expected = set(self.state_dict()) - set(compact["frozen"])
            if held != expected or set(compact["frozen"]) != self._frozen():
                raise ValueError("compact Phase-2 checkpoint: its parameters are not this "
                                 "condition's trainable ones (a different condition?)")
        elif not self.strict_loading:
            self.strict_loading = True  # a full checkpoint (an older run) loads strictly
        super().on_load_checkpoint(checkpoint)

    def training_step(self, batch, batch_idx):
        losses = self.step_fn(self.objective, train=True)(batch)
        for name, value in losses.items():
            self.log(f"train/{name}", value, prog_bar=name == "loss")
        return losses["loss"]

    def objective(self, batch) -> dict[str, torch.Tensor]:
        """The condition's Phase-2 objective on one batch (`runner.phase2_losses`)."""
        cfg = self.cfg
        return phase2_losses(self.model, batch, self.condition, detach_ltm=cfg.detach_ltm,
                             ltm_graph=cfg.ltm_graph, initial_ltm_loss=cfg.initial_ltm_loss)

    def _outcomes(self, batch, full: bool) -> dict:
        c = self.condition
        return episode_outcomes(self.model, batch, consolidation=c.consolidation,
                                ltm_routing=c.ltm_routing, full=full,
                                stm=full or c.objective == "dual")

    def on_validation_epoch_end(self):
        if self.trainer.sanity_checking:
            return
        m = self._metrics()
        keep = {f"val/{k}": m[k] for k in VAL_LOGGED if k in m}
        self.log_dict(keep)
        self.log("val/select", m[self.select], prog_bar=True, logger=False)
        self._record_epoch(keep)

    def on_test_epoch_end(self):
        self.test_metrics = self._metrics()
        self.log_dict({f"test/{k}": v for k, v in self.test_metrics.items()
                       if not math.isnan(v)})


def _concat_batches(batches):
    fields = {f.name: torch.cat([getattr(b, f.name) for b in batches])
              for f in dataclasses.fields(batches[0])}
    return type(batches[0])(**fields)

