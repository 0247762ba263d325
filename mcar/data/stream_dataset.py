"""LitData's StreamingDataset handing out clips (imported only when a stream is read: LitData is optional)."""
from __future__ import annotations

import json
from pathlib import Path

import litdata.helpers
from litdata import StreamingDataLoader, StreamingDataset

from mcar.data.shards import ShardError

# What pack_stream writes per item (frames, actions, episode, start). LitData deserialises each field by the format
# its index.json names, and "pickle" runs whatever the file holds: a stream naming anything else is refused before
# a single item is read.
ITEM_FORMATS = ["numpy", "numpy", "str", "int"]

# LitData asks PyPI for a newer version (30 s timeout) whenever a dataset is made or optimize starts: nothing to
# ask from an offline cluster node, and the answer is no concern of a training run
litdata.helpers._get_newer_version = lambda current_version: None


class ClipStream(StreamingDataset):
    """A stream's items turned into clips by `to_clip` (mcar.data.stream.StreamClips), in the loader's workers."""

    def __init__(self, input_dir: str, to_clip, **kw):
        super().__init__(input_dir, **kw)  # reads index.json (downloaded into the cache for a remote stream)
        check_item_formats(Path(self.input_dir.path) / "index.json", input_dir)
        self.to_clip = to_clip

    def __getitem__(self, index):
        return self.to_clip(super().__getitem__(index))


def check_item_formats(index: Path, stream: str) -> None:
    """The stream's item fields must be the numpy arrays, string and int pack_stream writes, never pickles."""
    try:
        config = json.loads(index.read_text()).get("config")
        formats, loader = config.get("data_format"), config.get("item_loader")
    except (OSError, ValueError, AttributeError) as e:
        raise ShardError(f"{stream}: its index.json ({index}) is unreadable or has no config ({e}): pack the "
                         f"stream again with `mcar tokenize ... stream=`") from None
    if formats != ITEM_FORMATS or loader != "PyTreeLoader" or config.get("encryption"):
        raise ShardError(f"{stream}: its index.json declares item fields {formats} (loader {loader}), not the "
                         f"{ITEM_FORMATS} that pack_stream writes: refused, nothing was read (LitData would "
                         f"unpickle a 'pickle' field, which runs code); pack the stream again with `mcar tokenize`")


class ClipLoader(StreamingDataLoader):
    """LitData's loader, resumable across an epoch's end. LitData 0.2.44 replays the restored mid-epoch state until
    its dataset raises StopIteration, but Lightning ends an epoch after len(loader) batches without asking for one
    more: the next epoch of a resumed run replayed the old state past its end (IndexError in
    StreamingDataset._resume). An epoch whose batches were all yielded is over: the next iteration starts a fresh
    one, as in a run never stopped."""

    def __iter__(self):
        if self.restore and self._num_samples_yielded_streaming >= len(self) * self.batch_size:
            self.restore = False
        return super().__iter__()
