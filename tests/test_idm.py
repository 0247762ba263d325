"""The inverse-dynamics model over frozen VQ code vectors: shapes, the saved codebook, a seeded tiny training on
code grids whose action is a known shift, and the per-action precision / recall columns of evaluate."""
import pytest
import torch

from mcar.eval.action_following import load_idm
from mcar.idm.model import InverseDynamics, random_codebook, save_idm
from mcar.idm.scores import action_pr, data_moves, pr_keys
from mcar.tokenizer.actions import CrafterActions
from mcar.train.idm_training import fit

NAMES = {0: "noop", 1: "move_left", 2: "move_right", 3: "move_up", 4: "move_down"}
MOVES = CrafterActions().moves
PR_COLUMNS = pr_keys(MOVES)


def test_forward_on_tiny_shapes_and_the_codebook_is_frozen_and_saved(tmp_path):
    cb = random_codebook(16, 4, seed=1)
    idm = InverseDynamics(16, 2, 5, hidden=8, max_shift=(1, 2), grid=(2, 2), codebook=cb)
    a, b = torch.randint(0, 16, (3, 4, 5)), torch.randint(0, 16, (3, 4, 5))
    assert idm(a, b).shape == (3, 2, 5) and idm.predict(a, b).shape == (3, 2)
    assert idm.config["dim"] == 4 and torch.equal(idm.codebook, cb)
    assert "codebook" not in dict(idm.named_parameters())  # a buffer: never trained
    corr = idm.correlation(cb[a].permute(0, 3, 1, 2), cb[b].permute(0, 3, 1, 2))  # (3, 3 * 5, 4, 5)
    centre = (2 * 1 + 1) * (2 * 2 + 1) // 2  # shift (0, 0): the cosine of the same position's codes
    assert corr.shape == (3, 15, 4, 5) and torch.allclose(corr[:, centre], (cb[a] * cb[b]).sum(-1), atol=1e-6)
    save_idm(idm.eval(), tmp_path / "idm.pt", {"tokens": "t"})
    back = load_idm(str(tmp_path / "idm.pt"))
    assert torch.equal(back.codebook, cb) and torch.equal(back.predict(a, b), idm.predict(a, b))
    with pytest.raises(ValueError, match="not codebook_size=15"):
        InverseDynamics(15, 1, 5, codebook=cb)


def test_an_old_token_id_idm_file_is_unavailable_with_the_reason(tmp_path):
    torch.save({"config": dict(codebook_size=16, n_a=1, action_vocab_size=5, dim=4, hidden=8),
                "state_dict": {"embed.weight": torch.zeros(16, 4)}, "meta": {}}, tmp_path / "old.pt")
    assert "retrain" in load_idm(str(tmp_path / "old.pt")).reason


def shifted_pairs(n: int, g: torch.Generator, K: int = 32, h: int = 6, w: int = 8):
    """Random code grids and the grid after a known action: noop, or a one-token roll left / right / up / down."""
    a = torch.randint(0, K, (n, h, w), generator=g)
    act = torch.randint(0, 5, (n, 1), generator=g)
    shift = {0: (0, 0), 1: (0, 1), 2: (0, -1), 3: (1, 0), 4: (-1, 0)}  # moving left: the view's content goes right
    b = torch.stack([x.roll(shift[int(y)], (0, 1)) for x, y in zip(a, act[:, 0])])
    return a, b, act


def test_a_seeded_tiny_training_reads_a_shift_from_the_code_vectors():
    g = torch.Generator().manual_seed(0)
    train, val = shifted_pairs(256, g), shifted_pairs(100, g)
    torch.manual_seed(0)
    idm = InverseDynamics(32, 1, 5, hidden=16, max_shift=(1, 1), grid=(2, 2), codebook=random_codebook(32, 8))
    history = fit(idm, train, val, NAMES, steps=60, batch_size=32, lr=3e-3, weight_decay=0.05, eval_every=30,
                  moves=MOVES)
    assert [h["step"] for h in history] == [30, 60]
    assert history[-1]["val_accuracy"] >= 0.95 and history[-1]["val_moves"] >= 0.95  # measured 1.00 (from step 20)


def test_per_action_precision_and_recall_by_hand():
    pred = torch.tensor([[1], [1], [2], [0], [3], [1]])
    true = torch.tensor([[1], [2], [2], [1], [0], [0]])
    pr = action_pr(pred, true, NAMES, MOVES)
    assert list(pr) == PR_COLUMNS
    # move_left: predicted 3 times (right once), true twice (found once); move_right: predicted once (right),
    # true twice; move_up: predicted once (wrong), never true; move_down: neither
    assert pr == {"prec_move_left": 1 / 3, "rec_move_left": 1 / 2, "prec_move_right": 1.0, "rec_move_right": 1 / 2,
                  "prec_move_up": 0.0, "rec_move_up": None, "prec_move_down": None, "rec_move_down": None}
    assert set(action_pr(pred, true, {0: "0", 1: "1"}, MOVES).values()) == {None}  # names without those moves
    assert action_pr(pred, true, {0: "0", 1: "1"}, ()) == {}  # data without movement actions: no columns
    assert data_moves({"name": "crafter"}) == MOVES and data_moves({"name": "synthetic"}) == ()


def test_the_results_table_has_the_precision_recall_columns(tmp_path):
    from mcar.eval.metric_registry import csv_keys
    from mcar.eval.reporting import read_table, write_table

    row = {"model": "m", "sampler": "ntp", **dict.fromkeys(PR_COLUMNS), "prec_move_left": 0.5, "rec_move_left": 1.0,
           "rec_move_up": 0.25, "notes": ""}
    assert set(PR_COLUMNS) <= set(csv_keys([row])) and not set(PR_COLUMNS) & set(csv_keys())
    write_table([row], tmp_path)
    md = (tmp_path / "results.md").read_text().splitlines()
    head = [c.strip() for c in md[0].strip("|").split("|")]
    cells = dict(zip(head, (c.strip() for c in md[2].strip("|").split("|"))))
    assert [c for c in head if c.endswith("P/R")] == [f"{m} P/R" for m in MOVES]
    assert cells["move_left P/R"] == "0.50/1.00" and cells["move_up P/R"] == "n/a/0.25"
    assert cells["move_right P/R"] == "n/a/n/a"
    back = read_table(tmp_path / "results.csv")[0]
    assert back["prec_move_left"] == 0.5 and back["rec_move_up"] == 0.25 and back["prec_move_up"] is None
