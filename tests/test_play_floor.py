"""The bandwidth floor of play (mcar.core.flops.play_floor): the 700m numbers, and what GQA buys."""
import pytest

from mcar.core.flops import play_floor
from mcar.core.layout import Layout
from mcar.core.model import ModelConfig

MC_AR = Layout(14, 24, 11)


def arch(n_kv_heads: int) -> ModelConfig:
    return ModelConfig(vocab_size=8192 + 64, dim=2048, n_layers=20, n_heads=32, n_kv_heads=n_kv_heads, mlp_dim=4096)


def test_700m_play_floor_at_context_16_on_an_h100_sxm():
    """700m MHA, context 16, k=2 on 3.35 TB/s: one session's K/V ring is 0.91 GB, its floor ~25.8 frames/s, 16
    sessions' ~66 in all (computed by hand); GQA with 4 KV heads cuts the ring 8x and lifts the
    16-session floor 5x."""
    one, many = play_floor(arch(32), MC_AR, 16, 1, 3.35e12), play_floor(arch(32), MC_AR, 16, 16, 3.35e12)
    assert one["kv_bytes_per_session"] == pytest.approx(0.91e9, rel=0.01) and one["passes_per_frame"] == 50
    assert one["fps_total"] == pytest.approx(25.8, rel=0.02) and many["fps_total"] == pytest.approx(65.8, rel=0.02)
    gqa = play_floor(arch(4), MC_AR, 16, 16, 3.35e12)
    assert gqa["kv_bytes_per_session"] * 8 == one["kv_bytes_per_session"] and gqa["fps_total"] > 5 * many["fps_total"]
    assert play_floor(arch(32), MC_AR, 16, 1, 3.35e12, d=25)["passes_per_frame"] == 25  # overlapping frames
