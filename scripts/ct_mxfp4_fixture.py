#!/usr/bin/env python3
"""Pack test matrices with the real compressed-tensors library and save the bytes as a fixture for tests/test_mxfp4.py.

compressed-tensors needs torch, which tqbench does not depend on, so this runs in a separate throwaway venv:

    python3 -m venv /tmp/ctvenv
    /tmp/ctvenv/bin/pip install torch==2.13.0        # first: this pin takes the CPU wheel (a plain `torch` pulls CUDA)
    /tmp/ctvenv/bin/pip install compressed-tensors numpy
    /tmp/ctvenv/bin/python scripts/ct_mxfp4_fixture.py                  # -> tests/data/compressed_tensors_mxfp4.npz
    PYTHONPATH=. /tmp/ctvenv/bin/python scripts/ct_mxfp4_fixture.py --compare 2000   # a large random comparison
    PYTHONPATH=. /tmp/ctvenv/bin/python scripts/ct_mxfp4_fixture.py --check-checkpoint tqbench/demo/checkpoint

Each matrix goes the library's own way for the `MXFP4A16` preset (mxfp4-pack-quantized, group 32, uint8 scales):
the per-group min/max and scale of `compute_dynamic_scales_and_zp` (what the minmax observer computes), then
`MXFP4PackedCompressor.compress`, which writes `weight_packed` and `weight_scale`. Matrices marked bf16 are given to
the library as bfloat16 tensors (the dtype of real checkpoints before quantization); their values are exact in float32.
`--compare` packs random matrices with both the library and tqbench's packer (imported from this checkout, hence
`PYTHONPATH=.`; it needs only numpy) and reports the bytes that differ. `--check-checkpoint DIR` decodes every mxfp4
matrix of a checkpoint (tqbench's exact decoder) and checks that the library packs the decoded values into the very
bytes of the file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from compressed_tensors import __version__ as ct_version
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import MXFP4A16
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "compressed_tensors_mxfp4.npz"
SCHEME = QuantizationScheme(targets=["Linear"], **MXFP4A16)


def ct_pack(w: np.ndarray, bf16: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(packed, scales) of a [rows, cols] matrix as compressed-tensors writes them."""
    x = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    if bf16:
        x = x.to(torch.bfloat16)
        assert np.array_equal(x.float().numpy(), w), "bf16 matrices must hold bf16 values"
    scale, zp = compute_dynamic_scales_and_zp(x, SCHEME.weights, module=None)
    out = MXFP4PackedCompressor.compress({"weight": x, "weight_scale": scale, "weight_zero_point": zp}, SCHEME)
    return out["weight_packed"].numpy(), out["weight_scale"].numpy()


def to_bf16_values(w: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.asarray(w, np.float32)).to(torch.bfloat16).float().numpy()


def matrices() -> dict[str, tuple[np.ndarray, bool]]:
    """name -> (float32 matrix, pack as bf16)."""
    rng = np.random.default_rng(20260601)
    E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    out: dict[str, tuple[np.ndarray, bool]] = {}
    out["gaussian"] = (rng.standard_normal((2, 128)).astype(np.float32) * np.float32(0.05), False)
    out["gaussian_bf16"] = (to_bf16_values(rng.standard_normal((2, 128)) * 0.02), True)
    out["heavy_tailed"] = (rng.standard_t(1.5, (2, 128)).astype(np.float32), False)

    # Exact zeros: all-zero groups, -0.0, sparse groups, tiny negatives that round to zero.
    z = np.zeros((4, 128), np.float32)
    z[0, 32:64] = -0.0
    z[1, ::7] = rng.standard_normal(len(range(0, 128, 7)))
    z[2, :32] = np.where(np.arange(32) % 2, -0.0, 0.0)
    z[2, 64:96] = [-1e-3, 1e-3, -0.0, 0.0] * 8
    z[2, 64] = 4.0
    z[3] = -rng.uniform(0, 0.1, 128)
    z[3, 96:] = 0.0
    out["zeros"] = (z, False)

    # Group maxima on and around the rounding points of the scale: powers of two, 1.75 * 2^k, the float just below.
    rows = []
    for k in (-20, 0, 30):
        for top in (1.0, 1.5, 1.75, np.nextafter(np.float32(1.75), np.float32(0)), 1.99999, 6 / 4, 7 / 4, 1.25):
            g = rng.uniform(-1, 1, 32) * top
            g[rng.integers(32)] = top * (1 if rng.random() < 0.5 else -1)
            rows.append(np.float32(2.0**k) * g.astype(np.float32))
    pow2 = np.array(rows, np.float32).reshape(-1, 128)
    out["power_of_two_max"] = (pow2, False)

    # Values exactly on E2M1 grid points and tie points (at scale 2^-2, 2^0 and 2^3), and one ulp either side.
    rows = []
    for k in (-2, 0, 3):
        s = np.float32(2.0**k)
        for pts in (E2M1, mids):
            v = np.concatenate([pts, -pts]).astype(np.float32)
            for d in (0, 1, -1):
                vals = v if d == 0 else np.nextafter(v, np.float32(d * np.inf))
                row = np.zeros(32, np.float32)
                row[: len(vals)] = vals
                row[-1] = 6.0  # pins the group's scale at 2^0 before scaling by s
                rows.append(row * s)
    ties = np.array(rows, np.float32).reshape(-1, 96)
    out["grid_and_ties"] = (ties, False)

    # Saturation: group maxima between 6 and 7 (clipped to 6) and from 7 up (the scale rounds up instead).
    sat = np.tile(rng.uniform(-1, 1, (1, 128)).astype(np.float32), (4, 1))
    for i, top in enumerate((6.0, 6.5, 6.99, 7.0)):
        sat[i, ::32] = top
        sat[i, 17::32] = -top
    out["saturation"] = (sat, False)

    # Huge and tiny: groups spread over every binade a float32 scale can hold, subnormals, the largest finite groups.
    k = np.linspace(-149, 126, 32).round().astype(int)
    mags = rng.uniform(0.5, 2.0, (32, 32)) * np.exp2(k)[:, None].astype(np.float64)
    mags = np.where(rng.random((32, 32)) < 0.5, -mags, mags).astype(np.float32)
    mags[-1, 0] = np.nextafter(np.float32(1.75 * 2.0**127), np.float32(0))  # the largest group max it can scale
    mags[-2, 0] = np.float32(2.0**127)
    mags[0, :4] = [1e-45, -1e-45, 2e-45, -3e-45]  # smallest subnormals
    out["huge_and_tiny"] = (mags.reshape(-1, 128), False)
    return out


