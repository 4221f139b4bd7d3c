"""Adam and AdamW on the host: the optimizer step on host numpy arrays, in place, over the cores.

ZeRO-Offload's optimizer step (DeepSpeed's ``DeepSpeedCPUAdam``): the fp32 master ``p`` and the
moments ``m``, ``v`` live in host memory; a step reads an fp32 gradient ``g`` and rewrites
``p``, ``m``, ``v`` in place in one pass per chunk -- 28 bytes moved per parameter, 30 when it
also writes the new parameter cast to bf16 / fp16 into an output buffer (the 16-bit params for
the device or the NVMe tier). Chunks run on a pool of ``threads`` threads (default: the cores
this process may use), each in a compiled, vectorised loop that holds no GIL
(:mod:`jzero.tiers.host_adam_kernel`).

**The numbers are jzero's device step's.** DeepSpeed's formula, with its ``adam_w_mode``
(decoupled weight decay) or L2 mode and ``bias_correction`` on or off::

    g' = g + wd p                      (L2 mode only)
    m  = b1 m + (1 - b1) g'
    v  = b2 v + (1 - b2) g'^2
    u  = (m / bc1) / (sqrt(v / bc2) + eps)      bc_i = 1 - b_i^step, or 1 without correction
    p  = p - lr (u + wd p)             (adam_w_mode; L2 mode: p - lr u)

computed with the operations, order, fused multiply-adds and float32 constants of the optax chain
jzero builds from the config (``jzero.train.optim``: ``scale_by_adam``, ``add_decayed_weights``,
``scale_by_learning_rate``, ``apply_updates``) as XLA:CPU compiles it at its default settings --
``x / bc`` as ``x * (1 / bc)``, ``b ** step`` by the C library's ``powf``, no decay at all for a
zero weight decay -- so it gives that chain's fp32 numbers and 16-bit casts bit for bit (tests),
except where a subnormal number occurs: XLA:CPU flushes those to zero, this kernel (like
DeepSpeed's) does not. Where XLA fuses other multiply-adds (LLVM level 0, another CPU, a GPU) the
two differ within float32's rounding of the formula's terms (tests bound it). DeepSpeed's own
kernel forms ``1 - b`` in float32 from the float32 ``b`` (for b2 = 0.999: 0.99998713e-3, where
optax rounds 1e-3), so its ``v`` is 1.3e-5 and its ``m`` about 2e-7 relatively off these;
it also skips a negative weight decay, which optax applies. Without bias correction (DeepSpeed's
``bias_correction: false``) the kernel uses 1 for both corrections; jzero's config path refuses
that setting (optax's Adam always corrects), so no device step has it to agree with.

**Backends.** ``numba`` (the ``host-adam`` extra: LLVM, inside numba's wheel, compiles the loop
for the host's CPU at its first call and caches it, so the user's machine needs no compiler);
without it ``xla``: the same formula jitted by XLA:CPU on copies of the arrays, copied back --
the device step's numbers, slower, announced by a warning that names the extra. docs/offload.md
has the measured speeds (``bench/host_adam.py``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import ml_dtypes
import numpy as np

from jzero.errors import ConfigError, JZeroError, JZeroWarning

__all__ = ["BACKENDS", "EXTRA", "HostAdamSettings", "HostAdam", "default_threads"]

BACKENDS = ("auto", "numba", "xla")
#: The optional-dependency group that brings numba (pyproject.toml).
EXTRA = "host-adam"
#: Elements per task: 4 MiB of each fp32 array, so a pool keeps its threads balanced while a
#: task's bookkeeping (microseconds) stays small beside its work (about a millisecond).
DEFAULT_CHUNK = 1 << 20
_OUT_DTYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


@dataclasses.dataclass(frozen=True)
class HostAdamSettings:
  """DeepSpeed's Adam parameters that stay fixed over a run (``lr`` and the step come per call).

  Attributes:
    betas: ``(b1, b2)``, the moments' decay rates.
    eps: added to ``sqrt(v_hat)`` (outside the square root, as torch and optax do).
    weight_decay: the decay factor ``wd``.
    adam_w_mode: decoupled weight decay (AdamW: ``p -= lr * wd * p``) if true, else L2 (``g +=
      wd * p`` before the moments). DeepSpeed's ``"AdamW"`` is always decoupled.
    bias_correction: divide the moments by ``1 - b ** step``.
  """

  betas: tuple[float, float] = (0.9, 0.999)
  eps: float = 1e-8
  weight_decay: float = 0.0
  adam_w_mode: bool = True
  bias_correction: bool = True

  def __post_init__(self):
    b1, b2 = self.betas
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
      raise ConfigError(f"HostAdamSettings.betas: each must lie in [0, 1), got {self.betas!r}.")
    if not self.eps >= 0.0:
      raise ConfigError(f"HostAdamSettings.eps: must be >= 0, got {self.eps!r}.")


def default_threads() -> int:
  """The cores this process may run on (its CPU affinity where the OS has one)."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class _Scalars:
  """One step's float32 constants, rounded as the optax chain rounds them."""

  b1: np.float32
  c1: np.float32  # float32(1 - b1), 1 - b1 formed in double precision as Python does
  b2: np.float32
  c2: np.float32
  r1: np.float32  # 1 / (1 - b1 ** step) in float32, or 1 without bias correction
  r2: np.float32
  eps: np.float32
  wd: np.float32
  neg_lr: np.float32


