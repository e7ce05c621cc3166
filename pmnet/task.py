"""Procedural memory episodes: the controlled sequential same-address update task.

This module generates the data of Section 5 of the paper ("Controlled Sequential Same-Address
Update Task") following the appendix pseudocode ("Exact Memory-Episode Procedure"). Everything
is vectorised with numpy over episodes and returned as torch tensors in dataclasses.

Vocabulary
----------
The model is byte level (ids 0..255). Every token used here is a printable ASCII byte, so an
episode can be read as text with `decode`:

* address tokens      ``A B C D``   (`ADDRESS_TOKENS`, address index 0..3)
* rule-family tokens  ``+`` ADD10, ``*`` AFFINE10   (`FAMILY_TOKENS`, family index 0, 1)
* digits              ``0``..``9``  (`DIGIT_TOKENS`, token = ord('0') + digit)
* delimiter           ``=``         (`DELIM_TOKEN`)
* copy marker         ``#``         (`COPY_TOKEN`, Phase-0 copy task only)
* copy payload        ``a``..``z``  (`PAYLOAD_TOKENS`, disjoint from every other token)

Rules
-----
ADD10 is ``y = (x + k) mod 10`` with ``k in 1..9``; AFFINE10 is ``y = (a x + b) mod 10`` with
``a in 2..9`` and ``b in 0..9``. Every rule is stored uniformly as a pair ``(a, b)`` meaning
``y = (a x + b) mod 10``; ADD10 is then ``(1, k)``. The parameter sets therefore hold 9 (ADD10)
and 80 (AFFINE10) pairs (`PARAM_SETS`). A rule is bijective on 0..9 iff ``gcd(a, 10) == 1``:
every ADD10 rule, and the AFFINE10 rules with ``a in {3, 7, 9}``.

One episode
-----------
1. The family is drawn uniformly from the allowed families (both by default, so each family is
   half of the episodes; each ADD10 parameter is thus far more frequent than each AFFINE10 one).
2. The address is drawn uniformly from the four address tokens.
3. ``theta_1`` is drawn uniformly from the family's parameter set and ``theta_2`` uniformly from
   the remaining ones (so ``theta_2 != theta_1``).
4. Each segment ``d in {1, 2}`` has 8 demonstration inputs (distinct, in random order) and one
   held-out query input that is not among them. For segment 2 the query must satisfy
   ``f_theta1(q) != f_theta2(q)``.

   How the constraint is met: the pseudocode says "require", i.e. rejection sampling. Rejecting
   whole segments until the query is valid gives the uniform distribution over all
   (ordered demonstrations, query) configurations whose query is valid. We draw from exactly that
   distribution without a loop: the query is drawn uniformly among the valid inputs, and then the
   8 demonstrations are a uniformly random ordered 8-subset of the other 9 inputs. (The cheaper
   trick "if the first leftover input fails, use the other leftover" is *not* equivalent: it
   over-weights configurations whose unused input is invalid.) A valid query always exists:
   ADD10 rules never agree anywhere, and two distinct AFFINE10 rules agree on at most 5 inputs.
   Segment 1 has no constraint and uses the same sampler with every input valid.
5. A demonstration is the 5 tokens ``[address, family, x, '=', y]``, so a segment's context is
   8 * 5 = 40 tokens (`seg_tokens`); a query is ``[address, family, x, '=']`` (4 tokens,
   `query_tokens`) and its target is the answer's digit token (`target`; the digit itself is in
   `target_digit`). Only segment 2's query is the final (post-reset) LTM query of Phase 2;
   segment 1's query serves Phase-1 STM pretraining and the dual objective's immediate query.

Mismatched donor (Section 5.3)
------------------------------
Every episode carries a donor experience of the same family whose parameters differ:
``donor theta_1 != theta_1``, ``donor theta_2 != theta_2`` and ``donor theta_1 != donor
theta_2``. The donor pair is uniform over all admissible pairs (each donor parameter is drawn
uniformly among those differing from the recipient's, and rows where the two coincide are
redrawn). The donor has its own freshly sampled demonstration inputs (8 distinct per segment,
`donor_demo_x`) and its contexts use the *recipient's* address token, so format, family and
addressing cue are preserved while content changes (`donor_seg_tokens`).
`donor_target_digit` is the donor's ``theta_2`` applied to the recipient's segment-2 query input;
the "donor-follow rate" is how often a model fed the donor experience answers it. Note that the
donor's rule may agree with the recipient's at that input (then following the donor and
answering correctly are indistinguishable); analyses may want to restrict to
``donor_target_digit != target_digit[:, 1]``.

Longer memory episodes (T segments; issue 11)
---------------------------------------------
``segments=T`` (2..8, default 2) gives episodes of T segments at the same address and in the
same family; every later segment updates the mapping, as segment 2 does:

* ``theta_1`` is uniform over the family's rules and each ``theta_t`` uniform over the rules
  not used by segments 1..t-1, so the T rules of an episode all differ (feasible up to T = 9:
  ADD10 has 9 rules). For T = 2 this is exactly ``theta_2 != theta_1``.
* Each segment has 8 distinct demonstrations and a held-out query not among them; the query of
  every segment t >= 2 separates the previous rule from the new one,
  ``f_theta_{t-1}(q_t) != f_theta_t(q_t)`` (same sampler as above). The final query is the
  last segment's: it separates the last two rules. Earlier rules may agree with the last one
  at that input; `EpisodeBatch.final_answers()` gives every rule's answer there.
* The output-set baseline is computed per segment, as above.
* The donor has T segments: ``donor theta_t != theta_t`` for every t and its T rules all
  differ; `donor_target_digit` is the donor's ``theta_T`` at the final query.
* T = 2 consumes the random stream exactly as before (bit-for-bit the same batches and content
  hashes); T > 2 appends T to the seed sequence, so each T has its own independent streams
  (a T = 3 batch does not extend the T = 2 batch of the same seed).

Output-set shortcut baseline
----------------------------
The 8 demonstrations show 8 of the 10 inputs, so for a bijective rule the query's answer is one
of the 2 outputs that never appear among the demonstration answers: a rule-free guesser can reach
50% on bijective rules. Per segment we record

* `shown_outputs` (10 booleans): which outputs appear among the 8 demonstration answers;
* `bijective`: whether that segment's rule is bijective;
* `baseline_acc`: the expected accuracy of this rule-free guesser. If the 8 demonstration
  answers are all distinct, it guesses uniformly among the outputs *not* shown; otherwise it
  guesses uniformly among the distinct outputs that *were* shown. Its accuracy is
  ``1 / |candidates|`` if the true answer is among the candidates, else 0.

For a bijective rule the answers are always distinct and exactly 2 outputs are unshown, one of
them the answer, so `baseline_acc == 0.5` (in particular on every ADD10 segment). A
non-bijective rule (``gcd(a, 10) in {2, 5}``) maps 10 inputs onto 5 or 2 outputs, so its 8
answers always repeat and the guesser picks among the shown outputs.

Streams and determinism
-----------------------
Each call builds ``np.random.default_rng([seed, stream_code, epoch])`` (``[..., T]`` for
T > 2 segments) from non-negative integers, so results depend only on
``(n, seed, stream, epoch, families, segments)`` (not on the platform:
numpy's PCG64 and the operations used here are exact integer/float computations that NumPy
documents as stable). A batch of ``n`` episodes is not a prefix of a batch of ``n + 1``: draws are
made field by field over the whole batch. `make_episodes(n, seed, stream="train")` is epoch 0 of
`train_episodes(seed, 0, n)`. The validation and test streams use the fixed seeds `VAL_SEED` and
`TEST_SEED` and are identical for every condition and run seed. `content_hash` fingerprints a
batch (sha256 over every field, little-endian, fixed field order).

Phase-0 copy task
-----------------
`make_copy_batch` gives the optional PMNet copy-paste warm start: a context ``[#, payload...]``
is processed, the KV cache is cleared, and the same text is fed again teacher-forced as the
prompt; ``labels[:, i] = prompt[:, i + 1]`` (the next payload byte) and the last label is
`IGNORE_INDEX`, so only memory can carry the payload across the cleared cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "ADDRESS_TOKENS",
    "ADDRESS_LETTERS",
    "COPY_TOKEN",
    "DELIM_TOKEN",
    "DEMO_LEN",
    "DIGIT_TOKENS",
    "FAMILIES",
    "FAMILY_TOKENS",
    "IGNORE_INDEX",
    "N_DEMOS",
    "N_SEGMENTS",
    "MAX_SEGMENTS",
    "MIN_SEGMENTS",
    "PARAM_SETS",
    "PAYLOAD_TOKENS",
    "QUERY_LEN",
    "SEG_LEN",
    "STREAMS",
    "TEST_SEED",
    "VAL_SEED",
    "CopyBatch",
    "EpisodeBatch",
    "answer",
    "content_hash",
    "decode",
    "digit_of_token",
    "episode_records",
    "is_bijective",
    "make_copy_batch",
    "make_episodes",
    "test_stream",
    "train_episodes",
    "validation_stream",
    "write_jsonl",
]

# --------------------------------------------------------------------------------------------
# vocabulary and layout
# --------------------------------------------------------------------------------------------
ADDRESS_LETTERS = ("A", "B", "C", "D")
ADDRESS_TOKENS = tuple(ord(c) for c in ADDRESS_LETTERS)
FAMILIES = ("add10", "affine10")
FAMILY_TOKENS = (ord("+"), ord("*"))
DIGIT_TOKENS = tuple(ord("0") + d for d in range(10))
DELIM_TOKEN = ord("=")
COPY_TOKEN = ord("#")
PAYLOAD_TOKENS = tuple(range(ord("a"), ord("z") + 1))
IGNORE_INDEX = -100

N_SEGMENTS = 2  # the paper's episodes; the default of every generator
MIN_SEGMENTS = 2
MAX_SEGMENTS = 8  # longer memory episodes (issue 11): segments = 2..8
N_DEMOS = 8
DEMO_LEN = 5  # [address, family, x, '=', y]
SEG_LEN = N_DEMOS * DEMO_LEN  # 40
QUERY_LEN = 4  # [address, family, x, '=']

_DIGIT0 = DIGIT_TOKENS[0]

# Every rule as (a, b) with y = (a x + b) mod 10.
PARAM_SETS: dict[str, np.ndarray] = {
    "add10": np.array([(1, k) for k in range(1, 10)], dtype=np.int64),
    "affine10": np.array([(a, b) for a in range(2, 10) for b in range(10)], dtype=np.int64),
}
_N_PARAMS = np.array([len(PARAM_SETS[f]) for f in FAMILIES], dtype=np.int64)  # [9, 80]
# Padded lookup table (family, parameter index, (a, b)); padding rows are never indexed.
_PARAM_TABLE = np.zeros((len(FAMILIES), int(_N_PARAMS.max()), 2), dtype=np.int64)
for _f, _name in enumerate(FAMILIES):
    _PARAM_TABLE[_f, : len(PARAM_SETS[_name])] = PARAM_SETS[_name]

# --------------------------------------------------------------------------------------------
# streams
# --------------------------------------------------------------------------------------------
STREAMS = ("train", "val", "test")
# Arbitrary distinct constants mixed into the seed sequence; never change them (doing so changes
# every stream and every content hash).
_STREAM_CODES = {"train": 0x7E41, "val": 0x7A11, "test": 0x7E57}
_COPY_CODE = 0xC0B1
VAL_SEED = 1_000_003
TEST_SEED = 2_000_003


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------
def decode(ids: Any) -> str:
    """Token ids (int, list, numpy array or tensor; any shape) to text, one character per byte."""
    arr = ids.detach().cpu().numpy() if isinstance(ids, Tensor) else np.asarray(ids)
    arr = arr.reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() > 255):
        raise ValueError("decode: token ids must lie in 0..255 (byte vocabulary)")
    return bytes(arr.astype(np.uint8).tolist()).decode("latin-1")


def digit_of_token(tok: Any) -> Any:
    """Digit token -> digit 0..9. Accepts an int, a numpy array or a tensor (vectorised)."""
    if isinstance(tok, Tensor):
        if tok.numel() and (tok.min() < _DIGIT0 or tok.max() > DIGIT_TOKENS[-1]):
            raise ValueError("digit_of_token: tensor holds a token that is not a digit token")
        return tok - _DIGIT0
    if isinstance(tok, (int, np.integer)) and not isinstance(tok, bool):
        if not _DIGIT0 <= int(tok) <= DIGIT_TOKENS[-1]:
            raise ValueError(f"digit_of_token: {tok!r} is not a digit token (48..57)")
        return int(tok) - _DIGIT0
    arr = np.asarray(tok)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"digit_of_token: expected integer token ids, got {tok!r}")
    if arr.size and (arr.min() < _DIGIT0 or arr.max() > DIGIT_TOKENS[-1]):
        raise ValueError("digit_of_token: array holds a token that is not a digit token")
    return arr - _DIGIT0


def answer(theta_ab: Any, x: Any) -> Any:
    """``(a * x + b) % 10`` with ``theta_ab[..., 0] = a`` and ``theta_ab[..., 1] = b``.

    Works on tensors, numpy arrays or sequences; `x` broadcasts against ``theta_ab[..., 0]``
    (e.g. theta (N, 2) with x (N,), or theta (N, 1, 2) with x (N, 8)).
    """
    if not isinstance(theta_ab, (Tensor, np.ndarray)):
        theta_ab = np.asarray(theta_ab)
    if isinstance(theta_ab, Tensor) and not isinstance(x, Tensor):
        x = torch.as_tensor(x, device=theta_ab.device)
    return (theta_ab[..., 0] * x + theta_ab[..., 1]) % 10


def is_bijective(a: Any) -> Any:
    """Whether ``x -> (a x + b) mod 10`` is a bijection, i.e. ``gcd(a, 10) == 1``."""
    if isinstance(a, Tensor):
        return (a % 2 != 0) & (a % 5 != 0)
    a = np.asarray(a)
    return (a % 2 != 0) & (a % 5 != 0)


# --------------------------------------------------------------------------------------------
# batch containers
# --------------------------------------------------------------------------------------------
class _TensorBatch:
    """Shared behaviour of dataclasses whose fields are tensors with a common leading dim."""

    def _tensors(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __post_init__(self) -> None:
        sizes = {name: t.shape[0] if t.dim() else None for name, t in self._tensors().items()}
        if len(set(sizes.values())) != 1 or None in sizes.values():
            raise ValueError(f"{type(self).__name__}: fields disagree on the batch size: {sizes}")

    def __len__(self) -> int:
        return int(next(iter(self._tensors().values())).shape[0])

    def to(self, device: Any, non_blocking: bool = False) -> Any:
        """A copy with every tensor moved to `device` (`non_blocking`: asynchronous copies,
        which only overlap with compute when the batch is in pinned memory)."""
        return dataclasses.replace(self, **{k: v.to(device, non_blocking=non_blocking)
                                            for k, v in self._tensors().items()})

    def pin_memory(self) -> Any:
        """A copy in page-locked host memory (what `DataLoader(pin_memory=True)` calls), so
        that the copy to a GPU is asynchronous."""
        return dataclasses.replace(self, **{k: v.pin_memory()
                                            for k, v in self._tensors().items()})

    def slice(self, i: int, j: int) -> Any:
        """Episodes ``i:j`` (views, no copy)."""
        return self[i:j]

    def __getitem__(self, index: Any) -> Any:
        """Index the batch dimension with a slice, an int (length-1 batch), a bool mask or an
        index array/tensor."""
        if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            n = len(self)
            i = int(index) + n if index < 0 else int(index)
            if not 0 <= i < n:
                raise IndexError(f"episode index {index} out of range for a batch of {n}")
            index = slice(i, i + 1)
        elif not isinstance(index, slice):
            index = torch.as_tensor(np.asarray(index) if not isinstance(index, Tensor) else index)
            if index.dim() != 1:
                raise IndexError("batch index arrays must be one-dimensional")
        out = {}
        for k, v in self._tensors().items():
            idx = index if isinstance(index, slice) else index.to(v.device)
            out[k] = v[idx]
        return dataclasses.replace(self, **out)


@dataclass(eq=False)
class EpisodeBatch(_TensorBatch):
    """N memory episodes of T segments (see the module docstring for every field's meaning).

    T is `n_segments` (2 for the paper's episodes); index -1 of a segment axis is the last
    segment, whose query is the final (post-reset) LTM query.
    """

    family: Tensor  # (N,) int64, 0 = add10, 1 = affine10
    address: Tensor  # (N,) int64, 0..3
    theta: Tensor  # (N, T, 2) int64, [segment, (a, b)]
    seg_tokens: Tensor  # (N, T, 40) int64, demonstration contexts of segments 1..T
    demo_x: Tensor  # (N, T, 8) int64
    query_tokens: Tensor  # (N, T, 4) int64, query of segment d
    query_x: Tensor  # (N, T) int64
    target: Tensor  # (N, T) int64, answer digit tokens
    target_digit: Tensor  # (N, T) int64, 0..9
    shown_outputs: Tensor  # (N, T, 10) bool
    bijective: Tensor  # (N, T) bool
    baseline_acc: Tensor  # (N, T) float32
    donor_theta: Tensor  # (N, T, 2) int64
    donor_demo_x: Tensor  # (N, T, 8) int64
    donor_seg_tokens: Tensor  # (N, T, 40) int64, donor contexts with the recipient's address
    donor_target_digit: Tensor  # (N,) int64, donor theta_T at the recipient's final query

    @property
    def n_segments(self) -> int:
        """T, the number of segments of every episode in the batch."""
        return int(self.seg_tokens.shape[1])

    def final_answers(self) -> Tensor:
        """(N, T) digits: segment t's rule applied to the final query's input,
        ``f_theta_t(query_x[:, -1])``. Column -1 is `target_digit[:, -1]`; column -2 always
        differs from it (the final query separates the last two rules)."""
        return answer(self.theta, self.query_x[:, -1:])

    def demos(self, k: int) -> Tensor:
        """The first `k` demonstrations of each segment: ``seg_tokens[:, :, :5 * k]``."""
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= N_DEMOS:
            raise ValueError(f"demos: k must be an int in 1..{N_DEMOS}, got {k!r}")
        return self.seg_tokens[:, :, : DEMO_LEN * int(k)]


@dataclass(eq=False)
class CopyBatch(_TensorBatch):
    """Phase-0 copy-paste batch: context and prompt are both ``[#, payload...]``."""

    context: Tensor  # (N, L + 1) int64
    prompt: Tensor  # (N, L + 1) int64, same text, fed after the KV cache is cleared
    labels: Tensor  # (N, L + 1) int64, labels[:, i] = prompt[:, i + 1]; last = -100


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------
def _check_count(value: Any, what: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value == 0:
        raise ValueError(f"{name} = 0: zero {what} requested; {name} must be a positive int")
    if value < 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


def _check_seed(value: Any, name: str = "seed") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(
            f"{name} must be a non-negative int, got {value!r} ({type(value).__name__})"
        )
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value}")
    return int(value)


def _check_families(families: Any) -> np.ndarray:
    if isinstance(families, str):
        families = (families,)
    try:
        names = list(families)
    except TypeError:
        raise ValueError(f"families must be a sequence of family names, got {families!r}") from None
    if not names:
        raise ValueError(f"families is empty; choose from {FAMILIES}")
    for name in names:
        if name not in FAMILIES:
            raise ValueError(f"unknown family {name!r}; known families: {FAMILIES}")
    if len(set(names)) != len(names):
        raise ValueError(f"families lists a family twice: {names}")
    # Sorted codes: the result does not depend on the order the names are given in.
    return np.array(sorted(FAMILIES.index(n) for n in names), dtype=np.int64)


def _check_segments(segments: Any) -> int:
    if isinstance(segments, bool) or not isinstance(segments, (int, np.integer)):
        raise ValueError(f"segments must be an int in {MIN_SEGMENTS}..{MAX_SEGMENTS}, got "
                         f"{segments!r} ({type(segments).__name__})")
    if segments < MIN_SEGMENTS:
        raise ValueError(f"segments = {segments}: a memory episode needs at least "
                         f"{MIN_SEGMENTS} segments (one rule and at least one update)")
    if segments > MAX_SEGMENTS:
        raise ValueError(f"segments = {segments}: at most {MAX_SEGMENTS} segments are supported "
                         f"(every segment's rule differs from all the others, and ADD10 has "
                         f"only {len(PARAM_SETS['add10'])} rules)")
    return int(segments)


def _entropy(seed: int, stream_code: int, epoch: int, segments: int) -> tuple[int, ...]:
    """The seed sequence of one call. Two-segment episodes keep the original entropy (so
    they are bit-for-bit the paper-task streams); T > 2 appends T, so each T has its own
    independent streams."""
    base = (seed, stream_code, epoch)
    return base if segments == N_SEGMENTS else base + (segments,)


def _check_stream(stream: Any) -> int:
    if not isinstance(stream, str) or stream not in _STREAM_CODES:
        raise ValueError(f"unknown stream {stream!r}; known streams: {STREAMS}")
    return _STREAM_CODES[stream]


# --------------------------------------------------------------------------------------------
# generation
# --------------------------------------------------------------------------------------------
def _draw_other(rng: np.random.Generator, n_params: np.ndarray, exclude: np.ndarray) -> np.ndarray:
    """Per row, a parameter index uniform over ``range(n_params) minus {exclude}``."""
    j = rng.integers(0, n_params - 1)
    return j + (j >= exclude)


def _draw_new(rng: np.random.Generator, n_params: np.ndarray, used: np.ndarray) -> np.ndarray:
    """Per row, a parameter index uniform over ``range(n_params)`` minus the row's `used`
    indices (N, k), which are distinct. One draw of ``rng.integers(0, n_params - k)``, then
    the j-th unused index; with k = 1 this is exactly `_draw_other` (same draw, same value)."""
    j = rng.integers(0, n_params - used.shape[1])
    for e in np.sort(used, axis=1).T:  # ascending: skip over each used index in turn
        j = j + (j >= e)
    return j


def _draw_segment_inputs(
    rng: np.random.Generator, valid: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Query and demonstration inputs for a stack of segments.

    `valid` (..., 10) marks the inputs allowed as the query. Returns ``demo_x`` (..., 8) and
    ``query_x`` (...): the query is uniform over the valid inputs, the demonstrations a uniformly
    random ordered 8-subset of the other 9 inputs (= rejection sampling of whole segments).
    """
    shape = valid.shape[:-1]
    keys = rng.random(shape + (10,))
    query_x = np.argmax(np.where(valid, keys, -1.0), axis=-1)
    order_keys = rng.random(shape + (10,))
    np.put_along_axis(order_keys, query_x[..., None], 2.0, axis=-1)  # query sorts last
    demo_x = np.argsort(order_keys, axis=-1)[..., :N_DEMOS]
    return demo_x, query_x


def _context_tokens(address: np.ndarray, family: np.ndarray, demo_x: np.ndarray,
                    demo_y: np.ndarray) -> np.ndarray:
    """(N, T, 8) inputs/answers -> (N, T, 40) demonstration contexts."""
    n, t = demo_x.shape[:2]
    tok = np.empty((n, t, N_DEMOS, DEMO_LEN), dtype=np.int64)
    tok[..., 0] = np.asarray(ADDRESS_TOKENS)[address][:, None, None]
    tok[..., 1] = np.asarray(FAMILY_TOKENS)[family][:, None, None]
    tok[..., 2] = demo_x + _DIGIT0
    tok[..., 3] = DELIM_TOKEN
    tok[..., 4] = demo_y + _DIGIT0
    return tok.reshape(n, t, SEG_LEN)


def _repeats(idx: np.ndarray) -> np.ndarray:
    """(N, T) indices -> (N,) bool: whether a row holds some index twice."""
    s = np.sort(idx, axis=1)
    return (s[:, 1:] == s[:, :-1]).any(axis=1)


def _generate(n: int, entropy: Sequence[int], family_codes: np.ndarray,
              segments: int = N_SEGMENTS) -> EpisodeBatch:
    """`n` episodes of `segments` segments. Every draw is made in the same order as for the
    paper's two segments, and the extra draws of T > 2 come where T = 2 makes none, so T = 2
    consumes the generator exactly as it always did (same tokens, same content hash)."""
    rng = np.random.default_rng(list(entropy))
    xs = np.arange(10)
    T = segments

    # family, address, parameters: theta_1 uniform, each later theta_t uniform over the
    # family's rules not used by an earlier segment (all T rules of an episode differ) -------
    family = family_codes[rng.integers(0, len(family_codes), size=n)]
    address = rng.integers(0, len(ADDRESS_TOKENS), size=n)
    n_params = _N_PARAMS[family]
    idx = [rng.integers(0, n_params)]
    for _ in range(1, T):
        idx.append(_draw_new(rng, n_params, np.stack(idx, axis=1)))
    idx = np.stack(idx, axis=1)  # (N, T)
    theta = _PARAM_TABLE[family[:, None], idx]  # (N, T, 2)

    # inputs: segment 1 unconstrained; the query of each later segment t must separate
    # theta_{t-1} and theta_t (so the final query separates the last two rules) ----------------
    y_all = answer(theta[:, :, None, :], xs)  # (N, T, 10)
    valid = np.concatenate([np.ones_like(y_all[:, :1], dtype=bool),
                            y_all[:, :-1] != y_all[:, 1:]], axis=1)  # (N, T, 10)
    if not valid.any(axis=-1).all():  # impossible for distinct rules; kept as a guard
        raise AssertionError("two consecutive rules agree on every input")
    demo_x, query_x = _draw_segment_inputs(rng, valid)
    demo_y = answer(theta[:, :, None, :], demo_x)  # (N, T, 8)
    target_digit = answer(theta, query_x)  # (N, T)

    seg_tokens = _context_tokens(address, family, demo_x, demo_y)
    query_tokens = np.empty((n, T, QUERY_LEN), dtype=np.int64)
    query_tokens[..., 0] = np.asarray(ADDRESS_TOKENS)[address][:, None]
    query_tokens[..., 1] = np.asarray(FAMILY_TOKENS)[family][:, None]
    query_tokens[..., 2] = query_x + _DIGIT0
    query_tokens[..., 3] = DELIM_TOKEN

    # output-set shortcut baseline ---------------------------------------------------------------
    shown = (demo_y[..., None] == xs).any(axis=-2)  # (N, T, 10)
    n_shown = shown.sum(axis=-1)
    candidates = np.where((n_shown == N_DEMOS)[..., None], ~shown, shown)
    hit = np.take_along_axis(candidates, target_digit[..., None], axis=-1)[..., 0]
    baseline_acc = np.where(hit, 1.0 / candidates.sum(axis=-1), 0.0).astype(np.float32)
    bijective = is_bijective(theta[..., 0])

    # mismatched donor: same family, donor theta_t != theta_t for every t, and the donor's T
    # rules all differ (as the recipient's do); uniform over such tuples by rejection -----------
    d = np.stack([_draw_other(rng, n_params, idx[:, t]) for t in range(T)], axis=1)
    bad = np.flatnonzero(_repeats(d))
    while bad.size:  # rejection rounds over the failing rows only
        for t in range(T):
            d[bad, t] = _draw_other(rng, n_params[bad], idx[bad, t])
        bad = bad[_repeats(d[bad])]
    donor_theta = _PARAM_TABLE[family[:, None], d]
    donor_demo_x = np.argsort(rng.random((n, T, 10)), axis=-1)[..., :N_DEMOS]
    donor_demo_y = answer(donor_theta[:, :, None, :], donor_demo_x)
    donor_seg_tokens = _context_tokens(address, family, donor_demo_x, donor_demo_y)
    donor_target_digit = answer(donor_theta[:, -1], query_x[:, -1])

    t = torch.from_numpy
    return EpisodeBatch(
        family=t(family.astype(np.int64)),
        address=t(address.astype(np.int64)),
        theta=t(theta),
        seg_tokens=t(seg_tokens),
        demo_x=t(demo_x.astype(np.int64)),
        query_tokens=t(query_tokens),
        query_x=t(query_x.astype(np.int64)),
        target=t(target_digit + _DIGIT0),
        target_digit=t(target_digit),
        shown_outputs=t(shown),
        bijective=t(bijective),
        baseline_acc=t(baseline_acc),
        donor_theta=t(donor_theta),
        donor_demo_x=t(donor_demo_x.astype(np.int64)),
        donor_seg_tokens=t(donor_seg_tokens),
        donor_target_digit=t(donor_target_digit),
    )


def make_episodes(
    n: int,
    seed: int,
    *,
    families: Iterable[str] = FAMILIES,
    stream: str = "train",
    segments: int = N_SEGMENTS,
) -> EpisodeBatch:
    """`n` memory episodes of `segments` segments, deterministic in
    ``(n, seed, stream, families, segments)``.

    Raises ValueError (before doing any work) for a non-positive or non-int `n`, a seed that is
    not a non-negative int, an unknown or duplicated family, an unknown stream, or `segments`
    outside 2..8.
    """
    n = _check_count(n, "episodes", "n")
    seed = _check_seed(seed)
    codes = _check_families(families)
    stream_code = _check_stream(stream)
    segments = _check_segments(segments)
    return _generate(n, _entropy(seed, stream_code, 0, segments), codes, segments)


def train_episodes(
    seed: int, epoch: int, n: int, *, families: Iterable[str] = FAMILIES,
    segments: int = N_SEGMENTS,
) -> EpisodeBatch:
    """Training episodes of run seed `seed`, epoch `epoch`.

    Every condition trained with the same seed sees the same episodes (paired comparisons).
    Epoch 0 equals ``make_episodes(n, seed, stream="train", segments=segments)``.
    """
    n = _check_count(n, "episodes", "n")
    seed = _check_seed(seed)
    epoch = _check_seed(epoch, "epoch")
    codes = _check_families(families)
    segments = _check_segments(segments)
    return _generate(n, _entropy(seed, _STREAM_CODES["train"], epoch, segments), codes,
                     segments)


def validation_stream(n: int = 1000, *, segments: int = N_SEGMENTS) -> EpisodeBatch:
    """The fixed validation episodes (seed `VAL_SEED`), identical for every condition and seed
    (one stream per number of segments)."""
    return make_episodes(n, VAL_SEED, stream="val", segments=segments)


def test_stream(n: int = 1000, *, segments: int = N_SEGMENTS,
                seed: int = TEST_SEED) -> EpisodeBatch:
    """The fixed test episodes (seed `seed`, the paper preset's `TEST_SEED` unless a preset
    names another), identical for every condition and run seed (one stream per number of
    segments)."""
    if seed == VAL_SEED:
        raise ValueError(f"test stream seed {seed} is the validation stream's (VAL_SEED)")
    return make_episodes(n, seed, stream="test", segments=segments)


test_stream.__test__ = False  # not a pytest test, despite the name


def make_copy_batch(n: int, length: int, seed: int) -> CopyBatch:
    """`n` copy-paste examples with payloads of `length` random lowercase letters."""
    n = _check_count(n, "copy examples", "n")
    length = _check_count(length, "payload bytes", "length")
    seed = _check_seed(seed)
    rng = np.random.default_rng([seed, _COPY_CODE])
    payload = np.asarray(PAYLOAD_TOKENS, dtype=np.int64)[
        rng.integers(0, len(PAYLOAD_TOKENS), size=(n, length))
    ]
    text = np.concatenate([np.full((n, 1), COPY_TOKEN, dtype=np.int64), payload], axis=1)
    labels = np.full_like(text, IGNORE_INDEX)
    labels[:, :-1] = text[:, 1:]
    return CopyBatch(
        context=torch.from_numpy(text), prompt=torch.from_numpy(text.copy()),
        labels=torch.from_numpy(labels),
    )


# --------------------------------------------------------------------------------------------
# fingerprint and export
# --------------------------------------------------------------------------------------------
def content_hash(batch: EpisodeBatch | CopyBatch) -> str:
    """sha256 hex digest of a batch: every field in declaration order, with its name, dtype,
    shape and little-endian bytes (bools as uint8), so it is stable across runs and machines."""
    h = hashlib.sha256(type(batch).__name__.encode())
    for f in dataclasses.fields(batch):
        arr = getattr(batch, f.name).detach().cpu().numpy()
        if arr.dtype == np.bool_:
            arr = arr.astype(np.uint8)
        arr = np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"), copy=False))
        h.update(f"|{f.name}|{arr.dtype.str}|{arr.shape}|".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def _params(ab: list[int]) -> dict[str, int]:
    return {"a": int(ab[0]), "b": int(ab[1])}


def episode_records(batch: EpisodeBatch) -> list[dict]:
    """One JSON-serialisable dict per episode (for `pmnet episodes` and inspection)."""
    b = {k: v.detach().cpu().tolist() for k, v in batch._tensors().items()}
    records = []
    for i in range(len(batch)):
        segments = []
        for d in range(batch.n_segments):
            q_ids = b["query_tokens"][i][d]
            segments.append({
                "ids": b["seg_tokens"][i][d],
                "text": decode(b["seg_tokens"][i][d]),
                "demo_x": b["demo_x"][i][d],
                "query": {
                    "ids": q_ids,
                    "text": decode(q_ids),
                    "x": b["query_x"][i][d],
                    "target": b["target"][i][d],
                    "target_digit": b["target_digit"][i][d],
                },
                "bijective": b["bijective"][i][d],
                "shown_outputs": [y for y in range(10) if b["shown_outputs"][i][d][y]],
                "baseline_acc": round(b["baseline_acc"][i][d], 6),
            })
        records.append({
            "index": i,
            "family": FAMILIES[b["family"][i]],
            "address": ADDRESS_LETTERS[b["address"][i]],
            "theta": [_params(ab) for ab in b["theta"][i]],
            "segments": segments,
            "donor": {
                "theta": [_params(ab) for ab in b["donor_theta"][i]],
                "segments": [
                    {"ids": ids, "text": decode(ids)} for ids in b["donor_seg_tokens"][i]
                ],
                "target_digit": b["donor_target_digit"][i],
            },
        })
    return records


def write_jsonl(batch: EpisodeBatch, path_or_file: str | os.PathLike | IO[str]) -> int:
    """Write `episode_records(batch)` as JSON lines to a path or an open text file; returns the
    number of records written."""
    records = episode_records(batch)
    if isinstance(path_or_file, (str, os.PathLike)):
        with open(path_or_file, "w", encoding="utf-8") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
    else:
        for rec in records:
            path_or_file.write(json.dumps(rec) + "\n")
    return len(records)
