"""The training steps as the pipeline runs them (issue 20, issue 19 finding 5): no step waits
for the device, a compiled step computes what the eager step computes, and the CUDA-graph
path does what it can be checked to do without a GPU.

Each step here is the LightningModule's own `training_step`, then `backward` and the module's
`on_train_batch_end`, on the debug model (`self.log` is recorded instead of reaching a
trainer). Lightning's optimiser step is torch's AdamW (its step counter lives on the host
unless `capturable`), and Lightning reads logged values back every `log_every_n_steps`
(10), not in a step.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from pmnet import task
from pmnet import train as T
from pmnet.conditions import ALL_CONDITIONS
from pmnet.model import PMNet
from pmnet.opcount import OpCounter
from pmnet.train import compiled_steps

DEBUG = dict(compile="off")


def module_for(kind: str, cfg: T.TrainConfig, seed: int = 0):
    """(module, batches) of a step kind: phase0, phase1, or a Phase-2 condition name."""
    torch.manual_seed(seed)
    model = PMNet(cfg.model)
    B = cfg.batch_size
    if kind == "phase0":
        return (T.Phase0Module(cfg, model, cfg.phase1_lr),
                [task.make_copy_batch(B, cfg.phase0_copy_len, i) for i in range(2)])
    if kind == "phase1":
        for n, p in model.named_parameters():
            p.requires_grad_(not n.startswith("consolidator."))
        eps = task.train_episodes(cfg.phase1_seed + 1_000_000, 0, 2 * B)
        return T.Phase1Module(cfg, model, cfg.phase1_lr), [eps[:B], eps[B:]]
    cond = T.get_condition(kind)
    T.init_phase2(model, cfg, cond, seed)  # the operator, baseline or Consolidator start
    eps = task.train_episodes(seed, 0, 2 * B, segments=cfg.segments)
    return T.Phase2Module(cfg, model, cond), [eps[:B], eps[B:]]


def run_step(module, batch, step: int = 0, logged: dict | None = None, counter=None):
    """One step as Lightning runs it, minus the trainer: the host-side hook
    on_train_batch_start (Phase 1 draws its number of demonstrations there), then the step:
    training_step, backward, on_train_batch_end, inside `counter` if one is given."""
    module.log = lambda name, value, **kw: (logged if logged is not None else {}).__setitem__(
        name, value)
    module.on_train_batch_start(batch, step)
    with counter if counter is not None else contextlib.nullcontext():
        loss = module.training_step(batch, step)
        loss.backward()
        module.on_train_batch_end({"loss": loss}, batch, step)
    return loss


STEP_KINDS = ["phase0", "phase1", *ALL_CONDITIONS]


@pytest.mark.parametrize("kind", STEP_KINDS)
def test_a_training_step_reads_nothing_back_from_the_device(kind, one_thread):
    """Zero host syncs (`.item()`, `int()`, data-dependent shapes) in the step of every phase
    and condition; on today's main `PMNet.forward` alone made 6 (`int(tokens.min/max)` per
    chunk), `F.one_hot` 2 per write and `on_train_batch_end` one `float(loss)`."""
    cfg = T.TrainConfig.from_name("debug", batch_size=8, **DEBUG)
    module, batches = module_for(kind, cfg)
    module.train()
    for i, batch in enumerate(batches):
        logged, ops = {}, OpCounter()
        run_step(module, batch, i, logged, counter=ops)
        assert ops.total > 100  # the step ran, under the counter
        assert ops.syncs == {}, (kind, ops.syncs)
        assert all(not isinstance(v, torch.Tensor) or v.dim() == 0 for v in logged.values())
    # the epoch's mean loss is read back once, at the epoch's end
    assert module._loss_count == 2


def test_segments_and_truncation_steps_read_nothing_back(one_thread):
    cfg = T.TrainConfig.from_name("debug", batch_size=8, segments=4, ltm_graph="truncated",
                                  initial_ltm_loss=0.5, **DEBUG)
    module, batches = module_for("consolidator_only", cfg)
    ops = OpCounter()
    run_step(module, batches[0], counter=ops)
    assert ops.total > 100 and ops.syncs == {}


def test_the_epoch_loss_is_the_mean_of_the_step_losses(one_thread):
    cfg = T.TrainConfig.from_name("debug", batch_size=8, **DEBUG)
    module, batches = module_for("consolidator_only", cfg)
    losses = [float(run_step(module, b, i)) for i, b in enumerate(batches)]
    module._record_epoch({})
    assert module.history[-1]["train/loss"] == sum(losses) / 2  # float64 sum, as before
    assert module._loss_count == 0


# ------------------------------------------------------------------ compiled steps
@pytest.fixture
def aot_eager(monkeypatch):
    """Compile with AOTAutograd's eager backend: the graphs dynamo captures, forward and
    backward, run by eager kernels (seconds, where inductor's code generation takes minutes
    on this machine; `test_inductor_step_equals_eager_step` is the slow test with it)."""
    monkeypatch.setattr(compiled_steps, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def grads_after(kind, cfg, steps=2):
    module, batches = module_for(kind, cfg)
    losses = []
    for i in range(steps):
        losses.append(run_step(module, batches[i % 2], i).detach())
    return losses, {n: p.grad.clone() for n, p in module.model.named_parameters()
                    if p.grad is not None}, module


@pytest.mark.parametrize("kind", [
    "phase1", "consolidator_only",
    # the rest cost 10-25 s each of dynamo tracing: in the slow suite
    *(pytest.param(k, marks=pytest.mark.slow)
      for k in ("phase0", "learned_full", "learned_full_dual", "operator_gru")),
])
def test_compiled_step_equals_eager_step(kind, aot_eager, one_thread):
    from torch._dynamo.utils import counters

    counters.clear()
    eager = T.TrainConfig.from_name("debug", batch_size=8, **DEBUG)
    compiled = dataclasses.replace(eager, compile=("phase0", "phase1", "phase2"))
    l_e, g_e, _ = grads_after(kind, eager)
    l_c, g_c, module = grads_after(kind, compiled)
    # the compiled module really ran a compiled step, as one graph (no breaks)
    assert counters["stats"]["unique_graphs"] >= 1
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    for a, b in zip(l_e, l_c):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert g_e.keys() == g_c.keys()
    for name in g_e:  # the same graph run by the same kernels: fp32 rounding at most
        torch.testing.assert_close(g_e[name], g_c[name], rtol=1e-4, atol=1e-6)


def test_phase1_compiles_one_graph_for_every_number_of_demonstrations(aot_eager, one_thread):
    """The curriculum changes the context length every step (5 to 40 tokens): the compiled
    step treats it as a dynamic size and has no branch on it, so the 8 numbers of
    demonstrations compile at most two graphs (one demonstration, a size-1 dimension, gets
    its own; with a window that covers a segment, as in the cpu and paper presets: the
    debug model's window of 16 would add one for longer contexts)."""
    from torch._dynamo.utils import counters

    counters.clear()
    cfg = T.TrainConfig.from_name("debug", batch_size=4, phase1_aux_demo_loss=1.0,
                                  compile="phase1", **{"model.window": 64})
    module, batches = module_for("phase1", cfg)
    seen = set()
    for step in range(40):
        k = module.demos_at(step)
        if k in seen:
            continue
        seen.add(k)
        run_step(module, batches[0], step)
    assert len(seen) == task.N_DEMOS
    assert counters["stats"]["unique_graphs"] <= 2


def test_each_phase_compiles_only_what_the_config_names():
    cfg = T.TrainConfig.from_name("debug", batch_size=8, compile=("phase1", "phase2"))
    module, _ = module_for("consolidator_only", cfg)
    assert module.step_fn(module._outcomes, train=False) == module._outcomes
    assert module.step_fn(module.objective, train=True) != module.objective
    p0, _ = module_for("phase0", cfg)
    assert p0.step_fn(p0.copy_loss, train=True) == p0.copy_loss  # phase0 not named
    p1, _ = module_for("phase1", dataclasses.replace(cfg, compile=("eval",)))
    assert p1.step_fn(p1.stm_loss, train=True) == p1.stm_loss
    assert p1.step_fn(p1._outcomes, train=False) != p1._outcomes


@pytest.mark.slow
def test_compiled_evaluation_equals_eager_evaluation(aot_eager, one_thread):
    cfg = T.TrainConfig.from_name("debug", batch_size=8, compile=("phase1", "phase2"))
    cfg_all = dataclasses.replace(cfg, compile=("phase2", "eval"))
    module, batches = module_for("consolidator_only", cfg_all)
    module.eval()
    step = module.step_fn(module._outcomes, train=False)
    assert step != module._outcomes
    got = step(batches[0], True)
    want = module._outcomes(batches[0], True)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k])