def _scalars(betas: tuple[float, float], eps: float, weight_decay: float, correct: bool,
             step: int, lr: float) -> _Scalars:
  f32 = np.float32
  b1, b2 = betas

  def inverse_correction(b: float) -> np.float32:
    if not correct:
      return f32(1.0)
    # numpy's float32 scalar power is the C library's powf, as XLA:CPU's is: f32(b) ** f32(step).
    with np.errstate(divide="ignore", over="ignore"):
      return f32(1.0) / (f32(1.0) - f32(b) ** f32(step))

  return _Scalars(b1=f32(b1), c1=f32(1 - b1), b2=f32(b2), c2=f32(1 - b2),
                  r1=inverse_correction(b1), r2=inverse_correction(b2), eps=f32(eps),
                  wd=f32(weight_decay), neg_lr=-f32(lr))


# -- the numba kernel --------------------------------------------------------------------------

_numba_lock = threading.Lock()


def _numba():
  """The numba kernel (:func:`jzero.tiers.host_adam_kernel.adam_chunk`), or None where numba is
  not installed; compiled at its first call, from numba's cache after that."""
  if importlib.util.find_spec("numba") is None:
    return None
  with _numba_lock:  # one thread imports it: numba's first import is not thread-safe
    from jzero.tiers import host_adam_kernel
  return host_adam_kernel.adam_chunk


# -- the XLA fallback --------------------------------------------------------------------------

def _xla_step(l2: bool, decoupled: bool, out_dtype, betas: tuple[float, float], eps: float,
              weight_decay: float):
  """The step as one jitted XLA:CPU function of (p, m, v, g, r1, r2, neg_lr) -> (p, m, v[, out]),
  written as the optax chain writes it: its Python-float constants stay constants, so XLA
  simplifies and fuses it as it does the device step."""
  import jax
  import jax.numpy as jnp

  b1, b2 = betas
  wd = weight_decay

  def step(p, m, v, g, r1, r2, neg_lr):
    if l2:
      g = g + wd * p
    m = (1 - b1) * g + b1 * m
    v = (1 - b2) * (g * g) + b2 * v
    u = (m * r1) / (jnp.sqrt(v * r2) + eps)
    if decoupled:
      u = u + wd * p
    p = p + neg_lr * u
    return (p, m, v) if out_dtype is None else (p, m, v, p.astype(out_dtype))

  return jax.jit(step)


# -- the optimizer -----------------------------------------------------------------------------

Arrays = np.ndarray | Sequence[np.ndarray]


