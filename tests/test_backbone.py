"""Tests of pmnet.backbone: the sliding-window attention paths and the flash-attn branch
(moved here from tests/test_model.py with the code they test, issue 51)."""

import math

import pytest
import torch
from torch.testing import assert_close

from pmnet.backbone import attend, attention_mask
from pmnet.config import ModelConfig
from pmnet.model import PMNet


def make(name="debug", seed=0, **kw):
    torch.manual_seed(seed)
    return PMNet(ModelConfig.from_name(name, **kw))


def tokens(B=3, T=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g)


def _naive_window_attention(q, k, v, window):
    """Reference: softmax over keys j with 0 <= pos_i - j < window, bottom-right aligned."""
    T, n_key = q.shape[2], k.shape[2]
    pos = torch.arange(n_key - T, n_key)[:, None] - torch.arange(n_key)[None, :]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~((pos >= 0) & (pos < window)), float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("n_cached, T", [(0, 12), (0, 16), (4, 8), (8, 8), (15, 1),
                                         (10, 8), (0, 20), (15, 16)])
def test_plain_causal_path_equals_sliding_window_path(n_cached, T, monkeypatch):
    """Where the window (16) does not bind, `attend` takes the plain causal path (SDPA's
    is_causal without a cache, a bottom-right causal mask with one) and gives what the
    sliding-window mask gives; where it binds, it takes the sliding-window mask."""
    window = 16
    g = torch.Generator().manual_seed(n_cached * 100 + T)
    q = torch.randn(2, 3, T, 8, generator=g)
    k, v = (torch.randn(2, 3, n_cached + T, 8, generator=g) for _ in range(2))
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kw):
        calls.append(kw)
        return sdpa(*args, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    out = attend(q, k, v, window)
    windowed = sdpa(q, k, v, attn_mask=attention_mask(T, n_cached + T, window))
    assert_close(out, windowed, atol=1e-6, rtol=1e-6)
    assert_close(out, _naive_window_attention(q, k, v, window), atol=1e-5, rtol=1e-5)
    (kw,) = calls
    if n_cached + T <= window:  # the window does not bind: plain causal attention
        if n_cached == 0:
            assert kw["is_causal"] and kw.get("attn_mask") is None
        else:
            assert torch.equal(kw["attn_mask"], attention_mask(T, n_cached + T, None))
    else:
        assert torch.equal(kw["attn_mask"], attention_mask(T, n_cached + T, window))
    # a cached chunk with is_causal would be top-left aligned: a different (wrong) answer
    if n_cached > 0 and T > 1 and n_cached + T <= window:
        top_left = sdpa(q, k, v, is_causal=True)
        assert not torch.allclose(top_left, windowed, atol=1e-3)


def test_flash_branch_is_taken_under_autocast(monkeypatch):
    """Under autocast the projections give bf16 and `rms_norm` / RoPE keep that dtype, so
    q, k and v reach flash-attn in bf16 and the flash branch runs (on main, F.rms_norm is on
    CUDA autocast's fp32 list: q and k arrived in fp32, the branch was skipped, and the gpu
    test compared SDPA with itself). Emulated on the CPU: the flash device is pointed at
    the CPU and flash-attn replaced by a stand-in with its interface (B, T, heads, D),
    computed by SDPA; in fp32 the branch is not taken."""
    from pmnet import backbone as M

    calls = []

    def flash(q, k, v, dropout_p, causal, window_size):
        calls.append((q.dtype, k.dtype, v.dtype, causal, window_size))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)

    net = make("debug").eval()
    x = tokens(T=12)
    ref, _ = net(x, net.init_state(3), ltm_routing=True)
    monkeypatch.setattr(M, "flash_attn_func", flash)
    monkeypatch.setattr(M, "FLASH_DEVICE", "cpu")
    monkeypatch.setattr(M, "FLASH_IS_OP", True)  # as flash-attn >= 2.7 (issue 36)
    fp32, _ = net(x, net.init_state(3), ltm_routing=True)
    assert calls == [] and torch.equal(fp32, ref)  # fp32: SDPA, as before
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = net(x, net.init_state(3), ltm_routing=True)
    assert len(calls) == net.cfg.n_layer
    assert all(c[:3] == (torch.bfloat16,) * 3 for c in calls)
    assert all(c[3:] == (True, (net.cfg.window - 1, 0)) for c in calls)
    assert_close(out.float(), ref, atol=0.1, rtol=0.1)  # bf16 against fp32


@pytest.mark.gpu
def test_flash_attention_matches_sdpa_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from pmnet import backbone as M

    if M.flash_attn_func is None:
        pytest.skip("flash-attn not installed")
    net = make("debug").cuda().eval()
    x = tokens(T=40).cuda()
    calls = []
    real = M.flash_attn_func
    with torch.autocast("cuda", dtype=torch.bfloat16):
        M.flash_attn_func = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            a, _ = net(x, net.init_state(3), ltm_routing=True)
        finally:
            M.flash_attn_func = real
        assert len(calls) == net.cfg.n_layer  # the flash branch ran, in every layer
        fa, M.flash_attn_func = M.flash_attn_func, None
        try:
            b, _ = net(x, net.init_state(3), ltm_routing=True)
        finally:
            M.flash_attn_func = fa
    assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)
