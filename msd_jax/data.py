"""Datasets of the MSD experiments: DigitsCaption, the Hateful-Memes jsonl layout, batch schedule.

A `MultimodalDataset` holds N samples as host (NumPy) arrays in the layout of `MultimodalBatch`
(`msd_jax.views`) with N rows; `dataset.batch(indices)` slices one batch out of it.

DigitsCaption. Image = one of scikit-learn's bundled 8x8 handwritten digits (1797, no download),
scaled to [0, 1], plus optional Gaussian pixel noise, cut into `patch_size` x `patch_size` patches.
Text = a caption of filler tokens and, when the caption is informative, class keywords (each
class owns `keywords_per_class` tokens). The label y is the digit class. Each sample has a regime:

    regime        image                                      caption
    both          the digit (class y)                        fillers + keyword(s) of y
    image_only    the digit (class y)                        fillers only
    text_only     no digit (blank, or scrambled pixels)      fillers + keyword(s) of y
    conflicting   the digit (class y)                        fillers + keyword(s) of a class != y

so the regime mix sets how salient each modality is: text tells the label on both + text_only,
the image on both + image_only + conflicting, and a caption can lie. The train / validation /
test split of the 1797 digits and every random choice are fixed by `DigitsCaptionConfig.seed`;
regimes are assigned in exact proportions within each split.

Hateful Memes layout (`JsonlDataConfig`, `load_jsonl`): `{"id", "img", "text", "label"}` per
line, images read with Pillow and resized to patches, text through a local `AutoTokenizer`.
Nothing is unpickled and nothing is downloaded; a bad row raises `DataFormatError` naming the
file and line.

Token ids: 0 = padding, 1..F fillers, then C * K keywords (class c owns F + 1 + c K .. + K - 1).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import ClassVar

import numpy as np

from msd_jax.views import MultimodalBatch

REGIMES = ("both", "image_only", "text_only", "conflicting")
SPLITS = ("train", "validation", "test")
UNINFORMATIVE_IMAGES = ("blank", "scrambled")
PAD_ID = 0


@dataclasses.dataclass(frozen=True)
class MultimodalDataset:
    """N samples on the host, row n of every array belonging to sample n.

    Attributes:
      text_ids_nt, text_mask_nt: int32 / bool `[N, T]` caption tokens and their mask.
      image_npd, image_mask_np: float32 `[N, P, D]` patches / bool `[N, P]` their mask.
      label_n: int32 `[N]` class index in [0, num_classes).
      num_classes, vocab_size: sizes the models are built with.
      regime_n: int32 `[N]` index into `REGIMES` (DigitsCaption), or None.
      ids: per-sample ids (the jsonl `id`s), or None.
    """

    text_ids_nt: np.ndarray
    text_mask_nt: np.ndarray
    image_npd: np.ndarray
    image_mask_np: np.ndarray
    label_n: np.ndarray
    num_classes: int
    vocab_size: int
    regime_n: np.ndarray | None = None
    ids: tuple[str, ...] | None = None

    def __post_init__(self):
        n = len(self.label_n)
        arrays = {
            "text_ids_nt": 2,
            "text_mask_nt": 2,
            "image_npd": 3,
            "image_mask_np": 2,
            "label_n": 1,
        }
        for name, ndim in arrays.items():
            value = getattr(self, name)
            if value.ndim != ndim or value.shape[0] != n:
                raise ValueError(f"{name} has shape {value.shape}; expected {ndim} dims, N={n}")
        if self.text_mask_nt.shape != self.text_ids_nt.shape:
            raise ValueError(f"text mask {self.text_mask_nt.shape} != ids {self.text_ids_nt.shape}")
        if self.image_mask_np.shape != self.image_npd.shape[:2]:
            raise ValueError(f"image mask {self.image_mask_np.shape} != {self.image_npd.shape[:2]}")
        if n and (self.label_n.min() < 0 or self.label_n.max() >= self.num_classes):
            raise ValueError(f"labels must lie in [0, {self.num_classes})")
        if n and (self.text_ids_nt.min() < 0 or self.text_ids_nt.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, vocab_size={self.vocab_size})")

    def __len__(self) -> int:
        return len(self.label_n)

    @property
    def text_len(self) -> int:
        return self.text_ids_nt.shape[1]

    @property
    def num_patches(self) -> int:
        return self.image_npd.shape[1]

    @property
    def patch_dim(self) -> int:
        return self.image_npd.shape[2]

    def batch(self, indices: np.ndarray) -> MultimodalBatch:
        """The samples `indices` as a (host) `MultimodalBatch`."""
        return MultimodalBatch(
            text_ids_bt=self.text_ids_nt[indices],
            text_mask_bt=self.text_mask_nt[indices],
            image_bpd=self.image_npd[indices],
            image_mask_bp=self.image_mask_np[indices],
            label_b=self.label_n[indices],
        )

    def subset(self, indices: np.ndarray) -> MultimodalDataset:
        """A dataset of the samples `indices`, in that order."""
        return dataclasses.replace(
            self,
            text_ids_nt=self.text_ids_nt[indices],
            text_mask_nt=self.text_mask_nt[indices],
            image_npd=self.image_npd[indices],
            image_mask_np=self.image_mask_np[indices],
            label_n=self.label_n[indices],
            regime_n=None if self.regime_n is None else self.regime_n[indices],
            ids=None if self.ids is None else tuple(self.ids[i] for i in indices),
        )

    def padded_indices(self, batch_size: int) -> tuple[np.ndarray, int]:
        """Indices `[ceil(N / batch_size) * batch_size]` covering every sample once, padded with
        sample 0 (so every batch has the same shape), and N, the number of real rows."""
        n = len(self)
        total = max(1, math.ceil(n / batch_size)) * batch_size
        indices = np.zeros(total, np.int64)
        indices[:n] = np.arange(n)
        return indices, n


def batch_indices(num_examples: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Sample indices of training step `step` (0-based): epochs of a seeded permutation.

    A pure function of (seed, step), so a resumed run reads exactly the batches an uninterrupted
    one reads, and runs with the same seed read the same batches whatever their method (the
    paired comparisons rely on it). The last partial batch of an epoch is dropped.
    """
    if not 1 <= batch_size <= num_examples:
        raise ValueError(f"batch_size={batch_size} must lie in [1, {num_examples} examples]")
    per_epoch = num_examples // batch_size
    epoch, position = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_examples)
    return order[position * batch_size : (position + 1) * batch_size]


