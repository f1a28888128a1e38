"""Bit-for-bit comparison of fp4moe's NVFP4 codecs (SPEC §2) with ml_dtypes.

The C++ encoders are reached through the `nvfp4_codec` tool (tools/nvfp4_codec.cpp), found in
the build folder named by FP4MOE_BUILD_DIR (default "build", relative to the repository root).

Where ml_dtypes and the SPEC differ on purpose, the comparison is split:
- float8_e4m3fn: ml_dtypes rounds to nearest even without saturating, so |x| > 464 (past the
  midpoint between 448 and the NaN code) and +-Inf become NaN (0x7f/0xff); our encoder is
  `satfinite` and gives +-448 (0x7e/0xfe). We compare where ml_dtypes is finite and check the
  saturation separately. NaN inputs give 0x7f with the sign kept in both, so they are compared.
- float4_e2m1fn: ml_dtypes saturates at +-6 (Inf included), like us, so every non-NaN input is
  compared. It has no NaN; it turns NaN into a zero whose sign is the inverse of the NaN's sign
  bit (an artifact of its conversion, not a documented behaviour). We encode NaN as +0 (code 0),
  see docs/numerics.md, so NaN inputs are excluded from the e2m1 comparison and checked alone.
"""

import os
import pathlib
import subprocess

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
E2M1_MAX = 6.0
E4M3_MAX = 448.0


def _codec_path() -> pathlib.Path:
    build = pathlib.Path(os.environ.get("FP4MOE_BUILD_DIR", "build"))
    if not build.is_absolute():
        build = REPO_ROOT / build
    return build / "nvfp4_codec"


@pytest.fixture(scope="module")
def codec():
    path = _codec_path()
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.skip(f"nvfp4_codec not built: {path} is missing (set FP4MOE_BUILD_DIR to the build folder "
                    f"and build the target nvfp4_codec)")
    return path


def _run(codec, *args):
    proc = subprocess.run([str(codec), *map(str, args)], capture_output=True, text=True)
    assert proc.returncode == 0, f"nvfp4_codec {' '.join(map(str, args))} failed: {proc.stderr}"


def encode(codec, tmp_path, x):
    """Our (e2m1, e4m3) codes of the fp32 values x, one uint8 per value."""
    x = np.ascontiguousarray(x, dtype="<f4")
    src, o4, o8 = tmp_path / "in.f32", tmp_path / "e2m1.u8", tmp_path / "e4m3.u8"
    x.tofile(src)
    _run(codec, "encode", src, o4, o8)
    e2m1 = np.fromfile(o4, dtype=np.uint8)
    e4m3 = np.fromfile(o8, dtype=np.uint8)
    assert e2m1.shape == x.shape and e4m3.shape == x.shape
    return e2m1, e4m3


