"""Action tokenizers: MineWorld's VPT layout (mu-law camera, key pairs) and Crafter's one token per frame."""
import numpy as np
import pytest

from mcar.tokenizer.actions import (
    CAM_BINS,
    CAM_ZERO_BIN,
    CRAFTER_ACTIONS,
    VPT_OFFSETS,
    VPT_SLOTS,
    VPT_VOCAB,
    CrafterActions,
    VPTActions,
    action_space,
    bin_to_camera,
    camera_to_bin,
)


def test_camera_mu_law_bins():
    assert CAM_BINS == 21 and CAM_ZERO_BIN == 10
    assert camera_to_bin(0.0) == 10 and camera_to_bin(-90) == 0 and camera_to_bin(90) == 20
    assert camera_to_bin(500) == 20 and camera_to_bin(-500) == 0  # clipped at maxval 90
    # mu-law: fine near zero, coarse far out (VPT's CameraQuantizer with mu 11.4887)
    assert camera_to_bin(1.95) == 11 and camera_to_bin(1.0) == 10 and camera_to_bin(-1.95) == 9
    centres = [bin_to_camera(b) for b in range(CAM_BINS)]
    assert centres[10] == 0.0 and np.allclose(centres, [-c for c in centres[::-1]])
    assert all(camera_to_bin(c) == b for b, c in enumerate(centres))  # bin -> centre -> same bin
    assert np.all(np.diff(centres) > 0) and np.diff(centres)[10] < np.diff(centres)[0]


def test_vpt_layout_and_pairs():
    space = VPTActions()
    assert space.n_a == 11 and space.vocab_size == VPT_VOCAB == 71
    assert VPT_OFFSETS == [0, 1, 22, 43, 53, 56, 59, 62, 65, 67, 70]
    null = space.encode({})
    assert null == [0, 1 + 10, 22 + 10, 43, 53, 56, 59, 62, 65, 67, 70]  # bos, zero camera, nothing, eos
    both = space.encode({"forward": 1, "back": 1, "left": 1, "use": 1, "attack": 1, "drop": 1, "pickItem": 1})
    assert both[4:8] == [53, 56 + 1, 59, 62] and both[9] == 67  # pressed pairs -> null; a lone key -> its id
    ids = space.encode({"camera": (-1.95, 90.0), "hotbar": 7, "back": 1, "right": 1, "sneak": 1, "attack": 1,
                        "jump": 1, "pickItem": 1})
    assert ids == [0, 1 + 9, 22 + 20, 43 + 7, 53 + 2, 56 + 2, 59 + 2, 62 + 2, 65 + 1, 67 + 2, 70]


def test_vpt_round_trip():
    space, rng = VPTActions(), np.random.default_rng(0)
    for _ in range(200):
        ids = [off + int(rng.integers(0, n)) for off, (_, n) in zip(VPT_OFFSETS, VPT_SLOTS)]
        ids[0], ids[-1] = 0, 70
        assert space.encode(space.decode(ids)) == ids
    with pytest.raises(ValueError, match="pitch"):
        space.decode([0, 30] + [0] * 9)


def test_crafter_round_trip():
    space = action_space("crafter")
    assert isinstance(space, CrafterActions) and space.n_a == 1 and space.vocab_size == 17
    for i, name in enumerate(CRAFTER_ACTIONS):
        assert space.encode({"action": name}) == [i] and space.decode([i]) == {"action": name}
    with pytest.raises(ValueError, match="fly"):
        space.encode({"action": "fly"})
    with pytest.raises(ValueError, match="unknown action space"):
        action_space("doom")


