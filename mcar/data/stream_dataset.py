"""LitData's StreamingDataset handing out clips (imported only when a stream is read: LitData is optional)."""
from __future__ import annotations

import litdata.helpers
from litdata import StreamingDataLoader, StreamingDataset

# LitData asks PyPI for a newer version (30 s timeout) whenever a dataset is made or optimize starts: nothing to
# ask from an offline cluster node, and the answer is no concern of a training run
litdata.helpers._get_newer_version = lambda current_version: None


class ClipStream(StreamingDataset):
    """A stream's items turned into clips by `to_clip` (mcar.data.stream.StreamClips), in the loader's workers."""

    def __init__(self, input_dir: str, to_clip, **kw):
        super().__init__(input_dir, **kw)
        self.to_clip = to_clip

    def __getitem__(self, index):
        return self.to_clip(super().__getitem__(index))


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
