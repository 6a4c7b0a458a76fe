"""Properties of the CIFAR-10-C-style corruption generator on synthetic natural-looking images."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import ndimage

from laplace_debiased.data import corruptions as K


def natural_images(n: int = 24, seed: int = 0) -> np.ndarray:
    """Smooth colour fields with a few sharp-edged rectangles, uint8 ``(n, 32, 32, 3)``."""
    rng = np.random.default_rng(seed)
    field = ndimage.gaussian_filter(rng.normal(size=(n, 32, 32, 3)), (0, 4, 4, 0))
    field = (field - field.min()) / (field.max() - field.min())
    for img in field:
        for _ in range(3):
            r, c = rng.integers(0, 24, 2)
            img[r : r + rng.integers(4, 9), c : c + rng.integers(4, 9)] = rng.uniform(0, 1, 3)
    return (40 + 170 * field).astype(np.uint8)


IMAGES = natural_images()


@pytest.fixture(scope="module")
def outputs():
    """``{name: [severity 1..5 outputs]}``, seed 0, computed once."""
    return {name: [K.corrupt(IMAGES, name, s, seed=0) for s in range(1, 6)] for name in K.CORRUPTIONS}


def mad(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(float) - b.astype(float)).mean())


def correlation_loss(a: np.ndarray, b: np.ndarray) -> float:
    """1 - mean per-image Pearson correlation of clean and corrupted pixels."""
    a = a.reshape(len(a), -1).astype(float)
    b = b.reshape(len(b), -1).astype(float)
    a -= a.mean(1, keepdims=True)
    b -= b.mean(1, keepdims=True)
    return float(1 - ((a * b).sum(1) / np.sqrt((a * a).sum(1) * (b * b).sum(1))).mean())


def test_standard_names():
    assert len(K.CORRUPTIONS) == 15 and len(set(K.CORRUPTIONS)) == 15
    assert len(K.EXTRA_CORRUPTIONS) == 4 and not set(K.CORRUPTIONS) & set(K.EXTRA_CORRUPTIONS)


@pytest.mark.parametrize("name", K.CORRUPTIONS)
def test_shape_dtype_range_and_change(name, outputs):
    for s, out in enumerate(outputs[name], start=1):
        assert out.shape == IMAGES.shape and out.dtype == np.uint8
        assert out.min() >= 0 and out.max() <= 255
        assert mad(out, IMAGES) > 0.2, f"{name} severity {s} barely changes the images"


@pytest.mark.parametrize("name", K.CORRUPTIONS)
def test_deterministic_given_seed(name, outputs):
    again = K.corrupt(IMAGES, name, 3, seed=0)
    np.testing.assert_array_equal(again, outputs[name][2])
    other = K.corrupt(IMAGES, name, 3, seed=1)
    random = name not in {"defocus_blur", "zoom_blur", "brightness", "contrast", "pixelate",
                          "jpeg_compression"}  # fmt: skip
    assert (not np.array_equal(other, again)) == random
    single = K.corrupt(IMAGES[0], name, 3, seed=0)
    assert single.shape == (32, 32, 3)


# Severity monotonicity of the distortion.  With the published CIFAR-10-C parameters the mean
# absolute pixel difference to the clean image grows with severity for 12 corruptions.  The three
# others are checked with what their parameter tables make monotone:
#  - frost: the image weight falls (1 .. 0.75) while the frost weight rises, so the *structure*
#    loss (1 - correlation with the clean image) grows; the pixel distance need not;
#  - glass_blur: severities 4-5 shuffle pixels twice, 1-3 once (sigma is not monotone);
#  - elastic_transform: the global affine jitter shrinks (2.56 -> 0.96 px) as the local elastic
#    displacement grows, so the pixel distance *falls* with severity.
PIXEL_MONOTONE = [n for n in K.CORRUPTIONS if n not in {"frost", "glass_blur", "elastic_transform"}]


@pytest.mark.parametrize("name", PIXEL_MONOTONE)
def test_distortion_grows_with_severity(name, outputs):
    d = [mad(out, IMAGES) for out in outputs[name]]
    assert all(b >= a - 0.05 for a, b in zip(d, d[1:])), f"{name}: {np.round(d, 2)}"
    assert d[4] > 1.3 * d[0], f"{name}: {np.round(d, 2)}"


def test_frost_glass_elastic_follow_their_parameter_tables(outputs):
    frost = [correlation_loss(IMAGES, out) for out in outputs["frost"]]
    assert all(b > a for a, b in zip(frost, frost[1:])), np.round(frost, 3)
    glass = [mad(out, IMAGES) for out in outputs["glass_blur"]]
    assert min(glass[3:]) > max(glass[:3]), np.round(glass, 2)
    elastic = [mad(out, IMAGES) for out in outputs["elastic_transform"]]
    assert elastic[0] > elastic[4], np.round(elastic, 2)


def test_published_parameters_spot_checks():
    # gaussian noise severity 1 has sigma 0.04 (x 255 = 10.2 grey levels) where not clipped
    flat = np.full((200, 32, 32, 3), 128, np.uint8)
    noise = K.corrupt(flat, "gaussian_noise", 1, seed=0).astype(float) - 128
    assert abs(noise.std() - 0.04 * 255) < 0.2
    # contrast severity 5 keeps 15 % of the deviation from the per-channel mean
    img = IMAGES[:4]
    out = K.corrupt(img, "contrast", 5).astype(float)
    dev = img - img.mean(axis=(1, 2), keepdims=True)
    np.testing.assert_allclose(out, np.floor(img.mean(axis=(1, 2), keepdims=True) + 0.15 * dev), atol=1)
    # pixelate severity 5 (factor 0.65): 20 x 20 blocks -> at most 20 distinct rows
    px = K.corrupt(IMAGES[:1], "pixelate", 5)[0]
    assert len(np.unique(px.reshape(32, -1), axis=0)) <= 20
    # brightness keeps hue: the channel ratios of a pixel are unchanged where nothing clips
    px = np.zeros((1, 32, 32, 3), np.uint8) + np.array([100, 50, 25], np.uint8)
    out = K.corrupt(px, "brightness", 1)[0, 0, 0].astype(float)
    np.testing.assert_allclose(out / out[0], [1, 0.5, 0.25], atol=0.02)
    assert abs(out[0] - (100 + 0.05 * 255)) <= 1
    # impulse noise severity 5 flips 7 % of the values to 0 or 255
    flipped = K.corrupt(flat, "impulse_noise", 5, seed=0) != 128
    assert abs(flipped.mean() - 0.07) < 0.005


def test_motion_blur_kernel_is_imagemagicks():
    w = K.motion_blur_kernel(6, 2)
    assert len(w) == 13 and abs(w.sum() - 1) < 1e-12 and np.all(np.diff(w) < 0)
    # a single bright pixel smears towards the angle: at 0 degrees along the row, to the left
    img = np.zeros((1, 32, 32), float)
    img[0, 10, 20] = 1
    out = K.line_blur(img, 6, 2, np.array([0.0]))[0]
    nonzero = np.argwhere(out > 0)
    assert set(nonzero[:, 0]) == {10} and nonzero[:, 1].max() == 20 and nonzero[:, 1].min() == 8
    np.testing.assert_allclose(out[10, 20::-1][:13], w)


def test_clipped_zoom_matches_scipy_zoom():
    x = np.random.default_rng(0).random((2, 32, 32, 3))
    for factor in (1.06, 1.75):
        ch = int(np.ceil(32 / factor))
        top = (32 - ch) // 2
        ref = np.stack([ndimage.zoom(img[top : top + ch, top : top + ch], (factor, factor, 1), order=1) for img in x])
        trim = (ref.shape[1] - 32) // 2
        np.testing.assert_allclose(K._clipped_zoom(x, factor), ref[:, trim : trim + 32, trim : trim + 32], atol=1e-12)


@pytest.mark.parametrize(
    "args, match",
    [
        ((IMAGES, "fogg", 1), "Unknown corruption 'fogg'"),
        ((IMAGES, "spatter", 1), "extra corruption"),
        ((IMAGES, "fog", 6), "severity must be an integer 1..5"),
        ((IMAGES, "fog", True), "severity must be an integer 1..5"),
        ((IMAGES.astype(np.float32), "fog", 1), "must be uint8"),
        ((IMAGES[:, :16], "fog", 1), "must be uint8"),
    ],
)
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        K.corrupt(*args)
