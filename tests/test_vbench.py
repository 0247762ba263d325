"""VBench's dynamic degree (RAFT optical flow) and imaging quality (MUSIQ) in mcar evaluate (mcar/eval/metrics.py;
the networks: mcar/eval/networks.py):
VBench's rules on hand-made numbers, the columns on frames built to differ with stand-in nets, the weights-only
loaders, and scoring's rows. torchvision's RAFT and pyiqa's MUSIQ themselves (the [vbench] extra, which needs a
torchvision built for the installed torch) are tested where they import, with random weights: shapes and plumbing;
with the real weights (MCAR_RAFT_WEIGHTS / MCAR_MUSIQ_WEIGHTS, never downloaded) also which way each column moves."""
import os

import pytest
import torch

from mcar.core.layout import Layout
from mcar.eval import metrics as M
from mcar.eval import networks as N


# ---- stand-in nets ---------------------------------------------------------------------------------------------
class HorizontalShift(torch.nn.Module):
    """A stand-in flow net: the whole-pixel horizontal shift (|shift| <= 5) that best maps each first frame onto the
    second (L1), as a uniform flow field."""

    def forward(self, a, b):
        shifts = torch.arange(-5, 6)
        err = torch.stack([(a.roll(int(s), dims=-1) - b).abs().flatten(1).mean(1) for s in shifts], 1)
        flow = torch.zeros(len(a), 2, *a.shape[-2:])
        flow[:, 0] = shifts[err.argmin(1)].float().view(-1, 1, 1)
        return flow


class ChangeAsFlow(torch.nn.Module):
    """A stand-in flow net for scoring's plumbing: a pixel's change between the frames as its flow (in pixels)."""

    def forward(self, a, b):
        return (b - a).abs().mean(1, keepdim=True).expand(-1, 2, -1, -1) * 10


class Brightness(torch.nn.Module):
    """A stand-in quality net: each frame's mean pixel on a 0-100 scale, as MUSIQ's scores are."""

    def forward(self, frames):
        return frames.flatten(1).mean(1) * 100