def test_cuda_graph_path_marks_each_step_and_asks_for_reduce_overhead(monkeypatch):
    """On a CUDA device (with cuda_graphs) the step is compiled in "reduce-overhead" mode
    (CUDA graphs) and every call first marks a new step; on the CPU neither. Without a GPU
    this checks the wiring; the graphs themselves need a GPU (the `gpu` test below)."""
    calls, marks = [], []
    monkeypatch.setattr(compiled_steps, "COMPILE_BACKEND", "inductor")
    monkeypatch.setattr(torch, "compile",
                        lambda fn, **kw: calls.append(kw) or (lambda *a, **k: fn(*a, **k)))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    cfg = T.TrainConfig.from_name("debug", compile="phase2")

    def f(x):
        return x + 1

    step = T.compile_step(f, torch.device("cuda", 0), cfg)
    assert calls[-1]["mode"] == "reduce-overhead"
    assert step(torch.zeros(1)).item() == 1 and step(torch.zeros(1)).item() == 1
    assert len(marks) == 2
    T.compile_step(f, torch.device("cpu"), cfg)
    assert calls[-1]["mode"] is None
    T.compile_step(f, torch.device("cuda", 0), dataclasses.replace(cfg, cuda_graphs=False))
    assert calls[-1]["mode"] is None


