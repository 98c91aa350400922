"""Page-ins copy into pool arrays' own memory: the view must be the array's memory, for every dtype a pool holds."""

import mlx.core as mx
import numpy as np
import pytest

from tqbench.managed import DmaCopy, GpuPrefetch, host_view


@pytest.mark.parametrize("dtype, np_dtype", [(mx.uint32, np.uint32), (mx.uint8, np.uint8),
                                             (mx.float16, np.float16), (mx.float32, np.float32)])
def test_a_write_through_the_view_is_what_mlx_computes_with(dtype, np_dtype):
    a = mx.zeros((5, 3, 8), dtype=dtype)
    mx.eval(a)
    v = host_view(a)
    rng = np.random.default_rng(0)
    slot = (rng.integers(0, 200, (3, 8))).astype(np_dtype)
    v[2] = slot
    # MLX reads the same memory: the slot's sum (computed by MLX) is the numpy sum, the other slots stay zero
    assert float(a[2].astype(mx.float32).sum()) == float(slot.astype(np.float64).sum())
    assert float(mx.abs(a[[0, 1, 3, 4]].astype(mx.float32)).sum()) == 0.0
    assert np.array_equal(np.array(a[2]), slot)


def test_bfloat16_is_written_as_its_raw_bits():
    a = mx.zeros((2, 4), dtype=mx.bfloat16)
    mx.eval(a)
    v = host_view(a)
    assert v.dtype == np.uint16
    v[1] = np.array([0x3F80, 0x4000, 0xBF80, 0x4040], dtype=np.uint16)  # 1, 2, -1, 3 in bfloat16
    assert a[1].astype(mx.float32).tolist() == [1.0, 2.0, -1.0, 3.0]
    assert a[0].astype(mx.float32).tolist() == [0.0] * 4


def test_prefetch_is_a_no_op_off_cuda_and_a_missing_driver_is_reported_not_raised():
    off = GpuPrefetch(enabled=False)
    off.to_gpu(np.zeros(16, np.uint8))
    assert not off.active and off.calls == 0 and off.error is None
    if mx.cuda.is_available():
        pytest.skip("this machine has a CUDA driver")
    on = GpuPrefetch(enabled=True)  # no libcuda here: inactive, with the reason
    assert not on.active and "libcuda" in on.error
    on.to_gpu(np.zeros(16, np.uint8))
    assert on.calls == 0


def test_dma_copies_are_off_without_cuda_and_the_copy_path_falls_back_to_numpy():
    """Off CUDA (or with the driver missing) DmaCopy does nothing and says so; a pool's copies are then numpy's."""
    off = DmaCopy(enabled=False)
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
    assert not off.active and off.copy(dst, src) is False and off.pin(src) is False and off.pinned_bytes == 0
    assert not dst.any()
    off.close()  # nothing pinned, no stream: a no-op
    if mx.cuda.is_available():
        pytest.skip("this machine has a CUDA driver")
    on = DmaCopy(enabled=True)
    assert not on.active and "libcuda" in on.error
