"""The IDM as evaluation takes it: idm=auto resolved to your own or the shipped model, loaded weights only, and
checked against the data it scores (mcar.idm holds the model and its scores; mcar.train.idm_training trains it)."""
from __future__ import annotations

from pathlib import Path

from mcar.eval.networks import Unavailable
from mcar.idm.model import InverseDynamics, StaleIDM, read_idm, tokens_name


def check_idm_fits(idm, datamodule, codebook_size: int, n_a: int, action_vocab_size: int):
    """The IDM, or Unavailable when it was trained on other tokens or another layout than the data's."""
    if isinstance(idm, Unavailable):
        return idm
    c, want = idm.config, tokens_name(datamodule)
    if (c["codebook_size"], c["n_a"], c["action_vocab_size"]) != (codebook_size, n_a, action_vocab_size):
        return Unavailable(f"the IDM was trained for codebook {c['codebook_size']}, n_a {c['n_a']}, "
                           f"{c['action_vocab_size']} actions, not this data's: retrain it (mcar idm)")
    have = idm.meta.get("tokens")
    if have and want and have != want:
        return Unavailable(f"the IDM was trained on {have}, the data is {want} (another VQ): retrain it "
                           f"(mcar idm)")
    return idm


def resolve_idm(value: str | None, checkpoint_root: str | Path, data_name: str) -> str | None:
    """evaluate's idm= -> a path: auto is <checkpoint_root>/idm-<data>/idm.pt (what `mcar idm` writes), else the
    shipped <checkpoint_root>/shipped/idm-<data>/idm.pt when there is one; anything else as given."""
    if value != "auto":
        return value
    own = Path(checkpoint_root) / f"idm-{data_name}" / "idm.pt"
    shipped = Path(checkpoint_root) / "shipped" / f"idm-{data_name}" / "idm.pt"
    return str(shipped if not own.is_file() and shipped.is_file() else own)


def load_idm(path: str | None, config_key: str = "idm") -> InverseDynamics | Unavailable:
    """The IDM saved by `mcar idm`, or Unavailable naming the path to train it to."""
    if not path:
        return Unavailable(f"no inverse-dynamics model: set {config_key}=/path/idm.pt (mcar idm)")
    if not Path(path).is_file():
        return Unavailable(f"inverse-dynamics model not found: {config_key}={path} (train it: mcar idm)")
    try:
        return read_idm(path)
    except StaleIDM as e:
        return Unavailable(f"{config_key}={e}")
