"""Every tile Crafter can draw at a tile size, as it appears in a frame: the codes a tile-exact patch VQ must have.

`tile_textures(16)` draws, with Crafter's own renderer (crafter.Env.render: its nearest-neighbour resizing, its
alpha blending of objects onto the tile under them, its inventory layout, its sleep filter), one tile of each thing
the game can show at data.daylight=1 (data=crafter_tiles, crafter_tiles_small, crafter_tiles_world), named by what
it shows:

- map tiles (awake): each of Crafter's 12 materials; "outside the world" (the grey Crafter fills beyond its map
  with); every object texture over every ground the game lets that object stand on, from Crafter's own rules:
  the player in its four poses on grass / sand / path and on lava (the frame of its death), cow, zombie and
  skeleton on grass / sand / path (Object.walkable: they spawn on grass or path and walk onto all three), the
  four arrows on grass / sand / path / water / lava (Arrow.walkable), the plant young and ripe on grass (where a
  sapling is placed; nothing changes the ground under an object);
- the same map tiles asleep (prefix "asleep: "): while the player sleeps Crafter greys and tints the whole map, and
  draws the player as player-sleep (on grass / sand / path), the only pose it has then;
- inventory tiles: each of the 16 items with each amount 1-9 drawn over it (Crafter clamps every item at 9, so
  its "unknown" amount texture for >= 10 is never drawn), and the empty slot (black). Inventory tiles are never
  tinted.

Not drawn, so not here: fence (no action places one), plant-young, player, log, leaves, debug* and unknown (no
code path draws them at any time). Crafter's day-night cycle (data.daylight=null) changes every tile's pixels by
a light level that varies step by step (and adds random noise at night): no finite list covers it, and the tile
VQ is for the pinned light only.
"""
from __future__ import annotations

import numpy as np
import torch

from mcar.tokenizer.vq_model import encode_tokens

OUTSIDE = "outside the world"
EMPTY_SLOT = "empty slot"
ASLEEP = "asleep: "


def _cut(frame: np.ndarray, unit: int, x: int, y: int) -> np.ndarray:
    return frame[y * unit:(y + 1) * unit, x * unit:(x + 1) * unit].copy()


def _creature(objects, world, player, kind: str, pos, facing=None, ripe: bool = False, sleeping: bool = False):
    """One of Crafter's objects at pos, in the pose asked for."""
    if kind == "player":
        obj = objects.Player(world, pos)
        obj.facing, obj.sleeping = facing, sleeping
    elif kind == "arrow":
        obj = objects.Arrow(world, pos, facing)
    elif kind == "plant":
        obj = objects.Plant(world, pos)
        obj.grown = 301 if ripe else 0  # Plant.ripe: grown > 300
    elif kind == "cow":
        obj = objects.Cow(world, pos)
    else:
        obj = {"zombie": objects.Zombie, "skeleton": objects.Skeleton}[kind](world, pos, player)
    return obj


def tile_textures(unit: int = 16, view: tuple[int, int] = (24, 14)) -> dict[str, np.ndarray]:
    """-> {name: (unit, unit, 3) uint8} of every tile Crafter draws at `unit` pixels a tile at noon (module doc),
    each cut from a frame rendered by crafter.Env.render at view (W, H) tiles (the local view must leave room for
    the 60 map tiles: 24x14 does). Names: "grass", "cow on sand", "asleep: arrow-up on water", "wood 3",
    "outside the world", "empty slot". 252 tiles, all different at unit 16 (tests/test_tile_vq.py)."""
    import crafter
    from crafter import constants, objects

    vw, vh = (int(v) for v in view)
    env = crafter.Env(size=(unit * vw, unit * vh), view=(vw, vh), seed=0)
    grid = np.array(env._local_view._grid)  # the map's (w, h) in tiles, the player drawn at grid // 2
    offset = grid // 2
    free = [(x, y) for y in range(int(grid[1])) for x in range(int(offset[0]), int(grid[0]))
            if (x, y) != tuple(offset)]  # the view's cells inside the world, the player's own left out
    out: dict[str, np.ndarray] = {}
    for sleeping, cells in _map_cells(objects, constants):
        if len(cells) > len(free):
            raise ValueError(f"view={list(view)}: {len(cells)} map tiles to draw, room for {len(free)}")
        player = _draw_map_tiles(env, objects, cells, free, sleeping, unit, out)
    _draw_inventory_tiles(env, player, constants, unit, vw, int(grid[1]), out)
    return out


