"""Transcriptions of DeepSpeed behaviour that tests compare jzero against (no DeepSpeed import)."""

from __future__ import annotations


class DeepSpeedDynamicLossScaler:
  """``DynamicLossScaler.update_scale`` of deepspeed/runtime/fp16/loss_scaler.py, without logging."""

  def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis,
               raise_error_at_min_scale=True):
    self.cur_scale = init_scale
    self.cur_iter = 0
    self.last_overflow_iter = -1
    self.scale_factor = 2.0
    self.scale_window = scale_window
    self.min_scale = min_scale
    self.delayed_shift = delayed_shift
    self.cur_hysteresis = delayed_shift
    self.consecutive_hysteresis = consecutive_hysteresis
    self.raise_error_at_min_scale = raise_error_at_min_scale

  def update_scale(self, overflow):
    if overflow:
      if self.delayed_shift == 1 or self.cur_hysteresis == 1:
        if (self.cur_scale == self.min_scale) and self.raise_error_at_min_scale:
          raise Exception(
            "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
        else:
          self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
      else:
        self.cur_hysteresis -= 1
      self.last_overflow_iter = self.cur_iter
    else:
      if self.consecutive_hysteresis:
        self.cur_hysteresis = self.delayed_shift
      stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
      if (stable_interval > 0) and (stable_interval % self.scale_window == 0):
        if not self.consecutive_hysteresis:
          self.cur_hysteresis = self.delayed_shift
        self.cur_scale *= self.scale_factor
    self.cur_iter += 1