def ml_e2m1(x):
    # ml_dtypes stores one float4_e2m1fn per byte, the code in the low nibble.
    with np.errstate(invalid="ignore", over="ignore"):
        codes = np.asarray(x, np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    assert codes.max(initial=0) < 16
    return codes


def ml_e4m3(x):
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(x, np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _fmt(x, ours, theirs, mask):
    idx = np.flatnonzero(mask)[:10]
    return "; ".join(f"x={x[i]!r} (bits {x.view(np.uint32)[i]:#010x}) ours={ours[i]:#04x} ml_dtypes={theirs[i]:#04x}"
                     for i in idx)


def check_e2m1(x, ours):
    """Compare our e2m1 codes with ml_dtypes on every non-NaN input; NaN must give +0."""
    nan = np.isnan(x)
    theirs = ml_e2m1(x)
    diff = (ours != theirs) & ~nan
    assert not diff.any(), f"{diff.sum()} e2m1 mismatches: " + _fmt(x, ours, theirs, diff)
    assert (ours[nan] == 0).all()
    return int((~nan).sum())


def check_e4m3(x, ours):
    """Compare with ml_dtypes where it is finite (NaN inputs included: same code); where ml_dtypes
    overflows to NaN the input must be beyond 448 and ours saturated."""
    theirs = ml_e4m3(x)
    their_nan = (theirs & 0x7F) == 0x7F
    overflow = their_nan & ~np.isnan(x)
    compared = ~overflow
    diff = (ours != theirs) & compared
    assert not diff.any(), f"{diff.sum()} e4m3 mismatches: " + _fmt(x, ours, theirs, diff)
    # ml_dtypes only turns values past the max into NaN, and there we saturate.
    assert (np.abs(x[overflow]) > E4M3_MAX).all()
    sign = np.where(np.signbit(x[overflow]), 0x80, 0).astype(np.uint8)
    assert (ours[overflow] == (0x7E | sign)).all()
    # Independently of ml_dtypes: everything at or beyond +-448 saturates.
    big = np.abs(x) >= E4M3_MAX
    assert (ours[big] == (0x7E | np.where(np.signbit(x[big]), 0x80, 0))).all()
    return int(compared.sum())


def _neighbours(v):
    """v and the fp32 values just below and above it, with both signs."""
    v = np.asarray(v, np.float32)
    out = np.concatenate([v, np.nextafter(v, np.float32(-np.inf)), np.nextafter(v, np.float32(np.inf))])
    return np.concatenate([out, -out])


def _midpoints(values):
    values = np.sort(np.asarray(values, np.float64))
    return ((values[:-1] + values[1:]) / 2).astype(np.float32)  # exact: one bit more than the formats


def e2m1_positive_values():
    return np.arange(8, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def e4m3_positive_values():
    return np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.finfo(np.float32).max, -np.finfo(np.float32).max,
                     np.finfo(np.float32).tiny, np.finfo(np.float32).smallest_subnormal,
                     -np.finfo(np.float32).smallest_subnormal, 1e30, -1e30], np.float32)


# ---- decode tables -----------------------------------------------------------------------------
def test_decode_tables_equal_ml_dtypes(codec, tmp_path):
    o4, o8 = tmp_path / "e2m1.f32", tmp_path / "e4m3.f32"
    _run(codec, "decode", o4, o8)
    ours4 = np.fromfile(o4, dtype="<f4")
    ours8 = np.fromfile(o8, dtype="<f4")
    assert ours4.shape == (16,) and ours8.shape == (256,)
    ref4 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    ref8 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    # SPEC §2's table, literally.
    spec = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    np.testing.assert_array_equal(ours4[:8], spec)
    np.testing.assert_array_equal(ours4.view(np.uint32), ref4.view(np.uint32))  # -0 included
    nan8 = np.isnan(ref8)
    assert np.flatnonzero(nan8).tolist() == [0x7F, 0xFF]
    assert np.isnan(ours8[nan8]).all()
    np.testing.assert_array_equal(ours8[~nan8].view(np.uint32), ref8[~nan8].view(np.uint32))


# ---- boundary and tie cases ---------------------------------------------------------------------
def test_e2m1_boundaries_and_ties(codec, tmp_path):
    reps = e2m1_positive_values()
    mids = _midpoints(reps)
    x = np.concatenate([_neighbours(reps), _neighbours(mids), _neighbours([E2M1_MAX, 6.5, 7.0, 100.0]), SPECIALS])
    # The SPEC's hand-worked ties (ties to even) must be among them.
    for t in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        assert t in x
    e2m1, _ = encode(codec, tmp_path, x)
    assert check_e2m1(x, e2m1) == x.size
    # Beyond the maximum: saturated, both here and in ml_dtypes.
    big = np.abs(x) >= E2M1_MAX
    assert (e2m1[big] == np.where(np.signbit(x[big]), 15, 7)).all()


def test_e4m3_boundaries_ties_subnormals(codec, tmp_path):
    reps = e4m3_positive_values()
    mids = _midpoints(reps)
    q = np.float32(2.0 ** -9)  # smallest subnormal
    subnormal_ties = (np.arange(16, dtype=np.float32) + np.float32(0.5)) * q
    above = np.array([448, 449, 456, 463.99997, 464, 464.00003, 465, 480, 500, 1e4], np.float32)
    x = np.concatenate([_neighbours(reps), _neighbours(mids), _neighbours(subnormal_ties), _neighbours(above),
                        SPECIALS])
    _, e4m3 = encode(codec, tmp_path, x)
    compared = check_e4m3(x, e4m3)
    assert compared > 0.9 * x.size
    # ml_dtypes overflows to NaN only past 464; up to there it agrees that the answer is 448.
    idx = np.flatnonzero(x == np.float32(464))[0]
    assert e4m3[idx] == 0x7E and ml_e4m3(x[idx:idx + 1])[0] == 0x7E


def test_nan_inputs(codec, tmp_path):
    rng = np.random.default_rng(11)
    payload = rng.integers(1, 1 << 23, size=1000, dtype=np.uint32)
    bits = np.concatenate([0x7F800000 | payload, 0xFF800000 | payload, [0x7FC00000, 0xFFC00000]]).astype(np.uint32)
    x = bits.view(np.float32)
    assert np.isnan(x).all()
    e2m1, e4m3 = encode(codec, tmp_path, x)
    assert (e2m1 == 0).all()  # our documented choice; ml_dtypes' zero here is an artifact
    # e4m3: NaN -> 0x7f with the sign bit kept, exactly as ml_dtypes.
    np.testing.assert_array_equal(e4m3, ml_e4m3(x))
    np.testing.assert_array_equal(e4m3, np.where(bits >> 31, 0xFF, 0x7F).astype(np.uint8))


# ---- random samples -----------------------------------------------------------------------------
def test_random_fp32_bit_patterns(codec, tmp_path):
    rng = np.random.default_rng(20240611)
    bits = rng.integers(0, 1 << 32, size=2_000_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    e2m1, e4m3 = encode(codec, tmp_path, x)
    n4 = check_e2m1(x, e2m1)
    n8 = check_e4m3(x, e4m3)
    # About half of all patterns are beyond 448 in magnitude; what remains is still > 10^6.
    assert n4 > 1_990_000
    assert n8 > 1_000_000


def test_random_in_representable_ranges(codec, tmp_path):
    rng = np.random.default_rng(7)
    n = 1_000_000
    x = np.concatenate([
        rng.uniform(-7.0, 7.0, n).astype(np.float32),                                   # e2m1 range
        rng.uniform(-470.0, 470.0, n).astype(np.float32),                               # e4m3 range
        (rng.choice([-1.0, 1.0], n) * 2.0 ** rng.uniform(-12.0, 9.0, n)).astype(np.float32),  # log-uniform
        (rng.integers(-64, 64, n) * 2.0 ** -10).astype(np.float32),                     # subnormal ties
    ])
    e2m1, e4m3 = encode(codec, tmp_path, x)
    assert check_e2m1(x, e2m1) == x.size
    assert check_e4m3(x, e4m3) > 0.99 * x.size


# ---- block quantization (SPEC §2) written with numpy + ml_dtypes -----------------------------------
def spec_quantize(x, gs):
    """SPEC §2 on an [N, K] fp32 matrix with ml_dtypes' casts, in fp32 in the SPEC's order."""
    gs = np.float32(gs)
    blocks = x.reshape(x.shape[0], -1, 16)
    amax = np.abs(blocks).max(axis=2)
    t = (gs * amax) / np.float32(6)
    assert (t <= np.float32(464)).all()  # so ml_dtypes' cast (no saturation) is the SPEC's here
    sf = t.astype(ml_dtypes.float8_e4m3fn)
    sf_val = sf.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = (blocks * gs) / sf_val[:, :, None]
    y = np.where(sf_val[:, :, None] == 0, np.float32(0), y).astype(np.float32)
    codes = ml_e2m1(y).reshape(x.shape[0], -1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, sf.view(np.uint8)


@pytest.mark.parametrize("N,K", [(3, 16), (17, 128), (64, 2880)])
def test_block_quantize_matches_numpy_spec(codec, tmp_path, N, K):
    rng = np.random.default_rng(N * 1000 + K)
    mags = 10.0 ** rng.uniform(-4, 0, size=(N, K // 16, 1))  # blocks of very different size
    x = (rng.standard_normal((N, K // 16, 16)) * mags).astype(np.float32).reshape(N, K)
    x[0, :16] = 0  # a zero block
    amax = np.abs(x).max()
    gs = np.float32(2688.0) / np.float32(amax)
    src, op, osf = tmp_path / "x.f32", tmp_path / "packed.u8", tmp_path / "sf.u8"
    x.astype("<f4").tofile(src)
    _run(codec, "quantize", src, K, float(gs).hex(), op, osf)
    packed = np.fromfile(op, dtype=np.uint8).reshape(N, K // 2)
    sf = np.fromfile(osf, dtype=np.uint8).reshape(N, K // 16)
    ref_packed, ref_sf = spec_quantize(x, gs)
    np.testing.assert_array_equal(sf, ref_sf)
    np.testing.assert_array_equal(packed, ref_packed)
    assert sf[0, 0] == 0 and (packed[0, :8] == 0).all()
    assert (sf == 0).sum() < sf.size  # not a trivial all-zero result


def test_codec_help_and_bad_usage(codec):
    ok = subprocess.run([str(codec), "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "encode" in ok.stdout and "decode" in ok.stdout
    bad = subprocess.run([str(codec), "encode"], capture_output=True, text=True)
    assert bad.returncode == 2