class HostAdam:
  """DeepSpeed's CPU Adam / AdamW on host numpy arrays, in place, over ``threads`` threads.

  ``HostAdam(settings).step(p, m, v, g, step, lr, out_params=None)``: ``p`` (the fp32 master),
  ``m``, ``v`` (the moments) and ``g`` (the fp32 gradient) are float32 numpy arrays of one
  shape, or lists of them leaf by leaf; ``p``, ``m``, ``v`` are updated in place, so they are
  buffers the caller owns (``np.asarray`` of a jax array is a read-only view: refused). ``step`` is the
  1-based count of this update (DeepSpeed's ``state["step"]`` after its increment, optax's count
  plus one), ``lr`` the learning rate for it. ``out_params`` (bf16 or fp16 arrays of the same
  shapes) receives the new params cast with round-to-nearest-even. Calls on one instance run one
  at a time (a lock); :meth:`close` (or a ``with`` block) ends the worker threads.

  Args:
    settings: the fixed parameters; ``step`` may override ``betas``, ``eps``, ``weight_decay``
      per call, as DeepSpeed's ``adam_update`` takes them.
    threads: worker threads (default :func:`default_threads`).
    backend: ``"numba"`` (raises without the ``host-adam`` extra), ``"xla"``, or ``"auto"``:
      numba where installed, else XLA with a warning naming the extra.
    chunk: elements per task.
  """

  def __init__(self, settings: HostAdamSettings = HostAdamSettings(), *,
               threads: int | None = None, backend: str = "auto", chunk: int = DEFAULT_CHUNK):
    if backend not in BACKENDS:
      raise ConfigError(f"HostAdam backend: {backend!r} is not one of {', '.join(BACKENDS)}.")
    threads = default_threads() if threads is None else threads
    if not (isinstance(threads, int) and threads >= 1):
      raise ConfigError(f"HostAdam threads: must be a positive integer, got {threads!r}.")
    if not (isinstance(chunk, int) and chunk >= 1):
      raise ConfigError(f"HostAdam chunk: must be a positive integer, got {chunk!r}.")
    kernel = _numba() if backend in ("auto", "numba") else None
    if kernel is None and backend == "numba":
      raise JZeroError(
        f'HostAdam backend "numba": numba is not installed; install it with '
        f'pip install "jzero[{EXTRA}]", or pass backend="xla" (the same numbers, slower).')
    if kernel is None and backend == "auto":
      warnings.warn(
        f'HostAdam: numba is not installed, so the host Adam step runs in XLA:CPU (the same '
        f'numbers, slower: it copies the arrays in and out and does not scale with cores). '
        f'pip install "jzero[{EXTRA}]" for the fast path.', JZeroWarning, stacklevel=2)
    self.settings = settings
    self.threads = threads
    self.chunk = chunk
    self.backend = "numba" if kernel is not None else "xla"
    self._kernel = kernel
    self._pool: ThreadPoolExecutor | None = None
    self._xla: dict = {}
    self._lock = threading.Lock()

  # -- the public step ----------------------------------------------------------------------
  def step(self, params: Arrays, exp_avg: Arrays, exp_avg_sq: Arrays, grads: Arrays, step: int,
           lr: float, *, out_params: Arrays | None = None,
           betas: tuple[float, float] | None = None, eps: float | None = None,
           weight_decay: float | None = None) -> None:
    """One Adam step on every leaf, in place (see the class docstring)."""
    s = self.settings
    if betas is not None or eps is not None or weight_decay is not None:
      s = dataclasses.replace(s, betas=s.betas if betas is None else tuple(betas),
                              eps=s.eps if eps is None else eps,
                              weight_decay=s.weight_decay if weight_decay is None else weight_decay)
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
      raise ConfigError(f"HostAdam.step: step must be an integer >= 1 (the 1-based count of "
                        f"this update), got {step!r}.")
    if not math.isfinite(float(lr)):
      raise ConfigError(f"HostAdam.step: lr must be a finite number, got {lr!r}.")
    leaves = _leaves(params, exp_avg, exp_avg_sq, grads, out_params)
    scalars = _scalars(s.betas, s.eps, s.weight_decay, s.bias_correction, int(step), lr)
    # A zero weight decay is none at all, as optax.add_decayed_weights skips it.
    decoupled = s.weight_decay != 0 and s.adam_w_mode
    l2 = s.weight_decay != 0 and not s.adam_w_mode
    with self._lock:
      if self.backend == "numba":
        self._step_numba(leaves, scalars, l2, decoupled)
      else:
        self._step_xla(leaves, scalars, l2, decoupled, s)

  def close(self) -> None:
    """Stops the worker threads (a later step starts them again)."""
    with self._lock:
      if self._pool is not None:
        self._pool.shutdown()
        self._pool = None

  def __enter__(self) -> HostAdam:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- backends -----------------------------------------------------------------------------
  def _step_numba(self, leaves: list[tuple], k: _Scalars, l2: bool, decoupled: bool) -> None:
    kernel = self._kernel
    consts = (k.b1, k.c1, k.b2, k.c2, k.r1, k.r2, k.eps, k.wd, k.neg_lr, l2, decoupled)
    no_out = np.empty(0, np.uint16)
    tasks = []  # (p, m, v, g, out, bf16, fp16) per chunk
    for p, m, v, g, out in leaves:
      bf16 = out is not None and out.dtype == ml_dtypes.bfloat16
      fp16 = out is not None and out.dtype == np.float16
      bits16 = no_out if out is None else out.view(np.uint16)
      for lo in range(0, p.size, self.chunk):
        hi = min(lo + self.chunk, p.size)
        tasks.append((p[lo:hi], m[lo:hi], v[lo:hi], g[lo:hi],
                      no_out if out is None else bits16[lo:hi], bf16, fp16))
    if self.threads == 1 or len(tasks) == 1:
      for task in tasks:
        kernel(*task, *consts)
      return
    if self._pool is None:
      self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="jzero-host-adam")
    futures = [self._pool.submit(kernel, *task, *consts) for task in tasks]
    for future in futures:
      future.result()

  def _step_xla(self, leaves: list[tuple], k: _Scalars, l2: bool, decoupled: bool,
                s: HostAdamSettings) -> None:
    import jax

    for p, m, v, g, out in leaves:
      key = (l2, decoupled, None if out is None else out.dtype, s.betas, s.eps, s.weight_decay)
      if key not in self._xla:
        self._xla[key] = _xla_step(*key)
      with jax.default_device(jax.devices("cpu")[0]):
        results = self._xla[key](p, m, v, g, k.r1, k.r2, k.neg_lr)
      for target, result in zip((p, m, v, out), results):
        np.copyto(target, np.asarray(result))


