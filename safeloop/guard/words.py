"""The words the guard's messages use for the caller's code: the Trainer's, or a plain loop's.

A message is built from fixed parts and these; the caller that drives the guard chooses them
(``Guard(words=...)``, or ``guard.words = ...`` on a guard another caller made).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Words:
    """How messages name the code that makes a step's losses, and the fixes in it."""

    place: str  # the code that builds a step's losses: "recompute it inside {place}"
    before: str  # where a tensor built before training was made
    trace: str  # how to turn anomaly mode on
    retain: str  # a backward that retains the graph
    once: str  # the fix for a second backward on a graph already consumed
    twice: str  # the fix for backward on one loss twice (never retain_graph: the gradient would be added twice)
    shared: str  # the fix for several different losses sharing one graph
    consumed_by: str  # who consumed the graph before the guard saw the loss


TRAINER = Words(
    place="training_step",
    before="in __init__, at module level or before fit",
    trace="set guard.trace=true (anomaly mode)",
    retain="self.backward(loss, ..., retain_graph=True)",
    once="do not call loss.backward() in training_step: return the loss and the Trainer runs backward (or drive the "
         "step yourself with self.backward / self.step)",
    twice="do not call backward on the same loss twice, nor in training_step; return the loss",
    shared="if several losses share a graph, return them together as a dict and the Trainer retains the graph where "
           "needed",
    consumed_by="training_step, a hook or an earlier loss called backward on it",
)

MANUAL = Words(  # the Trainer in manual mode: training_step calls self.backward itself
    place="training_step",
    before=TRAINER.before,
    trace=TRAINER.trace,
    retain="self.backward(loss, ..., retain_graph=True)",
    once="call self.backward once on each loss, and no loss.backward() in training_step: a second backward on it "
         "adds the same gradient again",
    twice="call self.backward once on each loss: delete the second (run with retain_graph=True, it would add the "
          "same gradient again)",
    shared="if several losses share a graph (one forward, each optimizer's loss), pass retain_graph=True to every "
           "self.backward through it but the last",
    consumed_by="an earlier self.backward (or a loss.backward() in training_step) of the step ran",
)

LOOP = Words(
    place="the loop",
    before="before the loop",
    trace="pass trace=True to GraphGuard (python -m safeloop.watch --trace; anomaly mode)",
    retain="loss.backward(retain_graph=True)",
    once="call backward once per loss: a second backward on it adds the same gradient to .grad again",
    twice="call backward once on each loss: delete the second backward on it (made to run with retain_graph=True, "
          "it would add the same gradient to .grad again)",
    shared="retain the graph only for a second, different loss through it: then pass retain_graph=True to every "
           "backward but the last",
    consumed_by="an earlier backward of the step ran",
)