@dataclasses.dataclass(frozen=True)
class DigitsCaptionConfig:
    """The DigitsCaption benchmark (module docstring).

    Attributes:
      seed: fixes the splits, regimes, captions and noise.
      regime_mix: fractions of (both, image_only, text_only, conflicting), summing to 1.
      caption_len: T, the longest caption; lengths are uniform in [min_caption_len, T].
      min_caption_len: the shortest caption (>= keywords_per_caption).
      keywords_per_class: K keyword tokens per class.
      keywords_per_caption: keyword tokens in an informative caption (all of one class).
      num_filler_tokens: F filler tokens.
      image_noise: std of the Gaussian noise added to every pixel (pixels in [0, 1]).
      uninformative_image: the image of a text_only sample: "blank" (zeros, then the noise) or
        "scrambled" (another digit's pixels, randomly permuted).
      patch_size: side of the square patches (divides 8).
      validation_fraction, test_fraction: split sizes; the rest is train.
    """

    seed: int = 0
    regime_mix: tuple[float, float, float, float] = (0.25, 0.25, 0.25, 0.25)
    caption_len: int = 12
    min_caption_len: int = 6
    keywords_per_class: int = 2
    keywords_per_caption: int = 1
    num_filler_tokens: int = 40
    image_noise: float = 0.0
    uninformative_image: str = "blank"
    patch_size: int = 2
    validation_fraction: float = 0.2
    test_fraction: float = 0.2

    def validate(self) -> None:
        mix = self.regime_mix
        if len(mix) != len(REGIMES) or min(mix) < 0 or not math.isclose(sum(mix), 1.0):
            raise ValueError(
                f"regime_mix={mix} must be {len(REGIMES)} fractions >= 0 of {REGIMES} summing to 1"
            )
        if not 1 <= self.keywords_per_caption <= self.min_caption_len <= self.caption_len:
            raise ValueError(
                "need 1 <= keywords_per_caption <= min_caption_len <= caption_len, got "
                f"{self.keywords_per_caption}, {self.min_caption_len}, {self.caption_len}"
            )
        if self.keywords_per_class < 1 or self.num_filler_tokens < 1:
            raise ValueError("keywords_per_class and num_filler_tokens must be >= 1")
        if not (math.isfinite(self.image_noise) and self.image_noise >= 0):
            raise ValueError(f"image_noise={self.image_noise} must be finite and >= 0")
        if self.uninformative_image not in UNINFORMATIVE_IMAGES:
            raise ValueError(
                f"uninformative_image={self.uninformative_image!r}; expected one of "
                f"{UNINFORMATIVE_IMAGES}"
            )
        if self.patch_size not in (1, 2, 4, 8):
            raise ValueError(f"patch_size={self.patch_size} must divide the 8x8 digits")
        held_out = self.validation_fraction + self.test_fraction
        if min(self.validation_fraction, self.test_fraction) <= 0 or held_out >= 1:
            raise ValueError(
                f"validation_fraction={self.validation_fraction} and test_fraction="
                f"{self.test_fraction} must be > 0 and leave some train data"
            )

    @property
    def vocab_size(self) -> int:
        return 1 + self.num_filler_tokens + 10 * self.keywords_per_class


