"""Calibrated rounding (tqbench.quant.calibrate): GPTQ's error feedback in the rotated domain, in TurboQuant's format.

The codes are checked against a second, plainly written formulation (at each column, the least-squares optimum of
the columns not yet fixed, by a linear solve: no Cholesky factor of H^-1, no lazy block updates); the output error
against nearest rounding's on correlated inputs; and the format against `turboquant.quantize` (H = identity gives
its very codes and scales; dequantize reads the result)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tqbench.quant import calibrate as cal
from tqbench.quant import turboquant as tq


def input_mix(rng, n: int) -> np.ndarray:
    """A distribution of inputs with a few strong directions and uneven columns, as a layer's activations are."""
    return rng.standard_normal((n, n)) * (rng.random(n) ** 3)[None, :]


def correlated_inputs(rng, tokens: int, n: int, mix: np.ndarray | None = None) -> np.ndarray:
    mix = input_mix(rng, n) if mix is None else mix
    return (rng.standard_normal((tokens, n)) @ mix + 0.1 * rng.standard_normal((tokens, n))).astype(np.float32)


def reference_codes(w_rot: np.ndarray, h: np.ndarray, kind: str, group: int, damp: float) -> np.ndarray:
    """GPTQ written differently: before choosing column j, the columns not yet fixed are set to their least-squares
    optimum given the fixed ones, W_R = W_R + (W_F - Q_F) H_FR H_RR^-1 (from the original weights), and column j is
    rounded to the nearest level at the group's scale, searched on the columns of its group at that moment."""
    h = h + damp * np.mean(np.diag(h)) * np.eye(len(h))
    w0 = w_rot.astype(np.float64)
    rows, n = w0.shape
    q = np.zeros_like(w0)
    codes = np.zeros((rows, n), dtype=np.uint32)
    book, bounds = tq.codebook(kind).astype(np.float32), tq.boundaries(kind)
    for j in range(n):
        f, r = np.arange(j), np.arange(j, n)
        cur = w0[:, r] + (w0[:, f] - q[:, f]) @ h[np.ix_(f, r)] @ np.linalg.inv(h[np.ix_(r, r)]) if j else w0.copy()
        if j % group == 0:
            s = np.array(tq.group_scales(mx.array(cur[:, :group].astype(np.float32)), kind, group))[:, 0]
            s32 = s.astype(np.float32)
        c = np.searchsorted(bounds, cur[:, 0].astype(np.float32) / s32, side="right")
        codes[:, j] = c
        q[:, j] = book[c] * s32
    return codes


def test_codes_match_a_least_squares_reference():
    rng = np.random.default_rng(1)
    n, rows = 64, 12
    x = correlated_inputs(rng, 400, n)
    w = rng.standard_normal((rows, n)).astype(np.float32)
    h = x.T.astype(np.float64) @ x
    codes, _ = cal.gptq_codes(w, h, "3", 32)
    ref = reference_codes(w, h, "3", 32, cal.DAMP)
    assert (codes == ref).mean() > 0.995  # float32 against float64: a rare value lands on the other side of a boundary


def test_identity_hessian_gives_nearest_rounding():
    """With H = c I nothing is fed back: GPTQ's codes and scales are turboquant.quantize's, bit for bit; the refit
    and polish that follow can only lower the error, which H = I makes the weights' own."""
    rng = np.random.default_rng(2)
    w = mx.array(rng.standard_normal((48, 256)).astype(np.float32))
    signs = mx.array(tq.rotation_signs("model.layers.0.mlp.up_proj", 256))
    for kind, rule in (("3", "search"), ("4", "rms"), ("T", "search")):
        plain = tq.quantize(w, kind, 64, signs, rule=rule)
        got = cal.quantize_calibrated(w, kind, 64, signs, 7.0 * np.eye(256), rule=rule, refits=0)
        assert np.array_equal(np.array(got.weight), np.array(plain.weight))
        assert np.array_equal(np.array(got.scales), np.array(plain.scales))
        assert got.rel_error == pytest.approx(plain.rel_error, rel=1e-5)
        refined = cal.quantize_calibrated(w, kind, 64, signs, 7.0 * np.eye(256), rule=rule)
        assert refined.rel_error <= plain.rel_error * (1 + 1e-6)