def texture(h: int, w: int, seed: int = 0) -> torch.Tensor:
    """(3, h, w) smooth random texture in [0, 1]: a shift of it is unambiguous."""
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.interpolate(torch.rand(1, 3, h // 8, w // 8, generator=g), size=(h, w),
                                           mode="bicubic", align_corners=False)[0].clamp(0, 1)


def panning(scene: torch.Tensor, frames: int, step: int) -> torch.Tensor:
    return torch.stack([scene.roll(step * t, dims=-1) for t in range(frames)])


# ---- dynamic degree --------------------------------------------------------------------------------------------
def test_top_flow_is_the_mean_of_the_largest_five_percent_of_magnitudes():
    flow = torch.zeros(2, 2, 10, 100)  # 1000 pixels: the top 50
    flow[0, 0].view(-1)[:50], flow[0, 1].view(-1)[:50] = 3.0, 4.0  # magnitude 5
    flow[1, 0].view(-1)[:49] = 5.0  # 49 of 5 and one 0 among the top 50
    assert M.top_flow(flow).tolist() == pytest.approx([5.0, 5.0 * 49 / 50])


def test_dynamic_degree_is_vbenchs_rule():
    """Dynamic: at least round(4 T / 16) frame pairs (T frames; at least 1) move more than 6 px per 256 px of the
    short side."""
    T = 16  # 15 pairs, 4 must move; at 256 px the threshold is 6 px
    motion = torch.zeros(2, T - 1)
    motion[0, :3] = motion[1, :4] = 7.0  # 3 pairs move, 4 pairs move
    assert M.dynamic_degree(motion, 256, 320).tolist() == [0.0, 1.0]
    assert M.dynamic_degree(torch.full((1, T - 1), 6.0), 256, 256).item() == 0.0  # more than, not equal
    assert M.dynamic_degree(torch.full((1, T - 1), 3.5), 128, 512).item() == 1.0  # 128 px: 3 px
    # T = 3 (the CPU clips): round(0.75) = 1 pair. T = 2: VBench's round(0.5) = 0 pairs would call any 2 frames
    # dynamic; here one pair must move
    assert M.dynamic_degree(torch.tensor([[0.0, 7.0]]), 256, 256).item() == 1.0
    assert M.dynamic_degree(torch.tensor([[0.0]]), 256, 256).item() == 0.0


def test_dynamic_degree_orders_still_slow_and_moving_frames():
    """Frames built to differ, a stand-in flow net: a still texture and one panning 1 px a frame are static at 64 px
    (threshold 1.5 px), the same texture panning 4 px a frame is dynamic (3 frames: 1 moving pair is enough)."""
    scene = texture(64, 64)
    videos = torch.stack([panning(scene, 3, 0), panning(scene, 3, 1), panning(scene, 3, 4)])
    assert M.dynamic_degree_per_clip(HorizontalShift(), videos).tolist() == [0.0, 0.0, 1.0]
    one_frame = M.dynamic_degree_per_clip(HorizontalShift(), videos[:, :1])
    assert isinstance(one_frame, N.Unavailable) and "needs >= 2 frames" in one_frame.reason


def test_raft_flow_pads_like_vbench_scales_to_raft_range_and_takes_the_last_update():
    """RaftFlow around a recording stand-in for torchvision's RAFT: [0, 1] -> [-1, 1], edge-padded to a multiple of
    8 split over both sides (VBench's InputPadder), 20 updates, the last one returned; small frames refused."""
    seen = {}

    def raft(a, b, num_flow_updates):
        seen.update(a=a, b=b, updates=num_flow_updates)
        return [torch.zeros(len(a), 2, *a.shape[-2:]), torch.ones(len(a), 2, *a.shape[-2:])]

    a = torch.rand(2, 3, 130, 149)
    flow = N.RaftFlow(raft)(a, torch.zeros_like(a))
    assert flow.shape == (2, 2, 136, 152) and flow.min() == 1 and seen["updates"] == 20
    assert torch.equal(seen["a"][..., 3:133, 1:150], a * 2 - 1) and seen["b"].eq(-1).all()
    assert torch.equal(seen["a"][..., 0, 1:150], a[..., 0, :] * 2 - 1)  # replicated edge rows: 3 above, 3 below
    with pytest.raises(ValueError, match="at least 128 pixels a side, got 64x200"):
        N.RaftFlow(raft)(torch.rand(1, 3, 64, 200), torch.rand(1, 3, 64, 200))


# ---- imaging quality -------------------------------------------------------------------------------------------
def test_imaging_quality_is_the_mean_score_over_frames_over_100():
    videos = torch.stack([torch.full((4, 3, 8, 8), 0.2), torch.linspace(0, 1, 4).view(4, 1, 1, 1).expand(4, 3, 8, 8)])
    q = M.imaging_quality_per_clip(Brightness(), videos, batch_size=3)  # chunks cross clips
    assert q.dtype == torch.float64 and q.tolist() == pytest.approx([0.2, 0.5])


def test_musiq_wrapper_resizes_only_a_longer_side_above_512():
    """VBench's default 'longer' preprocessing: 1024x100 -> 512x50, 144x144 as it is; frames stay in [0, 1] (MUSIQ
    rescales them itself)."""
    sizes = []

    def musiq(x):
        sizes.append(tuple(x.shape[-2:]))
        assert 0 <= x.min() and x.max() <= 1
        return x.flatten(1).mean(1, keepdim=True) * 100

    wrapper = N.MusiqQuality(musiq)
    assert wrapper(torch.rand(2, 3, 100, 1024)).shape == (2,) and wrapper(torch.rand(3, 3, 144, 144)).shape == (3,)
    assert sizes == [(50, 512), (144, 144)]


# ---- loaders ---------------------------------------------------------------------------------------------------
class RunsCode:
    """A pickled object whose unpickling would call print: what weights-only loading must refuse."""

    def __reduce__(self):
        return print, ("unpickling ran code",)


@pytest.mark.parametrize("load,key,what", [(N.load_raft, "vbench.raft", "RAFT"),
                                           (N.load_musiq, "vbench.musiq", "MUSIQ")])
def test_loaders_name_the_key_to_set_and_read_weights_only(tmp_path, capfd, load, key, what):
    """No path or no file: the column is n/a, naming the key; a file that would run code, or holds more than a flat
    state dict, is refused naming it."""
    assert f"no {what} weights: set {key}=/path/to/" in load(None).reason
    assert load(str(tmp_path / "x.pth")).reason == f"{what} weights not found: {key}={tmp_path / 'x.pth'}"
    code = tmp_path / "code.pth"
    torch.save({"w": torch.zeros(1), "x": RunsCode()}, code)
    with pytest.raises(ValueError, match=rf"refused to load {what} weights \({key}\) {code}: .*Unsupported global"):
        load(str(code))
    assert "unpickling ran code" not in capfd.readouterr().out
    nested = tmp_path / "nested.pth"
    torch.save({"w": {"inner": torch.zeros(1)}}, nested)
    with pytest.raises(ValueError, match=rf"^{key}={nested}: not a flat state dict \(name -> tensor\)"):
        load(str(nested))


def test_without_torchvision_the_columns_say_what_to_install(tmp_path):
    """CI's venv: torch 2.13's CPU build, no torchvision (PyPI's does not import beside it)."""
    try:
        import torchvision  # noqa: F401
        pytest.skip("torchvision imports here")
    except (ImportError, RuntimeError):
        pass
    weights = tmp_path / "w.pth"
    torch.save({"w": torch.zeros(1)}, weights)
    for load, key in ((N.load_raft, "vbench.raft"), (N.load_musiq, "vbench.musiq")):
        reason = load(str(weights)).reason
        assert reason.startswith(f"{key} needs ") and reason.endswith("pip install torch==2.14.1 "
                                                                      "torchvision==0.29.1 'mcar[vbench]'")


# ---- scoring ---------------------------------------------------------------------------------------------------
def test_scoring_gives_both_columns_per_clip_with_intervals_or_says_why_not(monkeypatch):
    """score(): dynamic degree from the last prompt frame on (copy_last: still, 0; the real clips change: 1) and
    imaging quality of the generated frames, each with a bootstrap interval and per-clip values; without weights
    the columns are n/a and the notes name the key to set."""
    from mcar.eval import scoring
    from mcar.eval.scoring import Scorer, reference_clips, score

    from .test_metrics import token_video_scoring

    layout, cb, P = Layout(2, 3, 1), 4, 2
    gt, missing, base = token_video_scoring(monkeypatch, P)
    nets = {"i3d": missing, "lpips": missing, "dino": missing, "idm": missing, "raft": ChangeAsFlow(),
            "musiq": Brightness()}
    still = reference_clips("copy_last", gt, layout, P, cb)
    row, _, extra = score(still, gt, scorer=Scorer(**base, nets=nets))
    assert row["dynamic_degree"] == 0.0 and len(extra["per_clip"]["dynamic_degree"]) == 5
    brightness = scoring._pixels(None, still, gt)[0][:, P:].flatten(1).mean(1).double()  # generated frames only
    assert extra["per_clip"]["imaging_quality"] == pytest.approx(brightness.tolist())
    assert row["imaging_quality_lo"] <= row["imaging_quality"] <= row["imaging_quality_hi"]
    row, _, _ = score(gt, gt, scorer=Scorer(**base, nets=nets))
    assert row["dynamic_degree"] == 1.0  # random tokens: every frame changes
    row, _, _ = score(gt, gt, scorer=Scorer(**base, nets=nets | {"raft": N.load_raft(None),
                                                                 "musiq": N.load_musiq(None)}))
    assert isinstance(row["dynamic_degree"], N.Unavailable) and isinstance(row["imaging_quality"], N.Unavailable)
    assert "dynamic_degree: no RAFT weights: set vbench.raft=" in row["notes"]
    assert "imaging_quality: no MUSIQ weights: set vbench.musiq=" in row["notes"]


# ---- the real libraries ([vbench]), random weights -------------------------------------------------------------
def test_raft_loads_torchvision_weights_only_and_scores_every_pair(tmp_path):
    optical_flow = pytest.importorskip("torchvision.models.optical_flow")
    from safetensors.torch import save_file

    torch.manual_seed(0)
    small = optical_flow.raft_small(weights=None)
    torch.save({f"module.{k}": v for k, v in small.state_dict().items()}, tmp_path / "raft_small.pth")  # DataParallel
    save_file(small.state_dict(), tmp_path / "raft_small.safetensors")
    for name in ("raft_small.pth", "raft_small.safetensors"):
        net = N.load_raft(str(tmp_path / name))
        assert isinstance(net, N.RaftFlow) and all(torch.equal(a, b) for a, b in
                                                    zip(net.raft.state_dict().values(), small.state_dict().values()))
    videos = panning(texture(128, 130), 2, 4)[None]  # one clip, one pair; 130 is padded to 136
    flows = []
    dynamic = M.dynamic_degree_per_clip(lambda a, b: flows.append(net(a, b)) or flows[-1], videos)
    assert flows[0].shape == (1, 2, 128, 136) and torch.isfinite(flows[0]).all()
    assert dynamic.shape == (1,) and dynamic.item() == float(M.top_flow(flows[0]).item() > 6 * 128 / 256)
    torch.save(torch.nn.Linear(2, 2).state_dict(), tmp_path / "other.pth")
    with pytest.raises(ValueError, match=r"other.pth: not torchvision RAFT weights \(raft_large: .*: use raft_large_"):
        N.load_raft(str(tmp_path / "other.pth"))


def test_musiq_loads_pyiqa_weights_only_and_scores_every_frame(tmp_path):
    musiq_arch = pytest.importorskip("pyiqa.archs.musiq_arch")
    torch.manual_seed(0)
    musiq = musiq_arch.MUSIQ(num_class=1, pretrained=False).eval()
    torch.save(musiq.state_dict(), tmp_path / "musiq.pth")
    net = N.load_musiq(str(tmp_path / "musiq.pth"))
    assert isinstance(net, N.MusiqQuality)
    frames = texture(64, 96)[None].expand(2, -1, -1, -1)
    with torch.no_grad():
        direct = torch.cat([musiq(f[None]).reshape(1) for f in frames])  # VBench: one frame at a time
    q = M.imaging_quality_per_clip(net, frames[None])
    assert q.shape == (1,) and q.item() == pytest.approx(float(direct.mean()) / 100, rel=1e-5)
    torch.save(musiq_arch.MUSIQ(num_class=10, pretrained=False).state_dict(), tmp_path / "ava.pth")  # AVA's head
    with pytest.raises(ValueError, match=r"ava.pth: not MUSIQ weights with SPAQ's single-score head \(2 keys missing "
                                         r"\(e.g. \['head.bias'\]\).*: use musiq_spaq_ckpt"):
        N.load_musiq(str(tmp_path / "ava.pth"))


# ---- the real weights: which way each column moves --------------------------------------------------------------
def weights(variable: str) -> str:
    path = os.environ.get(variable)
    if not path:
        pytest.skip(f"{variable} not set: a local file of the real weights (never downloaded)")
    return path


def test_real_raft_calls_a_still_scene_static_and_a_pan_dynamic():
    net = N.load_raft(weights("MCAR_RAFT_WEIGHTS"))  # raft_large_C_T_V1-22a6c225.pth
    assert isinstance(net, N.RaftFlow), net
    scene = texture(144, 144)
    videos = torch.stack([panning(scene, 4, 0), panning(scene, 4, 8)])  # 8 px a frame; threshold 3.4 px at 144
    assert M.dynamic_degree_per_clip(net, videos).tolist() == [0.0, 1.0]


def test_real_musiq_scores_sharp_frames_above_blurred_ones():
    net = N.load_musiq(weights("MCAR_MUSIQ_WEIGHTS"))  # musiq_spaq_ckpt-358bb6af.pth
    assert isinstance(net, N.MusiqQuality), net
    g = torch.Generator().manual_seed(0)
    sharp = torch.nn.functional.interpolate(torch.rand(2, 3, 36, 36, generator=g), size=(144, 144), mode="nearest")
    blurred = torch.nn.functional.avg_pool2d(sharp, 9, stride=1, padding=4, count_include_pad=False)
    q = M.imaging_quality_per_clip(net, torch.stack([sharp, blurred]))
    assert q[0] > q[1]