def compare(n: int) -> None:
    """Random matrices at many scales through both packers: how many bytes differ (expected: none)."""
    from tqbench.quant.mxfp4 import pack_mxfp4

    rng = np.random.default_rng(1)
    diff_p = diff_s = total_p = total_s = 0
    for i in range(n):
        rows = int(rng.integers(1, 64))
        w = rng.standard_normal((rows, 256)) * np.exp2(rng.integers(-60, 60, (rows, 8))).repeat(32, axis=1)
        if i % 3 == 1:
            w = rng.standard_t(1.2, (rows, 256)) * 1e-2
        if i % 3 == 2:
            w = np.where(rng.random(w.shape) < 0.3, 0.0, w)
        bf16 = i % 2 == 1
        w = to_bf16_values(w) if bf16 else w.astype(np.float32)
        p1, s1 = ct_pack(w, bf16)
        p2, s2 = pack_mxfp4(w)
        diff_p += int((p1 != p2).sum())
        diff_s += int((s1 != s2).sum())
        total_p += p1.size
        total_s += s1.size
    print(f"compare: {n} matrices, {total_p:,} packed bytes ({diff_p} differ), {total_s:,} scale bytes "
          f"({diff_s} differ)")


def check_checkpoint(root: Path) -> None:
    """Every `*.weight_packed` / `*.weight_scale` pair of a checkpoint equals the library's packing of its decoded
    values."""
    from safetensors.torch import load_file

    from tqbench.quant.mxfp4 import unpack_mxfp4

    tensors = {}
    for f in sorted(root.glob("*.safetensors")):
        tensors.update({k: v for k, v in load_file(f).items() if k.endswith((".weight_packed", ".weight_scale"))})
    n = bad = 0
    for name, packed in tensors.items():
        if name.endswith(".weight_packed"):
            scales = tensors[name.removesuffix("_packed") + "_scale"].numpy()
            p, s = ct_pack(unpack_mxfp4(packed.numpy(), scales))
            n += 1
            bad += not (np.array_equal(p, packed.numpy()) and np.array_equal(s, scales))
    print(f"check-checkpoint {root}: {n} mxfp4 matrices, {bad} differ from compressed-tensors' packing of their values")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--compare", type=int, default=0, metavar="N", help="also compare N random matrices, not saved")
    p.add_argument("--check-checkpoint", type=Path, default=None, metavar="DIR",
                   help="only check that DIR's mxfp4 tensors are the library's packing of their decoded values")
    a = p.parse_args(argv)
    if a.check_checkpoint:
        check_checkpoint(a.check_checkpoint)
        return
    names, shapes, flags, ws, ps, ss = [], [], [], [], [], []
    for name, (w, bf16) in matrices().items():
        assert np.isfinite(w).all() and w.shape[1] % 32 == 0
        packed, scales = ct_pack(w, bf16)
        names.append(name)
        shapes.append(w.shape)
        flags.append(bf16)
        ws.append(w.reshape(-1))
        ps.append(packed.reshape(-1))
        ss.append(scales.reshape(-1))
        print(f"{name}: {w.shape}, scale bytes {scales.min()}..{scales.max()}")
    # One array per field, the matrices' rows back to back (few zip entries keep the file small).
    arrays = {"names": np.array(names), "shapes": np.array(shapes, np.int64), "bf16": np.array(flags),
              "weight": np.concatenate(ws), "weight_packed": np.concatenate(ps), "weight_scale": np.concatenate(ss),
              "versions": np.array([f"compressed-tensors {ct_version}", f"torch {torch.__version__}"])}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(a.out, **arrays)
    print(f"wrote {a.out} ({a.out.stat().st_size:,} bytes), compressed-tensors {ct_version}, torch {torch.__version__}")
    if a.compare:
        compare(a.compare)


if __name__ == "__main__":
    main()
