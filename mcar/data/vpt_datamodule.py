"""Real VPT recordings: `python train.py data=vpt data.root=/path/to/vpt vq=amused vq.path=/path/to/vq`.

prepare_data() tokenises every <name>.mp4 + <name>.jsonl under `root` (resumable, skips damaged files with a
warning) into `tokens_root/tokens_<vq id>`, frames resized to the token grid (data.h, data.w) times the VQ's
downsampling (x16: 224x384); clips then come from those shards, split by episode.
"""
from __future__ import annotations

from pathlib import Path

from mcar.data.token_clips import TokenDataModule


class VPTDataModule(TokenDataModule):
    def __init__(self, root: str | None, tokens_root: str, vq_path: str | None = None, drop_null: bool = True,
                 drop_gui: bool = True, tokenize_batch: int = 16, actions: str = "vpt", **kw):
        """actions: the action ids, vpt (ours) or mineworld (MineWorld's, for its converted checkpoints)."""
        super().__init__(**kw)
        if actions not in ("vpt", "mineworld"):
            raise ValueError(f"data.actions={actions!r} is invalid: choose vpt or mineworld")
        from mcar.tokenizer.actions import action_space

        if action_space(actions).vocab_size != self.action_vocab_size:
            raise ValueError(f"data.action_vocab_size={self.action_vocab_size} but data.actions={actions} has "
                             f"{action_space(actions).vocab_size} action ids")
        self.actions = actions
        if not root:
            raise ValueError("data.root is required for data=vpt: the folder with VPT <name>.mp4 + <name>.jsonl")
        self.root, self.tokens_root, self.vq_path = Path(root), Path(tokens_root), vq_path
        self.drop_null, self.drop_gui, self.tokenize_batch = drop_null, drop_gui, tokenize_batch

    @property
    def tokens_dir(self) -> Path:
        from mcar.tokenizer.vq_model import vq_id

        filters = ("" if self.drop_null else "_keepnull") + ("" if self.drop_gui else "_keepgui")
        space = "" if self.actions == "vpt" else f"_{self.actions}"
        return self.tokens_root / f"tokens_{vq_id(self.vq_path).replace('@', '_')}{filters}{space}"

    def prepare_data(self) -> None:
        from mcar.data.tokenize import tokenize_dir
        from mcar.tokenizer.vq_model import frame_size, load_vq, vq_id

        if self.vq_path is None:
            print("warning: data=vpt with the small Crafter VQ; set vq.path to a VQ trained on Minecraft")
        vq = load_vq(self.vq_path)
        tokenize_dir(self.root, self.tokens_dir, "vpt", vq, vq_id(self.vq_path), self.tokenize_batch,
                     self.clip_frames, self.drop_null, self.drop_gui,
                     size=frame_size(vq, self.layout.h, self.layout.w),  # data.h, data.w x the VQ's downsampling
                     space=self.actions)