def test_compile_cache_is_shared_through_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    path = T.use_compile_cache(tmp_path / "cc")
    import os

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert path.is_dir() and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(path)
    assert cache_dir() == str(path)  # what inductor will use in this and child processes


def test_compile_setting_is_validated_and_parsed():
    for bad in ("yes", ("phase2", "phase2"), ("phase3",)):
        with pytest.raises(ValueError, match="TrainConfig.compile"):
            T.TrainConfig.from_name("debug", compile=bad)
    with pytest.raises(ValueError, match="cuda_graphs"):
        T.TrainConfig.from_name("debug", cuda_graphs="on")
    assert T.TrainConfig.from_name("cpu").compile == ("phase2",)
    assert T.TrainConfig.from_name("paper").compile == T.COMPILE_STEPS
    assert T.TrainConfig.from_name("debug").compile == ()
    # --set compile=off / compile=phase2,eval; a config round-trips through its dict
    for text, want in (("off", ()), ("phase2,eval", ("phase2", "eval")), ("[]", ())):
        cfg = T.TrainConfig.from_name("cpu", **T.parse_overrides([f"compile={text}"]))
        assert cfg.compile == want
        assert T.TrainConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["phase1", "consolidator_only"])
def test_inductor_step_equals_eager_step(kind, one_thread):
    """The real backend (inductor's generated C++ on the CPU): fused kernels reorder fp32
    sums, so losses and gradients agree to fp32 rounding accumulated over the step."""
    torch._dynamo.reset()
    eager = T.TrainConfig.from_name("debug", batch_size=8, **DEBUG)
    l_e, g_e, _ = grads_after(kind, eager)
    l_c, g_c, _ = grads_after(kind, dataclasses.replace(eager, compile=T.COMPILE_STEPS))
    for a, b in zip(l_e, l_c):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for name in g_e:
        scale = g_e[name].abs().max().item()
        torch.testing.assert_close(g_e[name], g_c[name], rtol=1e-3, atol=1e-5 * max(scale, 1))


