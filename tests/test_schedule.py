"""The DiagD / NTP schedule (mcar.core.schedule) against docs/diagd.md sections 3-5, generalised to P prompt frames."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mcar.core.layout import Layout
from mcar.core.schedule import Schedule
from mcar.core.visibility import causal_table

MCAR = Layout(14, 24, 11)


@pytest.mark.parametrize("k, d, passes", [(1, None, 555), (2, None, 750), (4, None, 1140), (2, 28, 442)])
def test_worked_numbers(k, d, passes):
    s = Schedule(MCAR, 16, 1, k=k, d=d)
    assert s.passes == passes == int(s.gen_pass.max()) + 1


def test_worked_number_ntp():
    s = Schedule.ntp(MCAR, 16, 1)
    assert s.passes == 5040 == int(s.gen_pass.max()) + 1
    assert len(s.proxy_target) == 0


@st.composite
def schedules(draw):
    h, w, n_a = draw(st.integers(1, 5)), draw(st.integers(1, 6)), draw(st.integers(0, 3))
    T = draw(st.integers(2, 5))
    P = draw(st.integers(1, T - 1))
    k = draw(st.integers(1, w + 2))  # k > w is allowed (idle passes)
    s_spa = (h - 1) * k + w
    d = draw(st.one_of(st.none(), st.integers(1, s_spa)))
    proxy = draw(st.sampled_from(["prev_frame", "above"]))
    return Schedule(Layout(h, w, n_a), T, P, k=k, d=d, proxy=proxy)


def check_invariants(s: Schedule):
    L, (h, w, n_a), T, P, k, d = s.layout, (s.layout.h, s.layout.w, s.layout.n_a), s.frames, s.prompt_frames, s.k, s.d
    # pass count: the formula, and the passes G actually uses
    assert s.passes == (T - P - 1) * d + (h - 1) * k + w == int(s.gen_pass.max()) + 1
    assert int(s.gen_pass[s.generated].min()) == 0
    for t in range(T):
        for i in range(h):
            for j in range(w):
                p = L.pos(t, i, j)
                if t < P:
                    assert s.gen_pass[p] == -1 and s.feed_pass[p] == 0
                else:
                    assert s.gen_pass[p] == (t - P) * d + i * k + j
                    assert s.feed_pass[p] == s.gen_pass[p] + 1
        for m in range(n_a):  # a[t] leads to frame t+1: fed with the pass that generates c[t+1,0,0]
            assert s.feed_pass[L.action_pos(t, m)] == (0 if t < P else (t + 1 - P) * d)
    # the sequence: every real slot exactly once, in layout order, then the proxies in their targets' order,
    # each at the position of the slot it stands in for (its target's predecessor)
    N = s.n_slots
    assert torch.equal(s.seq_pos[:N], torch.arange(N)) and not s.seq_is_proxy[:N].any()
    assert torch.equal(s.row_of_slot, torch.arange(N))
    assert s.seq_is_proxy[N:].all() and torch.equal(s.seq_target[N:], s.proxy_target)
    assert torch.equal(s.seq_pos[N:], s.seq_target[N:] - 1) and torch.equal(s.seq_src[N:], s.proxy_source)
    assert torch.equal(s.seq_feed_pass[N:], s.proxy_pass)
    assert torch.equal(s.seq_coords, s.coords[s.seq_pos])
    # every generated token is predicted by exactly one row, never after it is generated
    n_pred = torch.bincount(s.seq_target[s.seq_target >= 0], minlength=s.n_slots)
    assert (n_pred[s.gen_slots] == 1).all()
    g = s.gen_pass[s.gen_slots]
    assert (s.out_pass <= g).all()
    if k <= w:
        assert torch.equal(s.out_pass, g)
    # proxies: fed in their target's generation pass, exactly where the real predecessor comes too late
    late = s.feed_pass[s.gen_slots - 1] > g
    assert torch.equal(s.proxy_target, s.gen_slots[late])
    assert torch.equal(s.proxy_pass, s.gen_pass[s.proxy_target])
    row_starts = (T - P) * (h - 1) if k < w else 0
    frame_starts = (T - P - 1) if n_a == 0 and d < s.s_spa else 0
    assert len(s.proxy_target) == row_starts + frame_starts
    assert_causal(s)


def assert_causal(s: Schedule):
    """A row only carries a token sampled in an earlier pass (or a prompt token); no key from a later pass."""
    ready = torch.zeros(s.n_slots, dtype=torch.long)  # pass after which each slot's token is known
    ready[s.gen_slots] = s.out_pass + 1
    fed = s.seq_feed_pass < s.passes
    assert (ready[s.seq_src[fed]] <= s.seq_feed_pass[fed]).all()
    vis = s.table().dense()
    F = s.seq_feed_pass
    assert not (vis & (F[None, :] > F[:, None])).any()


@pytest.mark.parametrize("proxy", ["prev_frame", "above", "prompt"])
def test_causality_check_catches_an_off_by_one_feed_pass(proxy):
    s = Schedule(Layout(3, 4, 2), 3, 1, k=2, proxy=proxy)
    assert_causal(s)
    gen_rows = ~s.seq_is_proxy & s.generated[s.seq_pos]
    s.seq_feed_pass = torch.where(gen_rows, s.seq_feed_pass - 1, s.seq_feed_pass)  # F = G: fed before sampled
    with pytest.raises(AssertionError):
        assert_causal(s)


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_schedule_invariants(s):
    check_invariants(s)


def test_plan_feeds_each_row_once_and_samples_each_token_once():
    for k, d in [(1, None), (2, 3), (4, None), (6, None)]:
        s = Schedule(Layout(3, 4, 2), 4, 2, k=k, d=d)
        plan = s.plan()
        fed = torch.cat([p.cache_pos for p in plan])
        real = fed[fed < s.n_slots]
        assert len(real) == len(real.unique()) == int((s.feed_pass < s.passes).sum())
        assert (fed[fed == s.n_slots].numel()) == len(s.proxy_target)  # proxies only ever write the scratch
        sampled = torch.cat([p.out_slots for p in plan]).sort().values
        assert torch.equal(sampled, s.gen_slots)
        if k <= 4:
            assert len(plan) == s.passes
        else:
            assert len(plan) < s.passes  # k > w leaves idle passes, which the sampler skips


def test_ntp_is_diagd_with_k_equal_w_and_gives_the_causal_mask():
    L = Layout(3, 4, 2)
    ntp, diag = Schedule.ntp(L, 4, 1), Schedule(L, 4, 1, k=4, d=None)
    assert ntp.passes == 3 * 12
    assert torch.equal(ntp.feed_pass, diag.feed_pass) and torch.equal(ntp.gen_pass, diag.gen_pass)
    assert torch.equal(ntp.table().dense(), causal_table(ntp.n_slots).dense())
    # and a DiagD schedule with k < w does not
    assert not torch.equal(Schedule(L, 4, 1, k=2).table().dense(), causal_table(ntp.n_slots).dense())


def test_spatial_only_actions_see_the_whole_previous_frame():
    L = Layout(3, 4, 2)
    s = Schedule(L, 4, 1, k=2)
    for t in (1, 2):
        assert s.feed_pass[L.action_pos(t, 0)] == s.feed_pass[L.pos(t, 2, 3)]


@pytest.mark.parametrize("kw, field", [
    (dict(k=0), "k=0"),
    (dict(k=2, d=0), "d=0"),
    (dict(k=2, d=11), "d=11"),  # s_spa = (3-1)*2 + 4 = 8
    (dict(proxy="left"), "proxy='left'"),
    (dict(frames=1), "frames=1"),
    (dict(prompt_frames=0), "prompt_frames=0"),
    (dict(prompt_frames=4), "prompt_frames=4"),
])
def test_invalid_configs_name_the_field(kw, field):
    args = dict(layout=Layout(3, 4, 2), frames=4, prompt_frames=1) | kw
    with pytest.raises(ValueError, match=field.replace("(", r"\(")) as e:
        Schedule(**args)
    if "d=" in field:
        assert "[1, 8]" in str(e.value)


def test_negative_actions_rejected():
    with pytest.raises(ValueError, match="n_a"):
        Layout(3, 4, -1)


def test_schedule_group_mirrors_the_python_defaults():
    """conf/schedule/diagd.yaml and ScheduleConfig hold the same defaults (the one place each layer keeps them)."""
    from dataclasses import asdict

    from omegaconf import OmegaConf

    from mcar.core.schedule import ScheduleConfig

    assert OmegaConf.to_container(OmegaConf.load("conf/schedule/diagd.yaml")) == asdict(ScheduleConfig())
    assert ScheduleConfig.of({"k": 4}, d=None) == ScheduleConfig(k=4)
    with pytest.raises(ValueError, match=r"no field\(s\) \['kk'\]"):
        ScheduleConfig.of({"kk": 4})


@pytest.mark.parametrize("P", [1, 2])
def test_prompt_proxy_reads_the_first_prompt_frame_at_the_predecessor_slot(P):
    """proxy=prompt (the public MineWorld code's): the proxy of c[t,i,0] carries c[0,i-1,w-1]; written out per
    target from the layout formulas, not from the schedule's own arithmetic."""
    h, w, n_a, T = 3, 4, 2, 4
    lay = Layout(h, w, n_a)
    L = h * w + n_a
    s = Schedule(lay, T, P, k=2, proxy="prompt")
    expect = {t * L + i * w: 0 * L + (i - 1) * w + (w - 1) for t in range(P, T) for i in range(1, h)}
    got = dict(zip(s.proxy_target.tolist(), s.proxy_source.tolist()))
    assert got == expect


def test_one_schedule_object_per_configuration():
    """Training's check, its DiagD mask and every sampler of a run share one Schedule (and its cached plans)."""
    from mcar.core.layout import Layout
    from mcar.core.masks import build_mask_factory
    from mcar.core.sampler import build_sampler, check_sampler_config

    layout, sched = Layout(3, 4, 2), {"k": 2, "prompt_frames": 1}
    checked = check_sampler_config({"name": "diagd", "temperature": 0.0}, layout, 4, sched)
    assert build_mask_factory("diagd", layout, 4, sched).schedule is checked
    assert build_sampler({"name": "diagd"}, layout, 4, schedule=sched).schedule() is checked
    assert build_sampler({"name": "diagd"}, layout, 4, schedule={**sched, "k": 1}).schedule() is not checked
    with pytest.raises(ValueError, match="temperature=-1"):
        check_sampler_config({"name": "diagd", "temperature": -1}, layout, 4, sched)
    with pytest.raises(ValueError, match="schedule.k"):
        check_sampler_config({"name": "diagd", "k": 2}, layout, 4, sched)


def test_a_sampler_label_names_its_schedule_and_how_it_draws_tokens():
    """Rows, logs and tables name the sampler by its label: the schedule, then the drawing where it is not plain
    sampling at temperature 1 (two evaluations of one schedule, greedy and sampled, are two rows)."""
    from mcar.core.sampler import ScheduleSampler

    layout = Layout(3, 4, 1)
    label = lambda **kw: ScheduleSampler(layout, 3, 1, **kw).label
    assert label(k=2) == "diagd k=2" and label(name="ntp") == "ntp"
    assert label(k=2, d=5, temperature=0) == "diagd k=2 d=5 greedy" and label(name="ntp", top_k=1) == "ntp greedy"
    assert label(k=2, temperature=0.7, top_k=50, top_p=0.9) == "diagd k=2 T=0.7 top_k=50 top_p=0.9"
