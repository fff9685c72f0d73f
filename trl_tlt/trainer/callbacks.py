"""`TLTGRPOTrainer`'s callbacks: drafter writes joined at the end of training, a graceful stop on SIGTERM."""

from __future__ import annotations

import os
import signal
import threading

import torch
from accelerate import Accelerator
from transformers import TrainerCallback
from transformers.utils import logging

from .stack import RolloutStack


logger = logging.get_logger(__name__)


class JoinDrafterWrites(TrainerCallback):
    """Finish the background drafter write before `train()` returns."""

    def __init__(self, stack: RolloutStack):
        self.stack = stack

    def on_train_end(self, args, state, control, **kwargs):
        self.stack.join_writes()


class GracefulStop(TrainerCallback):
    """SIGTERM (a preempted or cancelled job) ends training at the end of the current optimizer step, with a
    checkpoint of the policy and the drafter, instead of killing it mid-step. A second SIGTERM kills at once. Not
    installed where a SIGTERM handler is already set (the user's or a launcher's), or outside the main thread."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.requested = False
        self._installed = False

    def _handle(self, signum, frame):
        if self.requested:  # the second one: the default action (terminate)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        self.requested = True

    def on_train_begin(self, args, state, control, **kwargs):
        self.requested = False
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self._handle)
            self._installed = True

    def on_step_end(self, args, state, control, **kwargs):
        requested = self.requested
        accelerator = self.accelerator
        if accelerator.num_processes > 1:  # every rank stops at the same step, whichever got the signal
            flag = torch.tensor([float(requested)], device=accelerator.device)
            requested = bool(accelerator.reduce(flag, reduction="sum").item() > 0)
        if requested:
            logger.warning(f"SIGTERM: training stops after step {state.global_step} with a checkpoint.")
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._installed = False