@pytest.mark.gpu
def test_cuda_graph_step_on_a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    cfg = T.TrainConfig.from_name("debug", batch_size=8, compile="phase2")
    module, batches = module_for("consolidator_only", cfg)
    module.cuda()
    module._device = torch.device("cuda", 0)
    losses = [float(run_step(module, b.to("cuda"), i)) for i, b in enumerate(batches * 2)]
    eager_cfg = dataclasses.replace(cfg, compile="off")
    ref, batches = module_for("consolidator_only", eager_cfg)
    ref.cuda()
    want = [float(run_step(ref, b.to("cuda"), i)) for i, b in enumerate(batches * 2)]
    assert losses == pytest.approx(want, rel=1e-3)


# ------------------------------------------------------------------ the shared compile cache
@pytest.fixture(scope="module")
def phase1_ckpt(tmp_path_factory):
    cfg = T.TrainConfig.from_name("debug", episodes_per_epoch=32, max_epochs=1,
                                  val_episodes=16, test_episodes=16, eval_batch_size=16,
                                  phase1_episodes_per_epoch=32, phase1_max_epochs=1)
    return T.run_phase1(cfg, tmp_path_factory.mktemp("p1"), progress=False)["checkpoint"]


def test_warm_compile_compiles_a_conditions_steps(phase1_ckpt, aot_eager, one_thread):
    from torch._dynamo.utils import counters

    counters.clear()
    cfg = T.TrainConfig.from_name("debug", batch_size=8, compile=("phase2",))
    assert T.warm_compile(cfg, condition="consolidator_only", phase1_ckpt=phase1_ckpt) > 0
    assert counters["stats"]["unique_graphs"] == 1  # the training step
    assert T.warm_compile(dataclasses.replace(cfg, compile=("phase1",)),
                          condition="consolidator_only", phase1_ckpt=phase1_ckpt) == 0.0
    with pytest.raises(ValueError, match="unknown condition"):
        T.warm_compile(cfg, condition="nope", phase1_ckpt=phase1_ckpt)


def test_phase1_loss_is_the_literal_one_for_every_number_of_demonstrations(one_thread):
    """`stm_loss` computes the auxiliary loss without data-dependent positions (one graph for
    every k) and must equal the literal form it replaced (the answers of demonstrations
    2..k gathered at positions 5d + 3, their mean cross-entropy): the query loss bit for
    bit, the auxiliary loss to fp32 rounding (the same per-answer losses summed in a
    longer vector with zeros); k = 1 has no auxiliary term, exactly."""
    import torch.nn.functional as F

    cfg = T.TrainConfig.from_name("debug", batch_size=6, phase1_aux_demo_loss=0.7, **DEBUG)
    module, batches = module_for("phase1", cfg)
    batch = batches[0]
    for k in range(1, task.N_DEMOS + 1):
        context = batch.seg_tokens[:, 0, : task.DEMO_LEN * k]
        query, target = batch.query_tokens[:, 0], batch.target[:, 0]
        loss, q_loss, aux = module.stm_loss(context, query, target)
        # the literal form (main before issue 20)
        st = module.model.init_state(6)
        demo_logits, st = module.model(context, st, ltm_routing=False, logits="all")
        logits, _ = module.model(query, st.clear_kv(), ltm_routing=False, logits="last")
        want = F.cross_entropy(logits.float(), target)
        assert torch.equal(q_loss, want)
        if k > 1:
            pos = torch.arange(1, k) * task.DEMO_LEN + 3
            want_aux = F.cross_entropy(demo_logits[:, pos].float().flatten(0, 1),
                                       context[:, pos + 1].flatten())
            torch.testing.assert_close(aux, want_aux, rtol=1e-6, atol=0)
            torch.testing.assert_close(loss, want + 0.7 * want_aux, rtol=1e-6, atol=0)
        else:
            assert torch.equal(loss, want) and aux == 0
