"""Training: loss, optimizer, TrainState, the step, its pmap/mesh wrappers and the loop."""

from jaxgpt.training.loop import TrainingDiverged, train
from jaxgpt.training.parallel import MeshRunner, PmapRunner, make_runner
from jaxgpt.training.step import (TrainState, chunked_cross_entropy, create_train_state, cross_entropy, decay_mask,
                                  init_train_state, lr_schedule, make_eval_step, make_optimizer, make_schedule,
                                  make_train_step)

__all__ = ["MeshRunner", "PmapRunner", "TrainState", "TrainingDiverged", "chunked_cross_entropy", "create_train_state",
           "cross_entropy", "decay_mask", "init_train_state", "lr_schedule", "make_eval_step", "make_optimizer",
           "make_runner", "make_schedule", "make_train_step", "train"]