def test_mineworld_ids_are_its_vocabulary():
    """MineWorld's ids (its mcdataset.py, minus the 8,192 codes): buttons use 0 ... hotbar.9 22, cam_0 (pitch)
    23-43, cam_1 (yaw) 44-64, <act_bos> 65, <null_act> 66, <act_eos> 67; written out, not derived."""
    space = action_space("mineworld")
    assert space.n_a == 11 and space.vocab_size == 70
    assert space.encode({}) == [65, 23 + 10, 44 + 10, 66, 66, 66, 66, 66, 66, 66, 67]
    ids = space.encode({"camera": (-1.95, 90.0), "hotbar": 7, "back": 1, "right": 1, "sneak": 1, "attack": 1,
                        "jump": 1, "pickItem": 1})
    assert ids == [65, 23 + 9, 44 + 20, 20, 3, 5, 7, 1, 6, 11, 67]
    ids = space.encode({"forward": 1, "back": 1, "left": 1, "sprint": 1, "use": 1, "drop": 1, "hotbar": 1})
    assert ids == [65, 33, 54, 14, 66, 4, 8, 0, 66, 9, 67]  # forward+back pressed together: null


def test_mineworld_and_vpt_carry_the_same_actions():
    vpt, mw, rng = VPTActions(), action_space("mineworld"), np.random.default_rng(1)
    for _ in range(200):
        ids = [off + int(rng.integers(0, n)) for off, (_, n) in zip(VPT_OFFSETS, VPT_SLOTS)]
        ids[0], ids[-1] = 0, 70
        action = vpt.decode(ids)
        assert mw.decode(mw.encode(action)) == action and vpt.encode(mw.decode(mw.encode(action))) == ids
    for bad in ([0] * 11, [65, 33, 54, 66, 66, 66, 66, 66, 66, 66, 66], [65, 33, 54, 0, 66, 66, 66, 66, 66, 66, 67],
                [65, 33, 54, 66, 0, 66, 66, 66, 66, 66, 67]):
        with pytest.raises(ValueError):
            mw.decode(bad)


def test_a_new_action_space_is_one_class_the_tools_ask():
    """Labels under frames, actions by name in prompts and play, the IDM's names: each asks the data's action space
    (its `names`, `label`, `encode_name`), none tests for a space by name, so a new data source adds its class to
    ACTION_SPACES and nothing else."""
    import torch

    from mcar.idm.scores import action_names
    from mcar.sampling.play_server import named_actions
    from mcar.sampling.prompts import parse_action
    from mcar.tokenizer import actions
    from mcar.tokenizer.actions import ActionSpace
    from mcar.tokenizer.pictures import action_labels, data_action_space

    class Doom(ActionSpace):
        n_a, vocab_size, names, moves = 1, 3, ("stand", "turn", "fire"), ("turn",)

    spaces = {**actions.ACTION_SPACES, "doom": Doom}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(actions, "ACTION_SPACES", spaces)
        data = {"name": "doom_maps", "actions": "doom"}
        assert data_action_space(data) == "doom"
        assert action_labels(torch.tensor([[2], [0], [7]]), "doom") == ["fire", "stand", "a=7"]
        assert action_names(data, 3) == {0: "stand", 1: "turn", 2: "fire"}
        assert parse_action("fire", "doom", 1) == [2] and parse_action(1, "doom", 1) == [1]
        assert named_actions("doom") == {"stand": [0], "turn": [1], "fire": [2]}
        with pytest.raises(ValueError, match="unknown action 'jump'; the actions: stand, turn, fire"):
            parse_action("jump", "doom", 1)
    # the shipped spaces: Crafter names its 17 actions; VPT's label pressed keys and take ids, not names
    assert named_actions("crafter")["do"] == [5] and action_space("crafter").label([1]) == "move_left"
    assert action_labels(torch.tensor([[0]]), "crafter") == ["noop"]
    vpt = action_space("vpt")
    assert vpt.names is None and vpt.label(vpt.encode({"forward": 1, "camera": (0, 30)})) == "forward cam+0,+28"
    with pytest.raises(ValueError, match="no action names: give actions as 11 ids"):
        vpt.encode_name("forward")
