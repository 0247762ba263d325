"""`mcar tokenize episodes=... out=... source=recordings|crafter|vpt size=[H,W] [devices=8 num_nodes=4] [stream=...]`
(conf/tokenize.yaml): episodes -> token shards + index (mcar/data/tokenize.py says what is written and how it
resumes), one rank per device over the allocation (Lightning Fabric), then optionally a LitData stream of them
(mcar/data/stream.py)."""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from mcar.data.episodes import read_schema
from mcar.data.index import merged_index
from mcar.data.tokenize import tokenize_dir
from mcar.hydra_app import compose_tool
from mcar.tokenizer.vq_model import check_frame_size, load_vq, vq_id

# ranks wait for the slowest at the end: far longer than torch's 30-minute collective timeout at VPT scale
RANKS_WAIT = timedelta(days=3)


def fabric_for(c):
    import lightning as L
    from lightning.fabric.strategies import DDPStrategy

    many = int(c.devices) * int(c.num_nodes) > 1
    return L.Fabric(accelerator=c.accelerator, devices=int(c.devices), num_nodes=int(c.num_nodes),
                    strategy=DDPStrategy(timeout=RANKS_WAIT) if many else "auto")


def run(fabric, c) -> dict | None:
    """One rank's share (and its part of the index); then rank 0 sums the throughput, merges the ranks' parts into
    index.json and packs the stream. -> rank 0's summary (None on the others)."""
    import torch

    vq = load_vq(c.vq.path).to(fabric.device).eval()
    stats: dict = {}
    schema = read_schema(c.episodes) if c.source == "recordings" else None  # any game: its actions.yaml
    mine = tokenize_dir(c.episodes, c.out, c.source, vq, vq_id(c.vq.path), int(c.batch), int(c.min_frames),
                        not c.keep_null, not c.keep_gui, fabric.global_rank, fabric.world_size,
                        size=check_frame_size(vq, list(c.size), "size"), stats=stats, space=schema)
    rate = torch.tensor([stats["frames"], stats["seconds"]], dtype=torch.float64, device=fabric.device)
    every = fabric.all_gather(rate).reshape(-1, 2).cpu()  # waits for every rank: every part is written
    if fabric.global_rank != 0:
        return None
    frames, slowest = int(every[:, 0].sum()), float(every[:, 1].max())
    summary = {"devices": fabric.world_size, "device": str(fabric.device.type), "frames_encoded": frames,
               "seconds": round(slowest, 1), "frames_per_s": round(frames / slowest, 1) if slowest else 0.0,
               "frames_per_s_per_device": round(frames / slowest / fabric.world_size, 1) if slowest else 0.0}
    print(f"tokenised {frames} frames on {summary['devices']} {summary['device']} devices in {slowest:.1f} s: "
          f"{summary['frames_per_s']} frames/s, {summary['frames_per_s_per_device']} per device")
    index = merged_index(Path(c.out), mine["meta"], c.episodes)  # reads no shard: the ranks described theirs
    summary["episodes"], summary["frames"] = len(index["episodes"]), sum(e["frames"] for e in index["episodes"])
    if c.stream:
        from mcar.data.stream import pack_stream

        record = pack_stream(c.out, str(c.stream), int(c.stream_clip_frames),
                             int(c.stream_stride) if c.stream_stride else None, int(c.val_episodes))
        print(f"stream at {c.stream}: {record['train_clips']} training clips of {record['train_episodes']} "
              f"episodes, {record['val_clips']} validation clips")
    return summary


def main(argv: list[str] | None = None) -> None:
    c = compose_tool("tokenize", argv)
    fabric = fabric_for(c)
    fabric.launch(run, c)