def _map_cells(objects, constants) -> list[tuple[bool, list]]:
    """-> [(sleeping, [(material, creature kind or None, creature kwargs)])]: every material and every creature on
    every ground it can stand on, for an awake player's map and again for an asleep one's (greyed)."""
    walkers = list(objects.Object.walkable.fget(None))  # grass, sand, path: cows, zombies, skeletons (Object.move)
    player_grounds = list(objects.Player.walkable.fget(None))  # + lava: the player steps on it and dies there
    arrow_grounds = list(objects.Arrow.walkable)  # + water, lava
    plant_grounds = list(constants.place["plant"]["where"])  # grass
    facings = [(-1, 0), (+1, 0), (0, -1), (0, +1)]
    creatures = [(g, "player", {"facing": f}) for f in facings for g in player_grounds]
    others = [(g, k, {}) for k in ("cow", "zombie", "skeleton") for g in walkers]
    others += [(g, "arrow", {"facing": f}) for f in facings for g in arrow_grounds]
    others += [(g, "plant", {"ripe": r}) for r in (False, True) for g in plant_grounds]
    materials = [(m, None, {}) for m in constants.materials]
    sleepers = [(g, "player", {"facing": (0, 1), "sleeping": True}) for g in walkers]  # asleep means alive
    return [(False, materials + creatures + others), (True, materials + sleepers + others)]


def _draw_map_tiles(env, objects, cells: list, free: list, sleeping: bool, unit: int, out: dict):
    """Places `cells` on the view's free cells of a fresh world, renders once and cuts each tile into `out`.
    -> the player (its inventory is drawn next)."""
    world = env._world
    offset = np.array(env._local_view._grid) // 2
    centre = np.array([0, int(offset[1])])  # the player at world x = 0: the view's left part is outside the world
    world.reset(seed=0)
    world.daylight = 1.0  # data.daylight=1 (Env.render reads world.daylight; nothing steps the clock here)
    world._mat_map[:] = world._mat_ids["grass"]
    player = objects.Player(world, centre)
    player.sleeping = sleeping  # Crafter greys the whole map while its player sleeps
    world.add(player)
    env._player = player
    placed = []
    for (cx, cy), (material, kind, kw) in zip(free, cells):
        pos = centre + np.array([cx, cy]) - offset
        world[pos] = material
        obj = None if kind is None else _creature(objects, world, player, kind, pos, **kw)
        if obj is not None:
            world.add(obj)
        placed.append(((cx, cy), material, obj))
    frame = env.render()
    prefix = ASLEEP if sleeping else ""
    for (cx, cy), material, obj in placed:
        out[prefix + (material if obj is None else f"{obj.texture} on {material}")] = _cut(frame, unit, cx, cy)
    out[prefix + OUTSIDE] = _cut(frame, unit, 0, 0)
    return player


def _draw_inventory_tiles(env, player, constants, unit: int, vw: int, top: int, out: dict) -> None:
    """The inventory, below the map and never tinted: every item at every amount Crafter allows (its max, 9), and
    the slot of an item at 0 (not drawn: black)."""
    items = list(constants.items)
    for amount in range(0, max(int(v["max"]) for v in constants.items.values()) + 1):
        player.inventory = {k: min(amount, int(constants.items[k]["max"])) for k in items}
        frame = env.render()
        for i, item in enumerate(items):
            tile = _cut(frame, unit, i % vw, top + i // vw)
            out[f"{item} {player.inventory[item]}" if amount else EMPTY_SLOT] = tile


CREATURES = ("cow", "zombie", "skeleton")  # Crafter's creatures (arrows are shots, the player is not counted)


def creature_codes(vq, textures: dict) -> tuple[torch.Tensor, list[str]]:
    """The codes the VQ gives Crafter's creatures and nothing else, from the game's own textures
    (tile_textures at the data's tile size: each creature on each ground, awake or
    asleep) -> (codes, the creature textures whose code some other texture shares too: creatures the VQ cannot
    tell from the ground, uncounted)."""
    names = list(textures)
    ids = encode_tokens(vq, torch.from_numpy(np.stack([textures[n] for n in names])).to(vq.device)).view(-1).tolist()
    creature = [n.removeprefix(ASLEEP).split(" on ")[0] in CREATURES for n in names]
    other = {i for i, c in zip(ids, creature) if not c}
    codes = sorted({i for i, c in zip(ids, creature) if c} - other)
    return torch.tensor(codes, dtype=torch.long), [n for n, i, c in zip(names, ids, creature) if c and i in other]
