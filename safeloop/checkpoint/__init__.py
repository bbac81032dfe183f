"""Checkpoints: what a run saves to go on exactly where it stopped, and the files that hold it.

What a checkpoint holds is listed by ``Trainer.state_dict()`` / ``Trainer.load_state_dict()``;
this package writes and reads it. A checkpoint is one ``torch.save`` file,
``<dir>/step-000001000.pt``, holding only tensors and plain containers, so that it loads with
``torch.load(weights_only=True)``, and sealed with the SHA-256 of its bytes in the zip's comment.

Exact resume rests on two things: everything that decides the next step is in the file, and
the interrupted epoch goes on where it stopped. A data iterable with ``state_dict()`` /
``load_state_dict()`` (torchdata's ``StatefulDataLoader``, the recipes' batch makers) keeps
its own position: its state is saved and loaded, and it goes on from there. Any other is
re-drawn from the RNG states its epoch started with, then fast-forwarded past the batches
already consumed (``fast_forward``), so a shuffled epoch continues in the same order.

One module a concern:

- ``files``: a file written atomically and sealed (``atomic_save``), read only once verified (``load``);
- ``directory``: the ``Checkpointer``: when a save is due, which files are kept, which one a run resumes from;
- ``locks``: a run's directories held for it alone (``take``);
- ``contents``: what the Trainer's parts put in a checkpoint (``collect``) and take back (``restore``);
- ``position``: the RNG states and where the data stands (``fast_forward``);
- ``stop``: SIGTERM / SIGINT and the run's own stop requests (``StopRequest``, ``stop_signals``).
"""
from .contents import (Parts, attributes, check_added, collect, named_parameters, read_modules, restore, rng_for,
                       versions, warn_unsaved, with_outside)
from .directory import Checkpointer, configured
from .files import FORMAT, atomic_save, is_rank_zero, load
from .locks import holder, lock, release, run_dir_in_use, take
from .position import epoch_start, fast_forward, load_data, rng_state, set_generators, set_rng_state, stateful
from .stop import StopRequest, stop_signals

__all__ = ["FORMAT", "Checkpointer", "Parts", "StopRequest", "atomic_save", "attributes", "check_added", "collect",
           "configured", "epoch_start", "fast_forward", "holder", "is_rank_zero", "load", "load_data", "lock",
           "named_parameters", "read_modules", "release", "restore", "rng_for", "rng_state", "run_dir_in_use",
           "set_generators", "set_rng_state", "stateful", "stop_signals", "take", "versions", "warn_unsaved",
           "with_outside"]
