"""MSD data: DigitsCaption's regimes against scikit-learn's digits, the batch schedule, and the
Hateful-Memes jsonl layout (Pillow images, a real tokenizer, errors that name the line)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.metrics import roc_auc_score

from msd_jax import views
from msd_jax.data import (
    REGIMES,
    DataFormatError,
    DigitsCaptionConfig,
    JsonlDataConfig,
    batch_indices,
    load_jsonl,
    load_tokenizer,
    make_digits_caption,
    make_splits,
    patchify_np,
)
from msd_jax.train import auroc, view_metrics

CONFIG = DigitsCaptionConfig(regime_mix=(0.4, 0.2, 0.2, 0.2), keywords_per_caption=2)


@pytest.fixture(scope="module")
def splits():
    return make_digits_caption(CONFIG)


def _unpatch(patches_npd: np.ndarray, patch: int, side: int) -> np.ndarray:
    """Reassembles [N, P, patch^2] patches into [N, side, side] images, one pixel at a time."""
    n = len(patches_npd)
    out = np.zeros((n, side, side), patches_npd.dtype)
    per_row = side // patch
    for p in range(patches_npd.shape[1]):
        r0, c0 = (p // per_row) * patch, (p % per_row) * patch
        for k in range(patch * patch):
            out[:, r0 + k // patch, c0 + k % patch] = patches_npd[:, p, k]
    return out


def test_digits_caption_splits_regimes_and_captions(splits):
    assert sum(len(d) for d in splits.values()) == 1797
    assert [len(splits[s]) for s in ("validation", "test")] == [359, 359]
    digits = load_digits()
    originals = {(img / 16.0).astype(np.float32).tobytes(): y for img, y in zip(
        digits.images, digits.target, strict=True)}  # fmt: skip
    f, k = CONFIG.num_filler_tokens, CONFIG.keywords_per_class
    for data in splits.values():
        n = len(data)
        counts = np.bincount(data.regime_n, minlength=len(REGIMES))
        np.testing.assert_array_less(np.abs(counts - np.asarray(CONFIG.regime_mix) * n), 1.0)
        # Padding exactly where the mask is off; lengths within bounds.
        assert np.all((data.text_ids_nt == 0) == ~data.text_mask_nt)
        lengths = data.text_mask_nt.sum(1)
        assert lengths.min() >= CONFIG.min_caption_len and lengths.max() <= CONFIG.caption_len
        keyword = data.text_ids_nt > f
        keyword_class = np.where(keyword, (data.text_ids_nt - f - 1) // k, -1)
        images = _unpatch(data.image_npd, CONFIG.patch_size, 8)
        for i in range(n):
            regime, y = REGIMES[data.regime_n[i]], data.label_n[i]
            classes = set(keyword_class[i][keyword[i]].tolist())
            if regime == "image_only":
                assert not classes
            else:
                assert keyword[i].sum() == CONFIG.keywords_per_caption
                assert classes == ({y} if regime in ("both", "text_only") else classes - {y})
                assert len(classes) == 1
            if regime == "text_only":
                assert not images[i].any()  # blank
            else:  # the untouched digit of its label
                assert originals[images[i].tobytes()] == y


def test_digits_caption_is_a_function_of_its_seed(splits):
    again = make_digits_caption(CONFIG)
    other = make_digits_caption(DigitsCaptionConfig(seed=1, regime_mix=CONFIG.regime_mix))
    for name, data in splits.items():
        np.testing.assert_array_equal(again[name].text_ids_nt, data.text_ids_nt)
        np.testing.assert_array_equal(again[name].image_npd, data.image_npd)
        assert not np.array_equal(other[name].label_n, data.label_n)


def test_scrambled_images_and_noise():
    config = DigitsCaptionConfig(uninformative_image="scrambled", image_noise=0.0)
    train = make_digits_caption(config)["train"]
    text_only = train.regime_n == REGIMES.index("text_only")
    ink = np.sort(train.image_npd[text_only].reshape(text_only.sum(), -1), axis=1)
    digits = {np.sort((img / 16.0).astype(np.float32).ravel()).tobytes()
              for img in load_digits().images}  # fmt: skip
    assert all(row.tobytes() in digits for row in ink)  # a digit's pixels, permuted
    noisy = make_digits_caption(DigitsCaptionConfig(image_noise=0.1))["train"]
    clean = make_digits_caption(DigitsCaptionConfig())["train"]
    diff = noisy.image_npd - clean.image_npd
    assert 0.09 < diff.std() < 0.11


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("regime_mix", (0.5, 0.5, 0.5, 0.0), "summing to 1"),
        ("patch_size", 3, "divide the 8x8"),
        ("uninformative_image", "noise", "expected one of"),
        ("min_caption_len", 20, "min_caption_len <= caption_len"),
    ],
)
def test_digits_caption_config_errors(field, value, match):
    with pytest.raises(ValueError, match=match):
        DigitsCaptionConfig(**{field: value}).validate()


def test_patchify_matches_views_patchify():
    images = np.random.default_rng(0).normal(size=(3, 8, 12, 2)).astype(np.float32)
    np.testing.assert_array_equal(patchify_np(images, 4), np.asarray(views.patchify(images, 4)))


def test_batch_indices_are_seeded_epochs():
    n, bs = 50, 16  # 3 batches an epoch, 2 samples dropped
    epoch0 = np.concatenate([batch_indices(n, bs, 7, s) for s in range(3)])
    assert len(set(epoch0.tolist())) == 48 and epoch0.max() < n
    np.testing.assert_array_equal(batch_indices(n, bs, 7, 4), batch_indices(n, bs, 7, 4))
    assert not np.array_equal(batch_indices(n, bs, 7, 3), batch_indices(n, bs, 7, 0))
    assert not np.array_equal(batch_indices(n, bs, 8, 0), batch_indices(n, bs, 7, 0))
    with pytest.raises(ValueError, match="batch_size"):
        batch_indices(n, 64, 0, 0)


def test_view_metrics_per_view_and_regime(splits):
    data = splits["test"]
    logits = np.random.default_rng(0).normal(size=(len(data), 3, 10)).astype(np.float32)
    logits[: len(data) // 2, 0, :] = 0.0
    logits[np.arange(len(data) // 2), 0, data.label_n[: len(data) // 2]] = 1.0  # half right
    metrics = view_metrics(logits, data)
    for v, name in enumerate(("full", "text", "image")):
        expected = np.mean([np.argmax(logits[i, v]) == data.label_n[i] for i in range(len(data))])
        assert metrics[f"accuracy/{name}"] == expected
    for r, regime in enumerate(REGIMES):
        rows = [i for i in range(len(data)) if data.regime_n[i] == r]
        expected = np.mean([np.argmax(logits[i, 0]) == data.label_n[i] for i in rows])
        assert metrics[f"by_regime/{regime}"] == expected
    assert not any(k.startswith("auroc") for k in metrics)
    rows = np.flatnonzero(data.label_n < 2)
    binary = view_metrics(logits[rows, :, :2], data.subset(rows))
    assert "auroc/full" in binary and "by_regime/both" in binary


def test_auroc_matches_sklearn():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 200)
    scores = np.round(rng.normal(size=200) + labels, 1)  # with ties
    assert auroc(scores, labels) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    assert np.isnan(auroc(scores, np.zeros(200, int)))


# The Hateful-Memes layout -------------------------------------------------------------------

WORDS = ["[PAD]", "[UNK]", "a", "cat", "dog", "love", "hate", "this"]


def _tokenizer_dir(path) -> str:
    """A tiny WordLevel tokenizer saved like a real one (offline)."""
    import tokenizers
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = tokenizers.Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]")
    )
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]")
    tokenizer.save_pretrained(str(path))
    return str(path)


def _image(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


ROWS = [
    {"id": 42953, "img": "img/42953.png", "text": "i love this cat", "label": 0},
    {"id": 23058, "img": "img/23058.png", "text": "a dog a dog a dog a dog", "label": 1},
    {"id": 13894, "img": "img/13894.png", "text": "", "label": 1},
]


@pytest.fixture()
def memes(tmp_path):
    (tmp_path / "img").mkdir()
    for i, row in enumerate(ROWS):
        Image.fromarray(_image(i, 16)).save(tmp_path / row["img"])
    for split in ("train", "dev", "test"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config = JsonlDataConfig(
        data_dir=str(tmp_path),
        tokenizer_dir=_tokenizer_dir(tmp_path / "tokenizer"),
        image_size=16,
        patch_size=8,
        max_text_len=6,
    )
    return tmp_path, config


def test_jsonl_loader_reads_images_text_and_labels(memes):
    root, config = memes
    data = load_jsonl(root / "train.jsonl", config, load_tokenizer(config.tokenizer_dir))
    assert data.ids == ("42953", "23058", "13894")
    np.testing.assert_array_equal(data.label_n, [0, 1, 1])
    assert data.num_classes == 2 and data.vocab_size == len(WORDS)
    ids = {w: i for i, w in enumerate(WORDS)}
    expected = [
        [ids["[UNK]"], ids["love"], ids["this"], ids["cat"], 0, 0],
        [ids["a"], ids["dog"]] * 3,  # truncated to max_text_len
        [0] * 6,
    ]
    np.testing.assert_array_equal(data.text_ids_nt, expected)
    np.testing.assert_array_equal(data.text_mask_nt.sum(1), [4, 6, 0])
    assert data.image_npd.shape == (3, 4, 8 * 8 * 3)
    for i in range(3):  # patch p, position (r, c), channel ch <- pixel (8 pr + r, 8 pc + c, ch)
        pixels = _image(i, 16).astype(np.float32) / 255.0
        for p in range(4):
            block = pixels[8 * (p // 2) : 8 * (p // 2) + 8, 8 * (p % 2) : 8 * (p % 2) + 8]
            np.testing.assert_allclose(data.image_npd[i, p], block.reshape(-1), atol=1e-7)
    assert data.image_mask_np.all()


def test_jsonl_splits_resize_and_grayscale(memes):
    root, config = memes
    Image.fromarray(_image(5, 40)).save(root / "img" / "42953.png")  # any size is resized
    config = JsonlDataConfig(**{**config.__dict__, "grayscale": True, "labels": (1, 0)})
    splits = make_splits(config)
    assert sorted(splits) == ["test", "train", "validation"]
    for data in splits.values():
        assert data.image_npd.shape == (3, 4, 64)
        assert 0.0 <= data.image_npd.min() and data.image_npd.max() <= 1.0
        np.testing.assert_array_equal(data.label_n, [1, 0, 0])  # labels (1, 0): 1 is class 0


@pytest.mark.parametrize(
    "line, match",
    [
        ('{"id": 7, "img": "img/42953.png", "label": 0}', r"missing field\(s\) \['text'\]"),
        ('{"id": 7, "img": "img/42953.png", "text": "a", "label": 3}', "unknown label 3"),
        ('{"id": 7, "img": "img/broken.png", "text": "a", "label": 0}', "cannot read image"),
        ('{"id": 7, "img": "img/missing.png", "text": "a", "label": 0}', "cannot read image"),
        ('{"id": 42953, "img": "img/42953.png", "text": "a", "label": 0}', "duplicate id"),
        ('{"id": 7, "img": "img/42953.png", "text": "a", "label": 0', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_jsonl_bad_row_names_its_line(memes, line, match):
    root, config = memes
    (root / "img" / "broken.png").write_bytes(b"not a png at all")
    lines = [json.dumps(r) for r in ROWS[:2]] + ["", line]  # the bad row is on line 4
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError, match=match) as err:
        load_jsonl(root / "train.jsonl", config, load_tokenizer(config.tokenizer_dir))
    assert f"{root / 'train.jsonl'}:4:" in str(err.value)


def test_jsonl_config_errors(tmp_path):
    with pytest.raises(ValueError, match="must divide image_size"):
        JsonlDataConfig(data_dir=".", tokenizer_dir=".", image_size=30, patch_size=8).validate()
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("grayscale", [True, False])
def test_images_of_any_mode_are_read_in_range_or_refused(memes, grayscale):
    """16-bit grayscale keeps its range (not clipped to 8 bits), transparency is composited onto
    white, palette / CMYK / LA convert, 32-bit float images are refused with the fix."""
    from msd_jax.data import _read_image

    root, config = memes
    config = JsonlDataConfig(**{**config.__dict__, "grayscale": grayscale, "image_size": 8})
    channels = 1 if grayscale else 3
    half = np.full((10, 10), 32768, np.uint16)  # mid-grey at 16 bits
    Image.fromarray(half).save(root / "i16.png")
    rgba = np.zeros((10, 10, 4), np.uint8)  # black, fully transparent
    Image.fromarray(rgba, "RGBA").save(root / "rgba.png")
    Image.fromarray(_image(1, 12)).convert("P").save(root / "p.png")
    Image.fromarray(_image(2, 12)).convert("CMYK").save(root / "cmyk.jpg")
    Image.fromarray(_image(3, 12)).convert("LA").save(root / "la.png")
    Image.fromarray(np.ones((6, 6), np.float32), "F").save(root / "f.tiff")
    got = {name: _read_image(root / name, config) for name in
           ("i16.png", "rgba.png", "p.png", "cmyk.jpg", "la.png")}  # fmt: skip
    for name, pixels in got.items():
        assert pixels.shape == (8, 8, channels) and pixels.dtype == np.float32, name
        assert 0.0 <= pixels.min() and pixels.max() <= 1.0, name
    np.testing.assert_allclose(got["i16.png"], 32768 / 65535, atol=1e-6)
    np.testing.assert_allclose(got["rgba.png"], 1.0)  # transparent -> white, not black
    with pytest.raises(ValueError, match="'F' .*save the image as 8- or 16-bit"):
        _read_image(root / "f.tiff", config)
