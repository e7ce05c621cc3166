"""Issue 46: what a read of `make gpu-check` predicted would fail on its first card, each
shown on the CPU (a spy on the host-to-device copies of a real Trainer's step, the inputs a
compiled graph lifts, the check's own exit codes and pieces, ...), each failing on the code
before its fix."""

from __future__ import annotations

import numbers

import lightning as L
import pytest
import torch

from pmnet import task
from pmnet import train as T
from pmnet.model import PMNet
from pmnet.train.data import EpisodeData

# -- a Python number logged in a step: a host-to-device copy in every step -----------------


def _host_data_spy(monkeypatch, box: dict):
    """Count `torch.tensor` / `torch.as_tensor` calls that build a tensor from Python numbers
    while `box["on"]` (Lightning's `self.log` builds the tensor of a logged number so, with
    `device=` the module's device: on a GPU a synchronising host-to-device copy)."""
    for name in ("tensor", "as_tensor"):
        real = getattr(torch, name)

        def spy(data, *args, _real=real, **kwargs):
            if box["on"] and isinstance(data, numbers.Number):
                box["calls"].append((data, kwargs.get("device")))
            return _real(data, *args, **kwargs)

        monkeypatch.setattr(torch, name, spy)


def _phase_module(kind: str, cfg):
    torch.manual_seed(0)
    model = PMNet(cfg.model)
    if kind == "phase1":
        for n, p in model.named_parameters():
            p.requires_grad_(not n.startswith("consolidator."))
        return (T.Phase1Module(cfg, model, cfg.phase1_lr),
                EpisodeData(cfg, 0, cfg.phase1_episodes_per_epoch))
    cond = T.get_condition(kind)
    T.init_phase2(model, cfg, cond, 0)
    return T.Phase2Module(cfg, model, cond), EpisodeData(cfg, 0, cfg.episodes_per_epoch)


@pytest.mark.parametrize("kind", ["phase1", "consolidator_only"])
def test_a_training_step_logs_no_python_number(kind, monkeypatch, one_thread):
    """A real Trainer's second-epoch steps, the window gpu-check's sync counter watches (from
    the callbacks' on_train_batch_start to their on_train_batch_end): no tensor is built from a
    Python number. On main Phase 1 logged `float(k)` (`train/demos`): Lightning made it a
    CUDA tensor by a synchronising copy, one host sync per step on the card."""
    cfg = T.TrainConfig.from_name("debug", compile="off", batch_size=8,
                                  phase1_episodes_per_epoch=16, episodes_per_epoch=16,
                                  val_episodes=8, test_episodes=8)
    module, data = _phase_module(kind, cfg)
    box = {"on": False, "calls": []}
    _host_data_spy(monkeypatch, box)
    steps = []

    class Window(L.Callback):  # the second epoch's steps, as gpu-check counts them
        def on_train_batch_start(self, trainer, *args):
            box["on"] = trainer.current_epoch >= 1

        def on_train_batch_end(self, *args):
            steps.append(box["on"])
            box["on"] = False

    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[Window()])
    trainer.fit(module, datamodule=data)
    assert steps == [False, False, True, True]
    assert box["calls"] == [], box["calls"]
    if kind == "phase1":  # the number of demonstrations is still logged, as a tensor
        assert "train/demos" in trainer.callback_metrics


# -- a global CPU tensor in the compiled evaluation step: CUDA graphs skipped ---------------


def test_the_compiled_evaluation_step_lifts_no_tensor_but_the_models_and_the_batchs(
        monkeypatch, one_thread):
    """The evaluation step as a trial compiles it (`step_fn(_outcomes, train=False)`), its
    graphs recorded: every tensor input is a parameter or buffer of the model or a field of
    the batch. On main `digit_prediction` moved the global `DIGIT_IDS` (a CPU tensor)
    `.to(device)` inside the step: dynamo lifted it as an input, a CPU input of a CUDA
    graph, for which inductor skips CUDA graphs ("cpu device") unless graph partitioning
    is on."""
    from pmnet.train import compiled_steps

    graphs: list[list] = []

    def record(gm, example_inputs):
        graphs.append(list(example_inputs))
        return gm.forward

    monkeypatch.setattr(compiled_steps, "COMPILE_BACKEND", record)
    torch._dynamo.reset()
    cfg = T.TrainConfig.from_name("debug", compile=("eval",), batch_size=4)
    module, _ = _phase_module("consolidator_only", cfg)
    module.eval()
    batch = task.train_episodes(0, 0, 4, segments=cfg.segments)
    try:
        out = module.step_fn(module._outcomes, train=False)(batch, False)
    finally:
        torch._dynamo.reset()
    assert graphs and "pred/updated_ltm" in out
    known = {id(t) for t in [*module.model.parameters(), *module.model.buffers()]}
    known |= {id(getattr(batch, f)) for f in batch.__dataclass_fields__}
    lifted = [tuple(t.shape) for g in graphs for t in g
              if isinstance(t, torch.Tensor) and id(t) not in known]
    assert lifted == [], lifted


def test_digit_prediction_is_the_argmax_over_the_digit_tokens():
    from pmnet.evaluate import DIGIT_IDS, digit_prediction

    logits = torch.randn(64, 256)
    assert torch.equal(digit_prediction(logits), logits[:, DIGIT_IDS].argmax(-1))


# -- cuBLAS workspaces: reserved between two trials on a reused actor ------------------------


def test_the_release_between_trials_clears_the_cublas_workspaces(monkeypatch):
    """A fake CUDA: the release at a trial's end clears cuBLAS's workspaces (one per handle
    and stream, held in the caching allocator) before it empties the cache; on main they
    stayed reserved into the next trial. Guarded: a torch without the private call skips
    it."""
    from pmnet.train import compiled_steps

    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces",
                        lambda: calls.append("clear_cublas"), raising=False)
    compiled_steps.release_compiled_steps()
    assert calls == ["clear_cublas", "empty_cache"]
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces")
    calls.clear()
    compiled_steps.release_compiled_steps()
    assert calls == ["empty_cache"]