def test_refit_and_polish_never_raise_the_objective():
    """refit_scales solves for each row's scales exactly (kept where float16 rounding would lose), polish_codes moves
    one code at a time to its exact best: the calibration objective tr((W - Q) H (W - Q)^T) only falls."""
    rng = np.random.default_rng(5)
    n, rows = 128, 32
    x = correlated_inputs(rng, 1000, n)
    h = x.T.astype(np.float64) @ x
    w = rng.standard_normal((rows, n)).astype(np.float32)
    book = tq.codebook("3").astype(np.float64)

    def objective(codes, scales):
        d = w - (book[codes].reshape(rows, -1, 64) * scales.astype(np.float64)[..., None]).reshape(rows, n)
        return float(np.einsum("ri,ij,rj->", d, h, d))

    codes, scales = cal.gptq_codes(w, h, "3", 64)
    steps = [objective(codes, scales)]
    for _ in range(3):
        scales = cal.refit_scales(w, h, codes, scales, kind="3", group=64)
        steps.append(objective(codes, scales))
        codes = cal.polish_codes(w, h, codes, scales, kind="3", group=64)
        steps.append(objective(codes, scales))
    assert all(b <= a * (1 + 1e-9) for a, b in zip(steps, steps[1:]))
    assert steps[-1] < 0.9 * steps[0]


@pytest.mark.parametrize("kind,most", [("3", 0.6), ("4", 0.6), ("T", 0.75)])  # measured 0.44, 0.39, 0.56
def test_output_error_below_nearest_rounding(kind, most):
    """On inputs like the calibration's (other tokens of the same distribution), the layer's output error is lower
    than nearest rounding's, in the same bytes; the weights' own error is higher."""
    rng = np.random.default_rng(3)
    n, rows = 256, 64
    mix = input_mix(rng, n)
    x_cal, x_test = correlated_inputs(rng, 2048, n, mix), correlated_inputs(rng, 2048, n, mix)  # other tokens
    w = mx.array(rng.standard_normal((rows, n)).astype(np.float32))
    signs = mx.array(tq.rotation_signs("m", n))
    book = mx.array(tq.codebook(kind))

    def out_error(q: tq.Quantized, x: np.ndarray) -> float:
        w_hat = np.array(tq.dequantize(q.weight, q.scales, book, signs, n))
        return float(np.linalg.norm(x @ (np.array(w) - w_hat).T) / np.linalg.norm(x @ np.array(w).T))

    plain = tq.quantize(w, kind, 64, signs)
    calibrated = cal.quantize_calibrated(w, kind, 64, signs, x_cal.T.astype(np.float64) @ x_cal)
    assert calibrated.weight.shape == plain.weight.shape and calibrated.scales.dtype == mx.float16
    assert out_error(calibrated, x_test) < most * out_error(plain, x_test)
    assert calibrated.rel_error > plain.rel_error


def test_rotated_hessian_is_that_of_rotated_inputs():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((100, 96)).astype(np.float32)
    signs = tq.rotation_signs("p", 96)
    xr = np.array(tq.rotate(mx.array(x), mx.array(signs)), dtype=np.float64)
    got = cal.rotated_hessian(x.T.astype(np.float64) @ x, signs)
    np.testing.assert_allclose(got, xr.T @ xr, rtol=1e-4, atol=1e-3)


def test_expert_hessian_shrinks_toward_the_layer():
    h, pooled = np.eye(4), 10 * np.ones((4, 4))
    np.testing.assert_allclose(cal.expert_hessian(h, 3, pooled, 20, prior=4), np.eye(4) + 2.0)
    np.testing.assert_allclose(cal.expert_hessian(h, 3, pooled, 0, prior=4), np.eye(4))


def test_inverse_factor_is_the_upper_cholesky_factor_of_h_inverse():
    """U is upper triangular with a positive diagonal and U^T U = H^-1 (against numpy's inverse): the factor GPTQ's
    error feedback reads row by row."""
    rng = np.random.default_rng(6)
    x = correlated_inputs(rng, 300, 96)
    h = cal.damped(x.T.astype(np.float64) @ x)
    u = cal.inverse_factor(h)
    assert np.array_equal(u, np.triu(u)) and (np.diag(u) > 0).all()
    h_inv = np.linalg.inv(h)
    np.testing.assert_allclose(u.T @ u, h_inv, rtol=0, atol=1e-10 * np.abs(h_inv).max())
    np.testing.assert_allclose(u, np.linalg.cholesky(h_inv).T, rtol=0, atol=1e-8 * np.abs(u).max())
