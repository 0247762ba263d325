"""The tile-exact VQ sees every tile: each texture Crafter can draw at 16 px a tile (mcar.crafter.textures,
drawn by Crafter's own renderer) has a code of its own in the committed vq_crafter_tiles_all (vq=tiles_all), decoding
back to it. The first VQ, vq_crafter_tiles (k-means over training patches, the shipped models' until they are
retrained), fails it: 209 of the 252 textures share 40 codes, the furnace the path's."""
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from mcar.crafter.textures import ASLEEP, EMPTY_SLOT, OUTSIDE, tile_textures
from mcar.tokenizer.vq_model import decode_tokens, encode_tokens, load_vq, to_uint8

ASSET = Path(__file__).parents[1] / "mcar" / "assets" / "vq_crafter_tiles_all"
UNIT = 16


@pytest.fixture(scope="module")
def textures() -> dict[str, np.ndarray]:
    return tile_textures(UNIT)


def patches(frames: np.ndarray) -> np.ndarray:
    """(T, H, W, 3) -> (T h w, UNIT, UNIT, 3): the frame's tiles."""
    T, H, W, _ = frames.shape
    return frames.reshape(T, H // UNIT, UNIT, W // UNIT, UNIT, 3).transpose(0, 1, 3, 2, 4, 5).reshape(-1, UNIT, UNIT, 3)


def test_every_texture_crafter_draws_has_its_own_code_that_decodes_to_it(textures):
    """Fails on any two textures that share a code (a furnace that reads as a path tile) and on any whose code does
    not decode back to it within one grey level."""
    vq = load_vq(ASSET)
    names = list(textures)
    tiles = torch.from_numpy(np.stack([textures[n] for n in names]))
    ids = encode_tokens(vq, tiles).view(-1)
    by_code = defaultdict(list)
    for name, i in zip(names, ids.tolist()):
        by_code[i].append(name)
    shared = {i: n for i, n in by_code.items() if len(n) > 1}
    assert not shared, (f"{sum(map(len, shared.values()))} of {len(names)} textures share {len(shared)} codes "
                        f"({len(by_code)} distinct codes): {shared}")
    err = (to_uint8(decode_tokens(vq, ids.view(-1, 1, 1))).int() - tiles.int()).abs().flatten(1).amax(1)
    off = {n: int(e) for n, e in zip(names, err) if e > 1}
    assert not off, f"textures whose code decodes elsewhere (max error, grey levels): {off}"


def test_the_list_is_every_texture_the_game_draws(textures):
    """Materials, each creature in each pose on each ground it can stand on, the sleeping world, every item at
    every amount: 252 tiles, all different."""
    assert len(textures) == 252 and len({t.tobytes() for t in textures.values()}) == 252
    assert all(t.shape == (UNIT, UNIT, 3) and t.dtype == np.uint8 for t in textures.values())
    for name in ("furnace", "table", "lava", "diamond", OUTSIDE, EMPTY_SLOT, "player-left on lava",
                 "skeleton on grass", "arrow-down on water", "plant-ripe on grass", "sapling 9", "iron_sword 1",
                 f"{ASLEEP}player-sleep on sand", f"{ASLEEP}furnace", f"{ASLEEP}zombie on path"):
        assert name in textures, name
    assert not (textures[EMPTY_SLOT]).any() and (textures[OUTSIDE] == 127).all()
    assert not any("player-sleep" in n and not n.startswith(ASLEEP) for n in textures)  # asleep: the world greys


def test_real_frames_hold_only_listed_tiles(textures):
    """Frames Crafter draws in play at noon, in data=crafter_tiles' 24x14 view and (the same world) in
    crafter_tiles_world's 9x9 view (2 item rows), the world greyed while the player sleeps included, are made of
    listed tiles only."""
    import crafter

    known = {t.tobytes() for t in textures.values()}
    env = crafter.Env(area=(32, 32), size=(384, 224), view=(24, 14), seed=11)  # a small world: quick to generate
    env._update_time = lambda: setattr(env._world, "daylight", 1.0)  # data.daylight=1, as crafter_gen pins it
    frames = [env.reset()]
    small = crafter.Env(size=(144, 144), view=(9, 9))  # its renderer only, drawing env's world and player
    small._world = small._local_view._world = env._world
    rng = np.random.default_rng(0)
    for t in range(24):
        if t == 16:
            env._player.inventory["energy"] = 3  # tired: the next sleep action puts it to sleep
        obs, _, done, _ = env.step(6 if t >= 16 else int(rng.integers(0, 17)))
        small._player = env._player
        frames += [obs, small.render()]
        if done:
            break
    assert env._player.sleeping and frames[-1].shape == (144, 144, 3)
    unknown = sum(1 for f in frames for p in patches(f[None]) if p.tobytes() not in known)
    assert not unknown, f"{unknown} tiles of real frames are not listed"


def test_creature_codes_are_the_creatures_own(textures):
    """The world tests count creatures by code (mcar.crafter.textures.creature_codes): the every-tile VQ gives each
    creature texture a code of its own; the first VQ codes a zombie on a path as something else too, and the
    sleeping world's creatures (so they go uncounted, and are named)."""
    from mcar.crafter.textures import CREATURES, creature_codes

    codes, hidden = creature_codes(load_vq(ASSET), textures)
    creatures = [n for n in textures if n.removeprefix(ASLEEP).split(" on ")[0] in CREATURES]
    assert len(creatures) == 18 and hidden == [] and len(codes) == 18
    codes, hidden = creature_codes(load_vq(ASSET.parent / "vq_crafter_tiles"), textures)
    assert "zombie on path" in hidden and "cow on grass" not in hidden and 0 < len(codes) < 18
