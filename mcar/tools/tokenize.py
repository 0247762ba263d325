"""`mcar tokenize episodes=... out=... source=crafter|vpt size=[H,W]` (conf/tokenize.yaml): episodes -> token
shards + index (mcar/data/tokenize.py says what is written and how it resumes)."""
from mcar.data.tokenize import tokenize_dir
from mcar.hydra_app import compose_tool
from mcar.tokenizer.vq_model import check_frame_size, load_vq, vq_id


def main(argv: list[str] | None = None) -> None:
    c = compose_tool("tokenize", argv)
    vq = load_vq(c.vq)
    tokenize_dir(c.episodes, c.out, c.source, vq, vq_id(c.vq), int(c.batch), int(c.min_frames), not c.keep_null,
                 not c.keep_gui, int(c.rank), int(c.world), size=check_frame_size(vq, list(c.size), "size"))