def patchify_np(images_nhwc: np.ndarray, patch: int) -> np.ndarray:
    """`[N, H, W, C]` -> `[N, (H/patch)(W/patch), patch^2 C]`, row-major patches (host version
    of `views.patchify`)."""
    n, h, w, c = images_nhwc.shape
    if h % patch or w % patch:
        raise ValueError(f"image size {h}x{w} is not a multiple of the patch size {patch}")
    x = images_nhwc.reshape(n, h // patch, patch, w // patch, patch, c).transpose(0, 1, 3, 2, 4, 5)
    return np.ascontiguousarray(x.reshape(n, (h // patch) * (w // patch), patch * patch * c))


def _regimes(n: int, mix: tuple[float, ...], rng: np.random.Generator) -> np.ndarray:
    """Exact proportions: floor(mix * n) of each regime, the remainder by largest fraction."""
    counts = np.floor(np.asarray(mix) * n).astype(np.int64)
    remainder = np.asarray(mix) * n - counts
    for i in np.argsort(-remainder, kind="stable")[: n - counts.sum()]:
        counts[i] += 1
    return rng.permutation(np.repeat(np.arange(len(mix)), counts)).astype(np.int32)


def _captions(
    config: DigitsCaptionConfig, caption_class_n: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and mask `[N, T]`; caption_class_n = -1 for a caption of fillers only."""
    n, t, f = len(caption_class_n), config.caption_len, config.num_filler_tokens
    k = config.keywords_per_class
    lengths = rng.integers(config.min_caption_len, t + 1, n)
    mask = np.arange(t)[None, :] < lengths[:, None]
    ids = rng.integers(1, f + 1, (n, t)).astype(np.int32)
    for i in np.flatnonzero(caption_class_n >= 0):
        slots = rng.choice(lengths[i], config.keywords_per_caption, replace=False)
        ids[i, slots] = 1 + f + caption_class_n[i] * k + rng.integers(0, k, len(slots))
    return np.where(mask, ids, PAD_ID).astype(np.int32), mask


def _make_split(
    config: DigitsCaptionConfig, images_nhw: np.ndarray, label_n: np.ndarray, split_seed: int
) -> MultimodalDataset:
    rng = np.random.default_rng([config.seed, split_seed])
    n = len(label_n)
    regime_n = _regimes(n, config.regime_mix, rng)
    image_only, text_only, conflicting = (regime_n == REGIMES.index(r) for r in REGIMES[1:])
    # Caption class: the label, none (fillers only) or a wrong class.
    caption_class = np.where(image_only, -1, label_n)
    shift = rng.integers(1, 10, n)
    caption_class = np.where(conflicting, (label_n + shift) % 10, caption_class)
    text_ids, text_mask = _captions(config, caption_class, rng)
    images = images_nhw.reshape(n, -1).copy()
    if config.uninformative_image == "blank":
        images[text_only] = 0.0
    else:  # another digit with its pixels permuted: no shape, the same ink statistics
        donors = rng.integers(0, n, n)
        for i in np.flatnonzero(text_only):
            images[i] = rng.permutation(images_nhw[donors[i]].reshape(-1))
    images = images + config.image_noise * rng.standard_normal(images.shape)
    images_nhwc = images.reshape(n, 8, 8, 1).astype(np.float32)
    patches = patchify_np(images_nhwc, config.patch_size)
    return MultimodalDataset(
        text_ids_nt=text_ids,
        text_mask_nt=text_mask,
        image_npd=patches,
        image_mask_np=np.ones(patches.shape[:2], bool),
        label_n=label_n.astype(np.int32),
        num_classes=10,
        vocab_size=config.vocab_size,
        regime_n=regime_n,
    )


def make_digits_caption(config: DigitsCaptionConfig) -> dict[str, MultimodalDataset]:
    """The train / validation / test splits of DigitsCaption (a pure function of the config)."""
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    config.validate()
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float64)
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng([config.seed, 0]).permutation(len(labels))
    n_val = round(config.validation_fraction * len(labels))
    n_test = round(config.test_fraction * len(labels))
    parts = {
        "test": order[:n_test],
        "validation": order[n_test : n_test + n_val],
        "train": order[n_test + n_val :],
    }
    return {
        name: _make_split(config, images[parts[name]], labels[parts[name]], split_seed)
        for split_seed, name in enumerate(SPLITS, start=1)
    }


# The Hateful-Memes layout ---------------------------------------------------------------------

JSONL_FIELDS = ("id", "img", "text", "label")


class DataFormatError(ValueError):
    """A bad row of a jsonl dataset; the message names the file, the line and the fix."""


@dataclasses.dataclass(frozen=True)
class JsonlDataConfig:
    """A dataset in the Hateful Memes layout: `DATA_DIR/<split>.jsonl`, one JSON object a line,
    `{"id": ..., "img": "img/01235.png", "text": "...", "label": 0}`, the `img` paths relative
    to DATA_DIR.

    Attributes:
      data_dir: the directory holding the jsonl files and the images.
      tokenizer_dir: a local `transformers` tokenizer directory (`AutoTokenizer`; no download).
      train_file, validation_file, test_file: the splits' jsonl files in data_dir.
      labels: the label values, in class-index order (an unknown label is an error).
      image_size: images are resized to image_size x image_size (bilinear).
      patch_size: side of the square patches (divides image_size).
      grayscale: read images as one channel ("L") instead of three ("RGB").
      max_text_len: T; longer texts are truncated, shorter ones padded (and masked).
    """

    # `~` expanded and stored absolute in a run's config.gin (`jaxrl.infra.config.parse_gin`).
    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("data_dir", "tokenizer_dir")

    data_dir: str
    tokenizer_dir: str
    train_file: str = "train.jsonl"
    validation_file: str = "dev.jsonl"
    test_file: str = "test.jsonl"
    labels: tuple[int, ...] = (0, 1)
    image_size: int = 32
    patch_size: int = 8
    grayscale: bool = False
    max_text_len: int = 32

    def validate(self) -> None:
        if len(set(self.labels)) != len(self.labels) or len(self.labels) < 2:
            raise ValueError(f"labels={self.labels} must be >= 2 distinct values")
        if self.image_size < 1 or self.patch_size < 1 or self.image_size % self.patch_size:
            raise ValueError(
                f"patch_size={self.patch_size} must divide image_size={self.image_size}"
            )
        if self.max_text_len < 1:
            raise ValueError(f"max_text_len={self.max_text_len} must be >= 1")

    @property
    def split_files(self) -> dict[str, str]:
        files = (self.train_file, self.validation_file, self.test_file)
        return dict(zip(SPLITS, files, strict=True))


def load_tokenizer(tokenizer_dir: str):
    """`AutoTokenizer` from a local directory only (never the Hub)."""
    from transformers import AutoTokenizer

    if not Path(tokenizer_dir, "tokenizer_config.json").exists():
        raise FileNotFoundError(
            f"{tokenizer_dir} holds no tokenizer_config.json; point tokenizer_dir at a directory "
            "written by `tokenizer.save_pretrained(...)`"
        )
    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


def _read_image(path: Path, config: JsonlDataConfig) -> np.ndarray:
    """`[S, S, C]` float32 in [0, 1]; raises OSError / ValueError for an unreadable image.

    Any size is resized (bilinear) to `image_size`. Modes: 8-bit ones (L, RGB, P, CMYK, ...)
    convert as PIL does; 16-bit grayscale keeps its full range (scaled by 65535, where a plain
    conversion to 8 bits would clip it); transparency (RGBA, LA, P with a transparent colour) is
    composited onto white; 32-bit integer / float images are refused (their range is unknown).
    """
    from PIL import Image

    size = (config.image_size, config.image_size)
    with Image.open(path) as image:
        if image.mode.startswith("I;16"):
            scaled = np.asarray(image, np.float32) / 65535.0
            resized = Image.fromarray(scaled, "F").resize(size, Image.Resampling.BILINEAR)
            gray = np.clip(np.asarray(resized, np.float32), 0.0, 1.0)
            return gray[..., None] if config.grayscale else np.repeat(gray[..., None], 3, -1)
        if image.mode in ("I", "F"):
            raise ValueError(
                f"image mode {image.mode!r} (32-bit) has no known pixel range; save the image "
                "as 8- or 16-bit (PNG, JPEG)"
            )
        if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
            rgba = image.convert("RGBA")
            image = Image.alpha_composite(Image.new("RGBA", rgba.size, "white"), rgba)
        image = image.convert("L" if config.grayscale else "RGB")
        image = image.resize(size, Image.Resampling.BILINEAR)
        pixels = np.asarray(image, np.float32) / 255.0
    return pixels[..., None] if config.grayscale else pixels


def _parse_row(line: str, where: str, config: JsonlDataConfig) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataFormatError(f"{where}: not valid JSON ({err.msg}); one object per line") from err
    if not isinstance(row, dict):
        raise DataFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [f for f in JSONL_FIELDS if f not in row]
    if missing:
        raise DataFormatError(
            f"{where}: missing field(s) {missing}; every line needs {list(JSONL_FIELDS)}"
        )
    if not isinstance(row["text"], str) or not isinstance(row["img"], str):
        raise DataFormatError(f"{where}: 'text' and 'img' must be strings")
    label = row["label"]
    if isinstance(label, bool) or label not in config.labels:
        raise DataFormatError(
            f"{where}: unknown label {label!r}; JsonlDataConfig.labels is {list(config.labels)}"
        )
    return row


def load_jsonl(path: str | Path, config: JsonlDataConfig, tokenizer) -> MultimodalDataset:
    """One split in the Hateful Memes layout; a bad row raises DataFormatError naming its line.

    Images: `data_dir / img`, read with Pillow, resized, cut into patches. Text: the tokenizer's
    ids (special tokens included), truncated to max_text_len, padded with 0 and masked.
    """
    path = Path(path)
    image_root = Path(config.data_dir)
    ids, texts, images, labels, first_line = [], [], [], [], {}
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            row = _parse_row(line, where, config)
            sample_id = str(row["id"])
            if sample_id in first_line:
                raise DataFormatError(
                    f"{where}: duplicate id {sample_id!r} (first on line {first_line[sample_id]})"
                )
            first_line[sample_id] = line_no
            image_path = image_root / row["img"]
            try:
                images.append(_read_image(image_path, config))
            except (OSError, ValueError) as err:
                raise DataFormatError(
                    f"{where}: cannot read image {image_path} ({type(err).__name__}: {err}); "
                    "check the file and that 'img' is relative to data_dir"
                ) from err
            ids.append(sample_id)
            texts.append(row["text"])
            labels.append(config.labels.index(row["label"]))
    if not ids:
        raise DataFormatError(f"{path}: no samples")
    t = config.max_text_len
    text_ids = np.zeros((len(texts), t), np.int32)
    text_mask = np.zeros((len(texts), t), bool)
    for i, text in enumerate(texts):
        tokens = tokenizer(text, truncation=True, max_length=t)["input_ids"]
        text_ids[i, : len(tokens)] = tokens
        text_mask[i, : len(tokens)] = True
    patches = patchify_np(np.stack(images), config.patch_size)
    return MultimodalDataset(
        text_ids_nt=text_ids,
        text_mask_nt=text_mask,
        image_npd=patches,
        image_mask_np=np.ones(patches.shape[:2], bool),
        label_n=np.asarray(labels, np.int32),
        num_classes=len(config.labels),
        vocab_size=len(tokenizer),
        ids=tuple(ids),
    )


def make_jsonl_splits(config: JsonlDataConfig) -> dict[str, MultimodalDataset]:
    """The train / validation / test splits of a Hateful-Memes-layout dataset."""
    config.validate()
    tokenizer = load_tokenizer(config.tokenizer_dir)
    return {
        name: load_jsonl(Path(config.data_dir) / file, config, tokenizer)
        for name, file in config.split_files.items()
    }


def make_splits(config: DigitsCaptionConfig | JsonlDataConfig) -> dict[str, MultimodalDataset]:
    """The splits a data config describes."""
    if isinstance(config, DigitsCaptionConfig):
        return make_digits_caption(config)
    if isinstance(config, JsonlDataConfig):
        return make_jsonl_splits(config)
    raise TypeError(f"expected DigitsCaptionConfig or JsonlDataConfig, got {type(config).__name__}")