def _leaves(params: Arrays, exp_avg: Arrays, exp_avg_sq: Arrays, grads: Arrays,
            out_params: Arrays | None) -> list[tuple]:
  """``[(p, m, v, g, out), ...]`` as flat views, after checking dtypes, shapes and layout."""
  single = isinstance(params, np.ndarray)
  groups = [params, exp_avg, exp_avg_sq, grads]
  if out_params is not None:
    groups.append(out_params)
  if single:
    groups = [[x] for x in groups]
  names = ("params", "exp_avg", "exp_avg_sq", "grads", "out_params")
  counts = {len(x) for x in groups}
  if len(counts) != 1:
    raise ConfigError(f"HostAdam.step: params, exp_avg, exp_avg_sq, grads (and out_params) must "
                      f"have as many leaves each; got {[len(x) for x in groups]}.")
  leaves = []
  for i, arrays in enumerate(zip(*groups)):
    shape = arrays[0].shape
    for name, x in zip(names, arrays):
      where = name if single else f"{name}[{i}]"
      if not isinstance(x, np.ndarray):
        raise ConfigError(f"HostAdam.step: {where} must be a numpy array, got "
                          f"{type(x).__name__}; pass host arrays (np.asarray(...)).")
      if x.shape != shape:
        raise ConfigError(f"HostAdam.step: {where} has shape {x.shape}, params {shape}.")
      if not x.flags.c_contiguous:
        raise ConfigError(f"HostAdam.step: {where} must be C-contiguous (np.ascontiguousarray).")
      wanted = ("bfloat16 or float16" if name == "out_params" else "float32")
      ok = x.dtype in _OUT_DTYPES if name == "out_params" else x.dtype == np.float32
      if not ok:
        raise ConfigError(f"HostAdam.step: {where} has dtype {x.dtype}; it must be {wanted}.")
      if name != "grads" and not x.flags.writeable:
        raise ConfigError(f"HostAdam.step: {where} is read-only; the step writes it in place.")
    for a in range(len(arrays)):
      for b in range(a + 1, len(arrays)):
        if np.may_share_memory(arrays[a], arrays[b]):
          suffix = "" if single else f"[{i}]"
          raise ConfigError(f"HostAdam.step: {names[a]}{suffix} and {names[b]}{suffix} share "
                            f"memory; each must be an array of its own.")
    p, m, v, g = (x.reshape(-1) for x in arrays[:4])
    out = arrays[4].reshape(-1) if len(arrays) == 5 else None
    leaves.append((p, m, v, g, out))
  return leaves
